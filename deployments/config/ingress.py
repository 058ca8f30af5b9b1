"""``ingress``: the HTTP face (authentication, request bounds, overload bounds)."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator

from cluster.tenants import TENANT_PATTERN
from deployments.config.common import _Strict
from deployments.protocol import ENGINE_EXTRA_ARGS


class IngressConfig(_Strict):
    """The HTTP face: authentication, tenants and request limits."""

    num_replicas: int = Field(
        default=1, ge=1, le=1024, description="Ingress replicas (more than one needs Redis)."
    )
    num_cpus: float = Field(
        default=0.25, gt=0, le=64, description="Ray logical CPUs of the ingress."
    )
    resources: dict[str, float] = Field(
        default_factory=dict,
        description="Ray custom resources each ingress replica reserves (to pin it to the "
        "head group, say, where the tenant keys are mounted).",
    )
    api_keys: dict[str, str] = Field(
        default_factory=dict,
        description="Plain API key -> tenant name, for development (the keys sit in the "
        "config in the clear; production: tenants.key_hashes or tenants.keys_file). No key "
        "source at all: "
        "every request is tenant 'anonymous'. Each tenant's prompts get their own cache "
        "salt, so tenants never share KV blocks unless tenants.*.cache_group says so.",
    )
    max_ongoing_requests: int = Field(
        default=512,
        ge=1,
        le=100_000,
        description="Serve's cap on requests in flight at the ingress.",
    )
    max_tokens_default: int = Field(
        default=256, ge=1, le=1_000_000, description="max_tokens when a request sends none."
    )
    engine_timeout_s: float = Field(
        default=120.0, gt=0, le=3600, description="Longest wait for one engine call before a 504."
    )
    request_timeout_s: float = Field(
        default=600.0,
        gt=0,
        le=86_400,
        description="Deadline of one request from its arrival: past it the client gets a 504 "
        "(mid-stream: an SSE error event, then [DONE]) and both engines abort the request. A "
        "client may ask for less with the X-Request-Timeout header (seconds).",
    )
    replica_retries: int = Field(
        default=1,
        ge=0,
        le=3,
        description="Times a request is sent again when its engine replica died (or became "
        "unreachable) before the client got anything: a prefill goes to another prefill "
        "replica; a decode goes to another decode replica, which computes the prompt itself "
        "(the dead replica may have taken the prompt's KV already). Once a token was sent the "
        "stream migrates instead (migration_limit).",
    )
    migration_limit: int = Field(
        default=2,
        ge=0,
        le=16,
        description="Times one stream (each sequence of n > 1 on its own) may move to another "
        "decode replica when its replica is lost after tokens were sent (the actor died, its "
        "engine failed, a drain outlasted drain_timeout_s): the ingress sends the prompt plus "
        "the tokens sent as a new request for the rest, and the same response goes on. 0 turns "
        "migration off (the stream then ends with an SSE error event). Live: user_config.",
    )
    migration_max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Sequence length (prompt plus tokens sent) above which a stream is not "
        "migrated (its continuation's prefill would cost more than the answer is worth here): "
        "it ends with an SSE error event saying so. None: no bound but the model's. Live: "
        "user_config.",
    )
    health_timeout_s: float = Field(
        default=5.0, gt=0, le=600, description="Longest wait for one engine's readiness probe."
    )
    warm_up: bool = Field(
        default=True,
        description="/health says ready only after one request has gone from every prefill "
        "replica to every decode replica (NIXL handshakes and first-use costs paid before the "
        "first client's request); new replicas are warmed as they join.",
    )
    max_queued_requests_per_replica: int = Field(
        default=128,
        ge=1,
        le=1_000_000,
        description="Overload bound: prefill requests queued or in flight per prefill replica "
        "(this ingress's own count, or the replicas' reported queues when larger); above it "
        "a new request gets 503 with Retry-After at once.",
    )
    max_queued_uncached_tokens_per_replica: int = Field(
        default=262_144,
        ge=1,
        le=10**9,
        description="Overload bound: uncached prompt tokens queued per prefill replica (about "
        "10 s of prefill work for the test model on 2 CPU cores); above it a 503.",
    )
    max_expected_wait_s: float = Field(
        default=30.0,
        ge=0,
        le=3600,
        description="Overload bound in seconds: when the requests waiting in the engines "
        "(queued, not running, from the replicas' reports) over the engines' completion rate "
        "(last 20 s) pass it, a new request gets 503 with Retry-After at once (Little's law; "
        "controllers/overload.py). 0: off. Unlike the count bounds it sees the decode side "
        "and does not depend on the model's speed.",
    )
    overload_spare_factor: float = Field(
        default=2.0,
        ge=1,
        le=100,
        description="Past an overload bound, a request whose tenant, with it, would still hold "
        "less than an equal share of the prompts in flight at the prefill is admitted, up to "
        "this many times the bound; the others get the 503 (a flood is refused, not the quiet "
        "tenant beside it; controllers/overload.py). For the wait bound with the prefill's "
        "fair share on, such a tenant's ceiling reads the wait ahead of its request under "
        "the share (share_ahead). 1: everyone is refused at the bound.",
    )
    overload_spare_reuse: float = Field(
        default=0.5,
        ge=0,
        le=1,
        description="Past an overload bound, a request with at least this share of its prompt "
        "tokens cached (by the prefix index) is admitted too, up to overload_spare_factor "
        "times the bound: it costs the prefill little and Fairway serves it first "
        "(controllers/overload.py, reused). 0: no request is spared for its reuse.",
    )
    overload_retry_after_s: int = Field(
        default=1, ge=1, le=3600, description="Retry-After (s) of an overload 503."
    )
    max_n: int = Field(
        default=128,
        ge=1,
        le=16384,
        description="Largest n (choices per prompt) a request may ask for (OpenAI's is 128; "
        "vLLM's 16,384).",
    )
    max_batch_prompts: int = Field(
        default=128,
        ge=1,
        le=1024,
        description="Most prompts in one completions request (vLLM's is 1,024).",
    )
    max_body_bytes: int = Field(
        default=16 * 1024 * 1024,
        ge=1024,
        le=1024**3,
        description="Largest request body (bytes); above it a 413.",
    )
    max_json_depth: int = Field(
        default=64, ge=4, le=1000, description="Deepest JSON nesting of a body; above it a 400."
    )
    tokenize_off_loop_chars: int = Field(
        default=2048,
        ge=0,
        description="Prompts longer than this (characters) are tokenized and hashed in a "
        "worker thread, so the event loop keeps streaming other requests.",
    )
    auth: Literal["keys", "none"] = Field(
        default="keys",
        description="'keys': every route but /health needs a key (a tenant key for the "
        "OpenAI routes, an operator key for /v1/pdserve/*), checked from the headers before "
        "the body is read; at least one key source must be configured (tenants.key_hashes, "
        "tenants.keys_file, tenants.keys_in_redis or ingress.api_keys), else the deploy "
        "fails naming this field. 'none': no keys at all, every request is tenant "
        "'anonymous' and the operator routes are open: only for an endpoint that nobody "
        "else can reach (Serve's proxy on loopback), and an explicit choice.",
    )
    max_auth_failures: int = Field(
        default=20,
        ge=1,
        le=1_000_000,
        description="Failed keys (401s) one client address may send at once; past it the "
        "address gets 429 with Retry-After before its key is even looked up.",
    )
    auth_failures_per_minute: float = Field(
        default=30.0,
        gt=0,
        le=1_000_000,
        description="Failed keys per minute one client address may send, sustained (the "
        "refill rate of the bucket above).",
    )
    trust_request_chat_template: bool = Field(
        default=False,
        description="Accept a request's own chat template (the 'chat_template' field), as "
        "vLLM's --trust-request-chat-template does. Off: refused with a 400 naming it. On: it "
        "renders in a separate process with ingress.render_timeout_s and a memory bound, "
        "which is killed when it passes either.",
    )
    render_timeout_s: float = Field(
        default=2.0,
        gt=0,
        le=600,
        description="Time budget to render a chat template and tokenize a prompt (off the "
        "event loop); past it the request gets a 413 naming the field that made it slow.",
    )
    max_prompt_chars_per_token: int = Field(
        default=32,
        ge=1,
        le=1_000_000,
        description="A text prompt (or rendered conversation) longer than this many "
        "characters per token of the context allowed (the tenant's max_context_tokens, else "
        "model.max_model_len) is refused with a 400 before it is tokenized: no tokenizer "
        "writes tokens this long, so it could only be refused after the work.",
    )
    allowed_vllm_xargs: list[str] = Field(
        default_factory=list,
        description="Keys of a request's vllm_xargs (vLLM's extension dict, which reaches "
        "the engines' SamplingParams.extra_args) that may pass, for the operator's own "
        "logits processors or plug-ins; any other key is a 400 naming it. vLLM's own fields "
        "(kv_transfer_params, ec_transfer_params) can never be allowed.",
    )
    max_request_sequences: int = Field(
        default=256,
        ge=1,
        le=1_000_000,
        description="Most sequences one request may run: prompts x n (each cap alone, "
        "max_batch_prompts and max_n, would allow their product).",
    )
    max_request_output_tokens: int = Field(
        default=262_144,
        ge=1,
        le=10**9,
        description="Most output tokens one request may ask for: prompts x n x max_tokens.",
    )
    max_stop_sequences: int = Field(
        default=16,
        ge=0,
        le=10_000,
        description="Most stop strings (and, apart, stop token ids and bad words) a request "
        "may send: the detokenizer checks every stop string at every step of the shared "
        "decode engine.",
    )
    max_logit_bias: int = Field(
        default=300,
        ge=0,
        le=1_000_000,
        description="Most logit_bias entries a request may send (OpenAI's limit is 300).",
    )
    max_request_id_chars: int = Field(
        default=128,
        ge=8,
        le=1024,
        description="Longest client request_id; it may hold letters, digits and '._:-' only "
        "(it reaches logs, engine request ids and spans). Past either: a 400.",
    )
    health_cache_s: float = Field(
        default=1.0,
        ge=0,
        le=60,
        description="How long one /health answer is reused: probes from many load balancers "
        "cost at most one readiness check per this many seconds.",
    )

    @field_validator("allowed_vllm_xargs")
    @classmethod
    def _xargs(cls, v: list[str]) -> list[str]:
        bad = sorted(set(v) & ENGINE_EXTRA_ARGS)
        if bad:
            raise ValueError(f"{bad[0]!r} is vLLM's own field (set by pdserve), never a request's")
        return v

    @field_validator("api_keys")
    @classmethod
    def _keys(cls, v: dict[str, str]) -> dict[str, str]:
        """Checked here rather than typed as ``TenantName``: pydantic's error would carry the
        offending entry's location, which is the plain key."""
        import re

        bad = [k for k, t in v.items() if not k.strip() or not t.strip()]
        if bad:
            raise ValueError("API keys and tenant names must be non-empty")
        name = next((t for t in v.values() if not re.match(TENANT_PATTERN, t)), None)
        if name is not None:
            raise ValueError(f"tenant {name!r}: letters, digits, '_', '.', '-' only")
        return v
