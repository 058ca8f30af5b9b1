"""``tenants``: API keys (stored hashed), each tenant's limits and cache sharing."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_serializer, field_validator

from cluster.tenants import TENANT_PATTERN, is_key_hash
from deployments.config.common import _Strict

TenantName = Annotated[
    str,
    Field(
        pattern=TENANT_PATTERN,
        description="A tenant (or cache group) name: letters, digits, '_', '.', '-'.",
    ),
]


#: The limits a tenant has when the config says nothing (``tenants.default``): no tenant is
#: unlimited unless a config says so (``null``) explicitly.
DEFAULT_REQUESTS_PER_SECOND = 20.0
DEFAULT_TOKENS_PER_MINUTE = 1_000_000


class TenantLimits(_Strict):
    """One tenant's limits. The rate limits have defaults (a tenant with no limits is an
    explicit ``null``); null means no limit of that kind. In ``tenants.by_name`` a field
    given (null included) replaces the default's, a field left out keeps it."""

    requests_per_second: float | None = Field(
        default=DEFAULT_REQUESTS_PER_SECOND,
        gt=0,
        le=1_000_000,
        description="Sustained requests per second (every route that does work; charged "
        "before the body is read). null: no limit.",
    )
    burst_requests: int | None = Field(
        default=None,
        ge=1,
        le=1_000_000,
        description="Requests allowed at once above the sustained rate (null: the rate, "
        "rounded up, at least 1).",
    )
    tokens_per_minute: int | None = Field(
        default=DEFAULT_TOKENS_PER_MINUTE,
        ge=1,
        le=10**12,
        description="Prompt plus requested output tokens (max_tokens x n) per minute; the part "
        "of max_tokens not produced is given back when the request ends. A request needing more "
        "than this at once is a 400 naming max_tokens. Tokenizing is charged too: /tokenize, "
        "/detokenize, and a prompt refused after it was tokenized (over a cap). null: no "
        "limit.",
    )
    max_context_tokens: int | None = Field(
        default=None, ge=1, le=10_000_000, description="Longest prompt, in tokens."
    )
    max_tokens: int | None = Field(
        default=None,
        ge=1,
        le=10_000_000,
        description="Largest max_tokens a request may ask for (and the default's cap).",
    )
    cache_group: TenantName | None = Field(
        default=None,
        description="Tenants with the same cache_group share prefix-cache hits (and so each "
        "other's timing signal); null: the tenant's cache is its own.",
    )

    def buckets(self) -> dict[str, tuple[float, float]]:
        """``{bucket name: (rate per second, capacity)}`` of the limits that are set."""
        out: dict[str, tuple[float, float]] = {}
        if self.requests_per_second is not None:
            burst = self.burst_requests or max(1, -(-self.requests_per_second // 1))
            out["requests"] = (self.requests_per_second, float(burst))
        if self.tokens_per_minute is not None:
            out["tokens"] = (self.tokens_per_minute / 60.0, float(self.tokens_per_minute))
        return out


class TenantsConfig(_Strict):
    """Who may call (API keys, stored hashed) and each tenant's limits and cache sharing.

    Keys resolve to tenants from ``key_hashes``, ``keys_file`` (re-read when it changes) and,
    with ``keys_in_redis``, Redis (``pdserve keys add|revoke``); plain ``ingress.api_keys`` are
    for development. With no key source at all, every request is tenant ``anonymous``.
    """

    key_hashes: dict[str, TenantName] = Field(
        default_factory=dict,
        description="'sha256:<hex digest of the key>' -> tenant (pdserve keys hash KEY).",
    )
    operator_key_hashes: list[str] = Field(
        default_factory=list,
        description="'sha256:<hex digest>' of operator keys (pdserve keys new --operator): "
        "only they reach /v1/pdserve/* (stats, route explanations, resets), and they reach "
        "nothing else. A keys file or Redis holds operator keys as '<hash>: \"@operator\"'.",
    )
    keys_file: str | None = Field(
        default=None,
        description="YAML/JSON file of 'sha256:<hex>: tenant' (a mounted Secret, say); re-read "
        "when it changes, so keys are added or revoked without a restart ('~' expands).",
    )
    keys_in_redis: bool = Field(
        default=False,
        description="Also look keys up in Redis (index.redis_url), where pdserve keys add "
        "--redis puts them.",
    )
    key_cache_s: float = Field(
        default=2.0,
        ge=0,
        le=3600,
        description="How long a Redis key lookup is reused (a revoked key works at most this "
        "long).",
    )
    default: TenantLimits = Field(
        default_factory=TenantLimits, description="Limits of every tenant not in by_name."
    )
    by_name: dict[TenantName, TenantLimits] = Field(
        default_factory=dict,
        description="Per tenant: fields set here (not null) replace the default's.",
    )
    limits_backend: Literal["auto", "memory", "redis"] = Field(
        default="auto",
        description="Where the rate-limit buckets live: 'redis' (index.redis_url; shared by "
        "every ingress replica), 'memory' (per ingress replica), 'auto': redis when "
        "index.backend is redis.",
    )

    @field_validator("key_hashes", "operator_key_hashes")
    @classmethod
    def _hashes(cls, v: Any) -> Any:
        bad = [h for h in v if not is_key_hash(h)]
        if bad:
            raise ValueError(f"{bad[0][:20]!r} is not 'sha256:<64 lowercase hex digits>'")
        return v

    @field_serializer("by_name")
    def _by_name(self, v: dict[str, TenantLimits]) -> dict[str, dict[str, Any]]:
        """Only the fields each entry gives, so a dumped config read again (the replicas get
        it so) still lets the default fill the rest."""
        return {k: lim.model_dump(mode="json", exclude_unset=True) for k, lim in v.items()}

    def limits(self, tenant: str) -> TenantLimits:
        """``tenant``'s limits: the fields ``by_name`` gives (an explicit null included) over
        ``default``."""
        own = self.by_name.get(tenant)
        if own is None:
            return self.default
        return self.default.model_copy(update=own.model_dump(exclude_unset=True))

    def has_keys(self) -> bool:
        """Whether any key source is configured here (ingress.api_keys aside)."""
        return bool(self.key_hashes or self.operator_key_hashes or self.keys_file)
        # keys_in_redis counts too, but needs the index's URL: AppConfig checks it
