"""The ``prepare`` phase: from an authenticated body to :class:`Prepared` (its tokens,
sampling, block hashes, deadline), or a 4xx naming the field.

Cheap refusals first (the queue already full, the model, unsupported fields, bounds, joint
bounds, text longer than any context could hold), then the work: the chat template and the
tokenizer, off the event loop for long prompts and within ``ingress.render_timeout_s``, then
the tenant's tokens (:meth:`~deployments.ingress.admission.AdmissionPhase.admit`). A prompt
refused after tokenizing is charged what it cost. ``/tokenize`` and ``/detokenize`` (vLLM's
routes) are here too: they are the same work without the engines.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Request

from deployments.ingress.admission import AdmissionPhase
from deployments.ingress.openai_requests import (
    Bounds,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    RequestError,
    Resolved,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    check_bounds,
    include_usage,
    new_id,
    refuse_unsupported,
    sampling_of,
    single_prompt,
)
from deployments.ingress.openai_responses import LogprobFormat
from deployments.ingress.parsing import OutputParsers
from deployments.ingress.request import Prepared
from deployments.ingress.respond import error_response
from deployments.ingress.responses_api import ResponsesRequest, renamed, to_chat
from deployments.ingress.template_sandbox import SandboxBusy, SandboxTimeout, TemplateSandbox
from deployments.ingress.tokenizer import body_size, contents_of, template_variables, text_of

#: the request header by which a client asks for a shorter deadline (seconds)
TIMEOUT_HEADER = "X-Request-Timeout"


class PreparePhase(AdmissionPhase):
    """The ``prepare`` phase (see the module's docstring); a part of
    :class:`~deployments.ingress.core.IngressCore`."""

    def _init_prepare(self) -> None:
        ing = self.cfg.ingress
        self.bounds = Bounds(
            allowed_vllm_xargs=frozenset(ing.allowed_vllm_xargs),
            max_stop_sequences=ing.max_stop_sequences,
            max_logit_bias=ing.max_logit_bias,
            max_request_id_chars=ing.max_request_id_chars,
        )
        #: rendering and tokenizing of long prompts: two threads of their own, so a burst of
        #: long prompts queues here and never takes the default executor's threads
        self._prep_pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="pdserve-prep")
        #: request-supplied chat templates (ingress.trust_request_chat_template only)
        self.sandbox = TemplateSandbox() if ing.trust_request_chat_template else None
        #: prompts refused because rendering or tokenizing passed ingress.render_timeout_s
        self.render_timeouts = 0
        #: vLLM's tool-call and reasoning parsers for chat output (model.tool_call_parser, ...)
        self.parsers = OutputParsers(self.cfg.model, self.tokenizer.tok)

    async def prepare(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest | ResponsesRequest,
        charge: bool = True,
        tenant: str | None = None,
    ) -> Prepared:
        """Validation, tokenization, block hashes and (``charge``) the tenant's tokens; raises
        :class:`RequestError`. ``tenant`` is whose cache namespace the prompt is hashed in
        (the caller's own unless an operator names one). A Responses request is prepared as
        the chat it becomes (:func:`~deployments.ingress.responses_api.to_chat`), its
        refusals naming its own fields."""
        t0 = time.monotonic()
        if tenant is None:
            tenant = (await self.principal(request)).tenant
        responses = body if isinstance(body, ResponsesRequest) else None
        try:
            deadline = t0 + self._timeout_of(request)
            if responses is not None:
                body = to_chat(responses, self.parsers.reasoning)
            assert not isinstance(body, ResponsesRequest)
            chat = isinstance(body, ChatCompletionRequest)
            prep = await self._prepare(request, body, tenant, t0, deadline, chat, charge, responses)
        except RequestError as e:
            e.tenant = tenant
            if charge and e.tokenized:  # refused after the work: the work is charged
                await self.charge_tokens(tenant, e.tokenized)
            if responses is not None:
                renamed(e)
            raise
        return prep

    def _timeout_of(self, request: Request) -> float:
        """The request's time budget: ``ingress.request_timeout_s``, or less when the client
        sends ``X-Request-Timeout: SECONDS`` (more is held at the server's; not a number or
        not positive: 400 naming the header)."""
        cap = self.cfg.ingress.request_timeout_s
        raw = request.headers.get(TIMEOUT_HEADER)
        if raw is None:
            return cap
        try:
            asked = float(raw)
        except ValueError:
            asked = math.nan
        if not math.isfinite(asked) or asked <= 0:
            raise RequestError(
                f"{TIMEOUT_HEADER}: {raw[:40]!r} is not a positive number of seconds",
                TIMEOUT_HEADER,
            )
        return min(asked, cap)

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise RequestError(
                f"model {model!r} is not served here; /v1/models lists {self.model_name!r}",
                "model",
                status=404,
            )

    def _max_chars(self, tenant: str) -> int:
        """The longest text prompt ``tenant`` may send, in characters: its context cap (its
        ``max_context_tokens``, else ``max_model_len``) times
        ``ingress.max_prompt_chars_per_token``. Longer is refused before tokenizing."""
        cap = self.cfg.tenants.limits(tenant).max_context_tokens or self.cfg.model.max_model_len
        cap = min(cap, self.cfg.model.max_model_len)
        return cap * self.cfg.ingress.max_prompt_chars_per_token

    def _too_long(self, where: str, chars: int, max_chars: int) -> RequestError:
        return RequestError(
            f"{where}: {chars} characters, more than any prompt this tenant may send "
            f"({max_chars}: its context of tokens x ingress.max_prompt_chars_per_token)",
            where,
        )

    def _check_joint(self, body: Any, prompts: int, tenant: str) -> None:
        """The joint bounds of one request, before any work: ``prompts x n`` sequences and
        ``prompts x n x max_tokens`` output tokens (each cap alone would allow their product;
        a request that sends no ``max_tokens`` counts its default)."""
        ing = self.cfg.ingress
        n = body.n or 1
        seqs = prompts * n
        if seqs > ing.max_request_sequences:
            raise RequestError(
                f"n: {prompts} prompt(s) x n={n} = {seqs} sequences; at most "
                f"ingress.max_request_sequences={ing.max_request_sequences} per request",
                "n",
            )
        if isinstance(body, ChatCompletionRequest):
            asked = body.max_completion_tokens or vars(body).get("max_tokens")
        else:
            asked = body.max_tokens
        cap = self.cfg.tenants.limits(tenant).max_tokens
        default = min(ing.max_tokens_default, cap) if cap else ing.max_tokens_default
        per = asked if asked is not None else default
        total = seqs * per
        if total > ing.max_request_output_tokens:
            raise RequestError(
                f"max_tokens: {seqs} sequences x max_tokens {per} = {total} output tokens; at "
                f"most ingress.max_request_output_tokens={ing.max_request_output_tokens} per "
                "request",
                "max_tokens",
            )

    async def _prepare(
        self,
        request: Request,
        body: CompletionRequest | ChatCompletionRequest,
        tenant: str,
        t0: float,
        deadline: float,
        chat: bool,
        charge: bool,
        responses: ResponsesRequest | None = None,
    ) -> Prepared:
        if charge:
            self.check_queue_room(tenant)
        self._check_model(body.model)
        trust = self.cfg.ingress.trust_request_chat_template
        refuse_unsupported(body, trust)  # before tokenizing (a batch of prompts, say)
        check_bounds(body, self.bounds)
        if body.n is not None and body.n > self.cfg.ingress.max_n:
            raise RequestError(
                f"n={body.n} is above this server's limit of {self.cfg.ingress.max_n}", "n"
            )
        self._check_joint(body, 1, tenant)
        # tool_choice as vLLM takes it; required or a named tool become structured output
        # (in the request, before its sampling is built below)
        parsing = self.parsers.plan(body) if isinstance(body, ChatCompletionRequest) else None
        limits = self.cfg.tenants.limits(tenant)
        space = f"@{limits.cache_group}" if limits.cache_group else tenant
        salt = space if not body.cache_salt else f"{space}:{body.cache_salt}"
        max_len = self.cfg.model.max_model_len
        max_ctx = limits.max_context_tokens
        max_chars = self._max_chars(tenant)
        colocated = self.colocated
        text: str | None
        if chat:
            text = await self._render_chat(body, max_chars)
        else:
            assert isinstance(body, CompletionRequest)
            p = single_prompt(body.prompt)
            text = p if isinstance(p, str) else None
            if text is not None and len(text) > max_chars:
                raise self._too_long("prompt", len(text), max_chars)

        def tokens() -> tuple[list[int], str | None]:
            if chat:
                assert text is not None
                return self.tokenizer.encode(text, body.add_special_tokens), text
            assert isinstance(body, CompletionRequest)
            return self.tokenizer.completion_prompt(body.prompt, body.add_special_tokens)

        def work() -> tuple[list[int], str | None, Resolved, dict[str, list[int]]]:
            ids, txt = tokens()
            try:
                return checked(ids, txt)
            except RequestError as e:  # refused after tokenizing: its tenant pays the work
                e.tokenized = len(ids)
                raise

        def checked(
            ids: list[int], txt: str | None
        ) -> tuple[list[int], str | None, Resolved, dict[str, list[int]]]:
            if body.truncate_prompt_tokens is not None:
                keep = max_len if body.truncate_prompt_tokens == -1 else body.truncate_prompt_tokens
                if len(ids) > keep:
                    ids = ids[:keep] if body.truncation_side == "right" else ids[len(ids) - keep :]
                    txt = None if not chat else txt  # echo the prompt as truncated
            where = "messages" if chat else "prompt"
            if not ids:
                raise RequestError("the prompt is empty", where)
            if max_ctx is not None and len(ids) > max_ctx:
                raise RequestError(
                    f"{where}: the prompt has {len(ids)} tokens, above this tenant's "
                    f"max_context_tokens of {max_ctx}",
                    where,
                )
            resolved = sampling_of(
                body,
                prompt_tokens=len(ids),
                max_model_len=max_len,
                default_max_tokens=self.cfg.ingress.max_tokens_default,
                defaults=self.defaults,
                max_tokens_cap=limits.max_tokens,
                trust_request_chat_template=trust,
                clamp_to_room=responses is not None,
            )
            if colocated and resolved.sampling.prompt_logprobs is not None:
                field = "echo" if getattr(body, "echo", False) else "prompt_logprobs"
                raise RequestError(
                    f"{field}: prompt log-probabilities are not returned in colocated mode "
                    "(they come from a prefill replica in PD mode)",
                    field,
                )
            return ids, txt, resolved, self.index.hashes(ids, salt)

        where = "messages" if chat else "prompt"
        ids, text, resolved, hashes = await self._off_loop(work, body_size(body), where)
        if responses is not None:  # vLLM's: the response's id is the request's
            rid = responses.request_id
        else:
            rid = new_id("chatcmpl" if chat else "cmpl", body.request_id)
        extra: dict[str, Any] = {}
        if chat and body.return_prompt_text:  # type: ignore[union-attr]
            extra["prompt_text"] = text
        if body.return_token_ids:
            extra["prompt_token_ids"] = list(ids)
        prep = Prepared(
            rid=rid,
            chat=chat,
            tenant=tenant,
            ids=tuple(ids),
            sampling=resolved.sampling,
            hashes=hashes,
            stream=bool(body.stream),
            with_usage=include_usage(body),
            t0=t0,
            deadline=deadline,
            salt=salt,
            engine_rid=new_id(rid),
            fmt=LogprobFormat.of(body),
            echo=echo_of(body, text, lambda: self.tokenizer.decode(ids)),
            echo_only=resolved.echo_only,
            token_ids=bool(body.return_token_ids),
            extra=extra,
            parsing=parsing,
            responses=responses,
        )
        if charge:
            await self.admit(prep)
        prep.run.timing["prepare"] = time.monotonic() - t0
        return prep

    async def _render_chat(self, body: Any, max_chars: int) -> str:
        """The conversation through the chat template: the model's (in the preparation
        threads when long), or the request's own when the operator trusts them (in the
        template sandbox); at most ``max_chars`` characters (else a 400 before tokenizing)."""
        shown = sum(len(c) for c in contents_of(body.messages))
        if shown > max_chars:
            raise self._too_long("messages", shown, max_chars)
        own = getattr(body, "chat_template", None)
        if own is not None and self.sandbox is not None:
            job = self.tokenizer.template_job(body, template_variables(own))
            job.update(template=own, max_chars=max_chars)
            job["kwargs"] = {**self.tokenizer.special_tokens(), **job["kwargs"]}
            budget = self.cfg.ingress.render_timeout_s
            try:
                text = await self.sandbox.render(job, budget)
            except SandboxBusy:
                raise RequestError(
                    "chat_template: the template sandbox is busy with other requests' "
                    "templates; retry",
                    "chat_template",
                    status=503,
                    headers={"Retry-After": str(max(1, math.ceil(budget)))},
                ) from None
            except SandboxTimeout:
                self.render_timeouts += 1
                raise RequestError(
                    f"chat_template: rendering took longer than ingress.render_timeout_s="
                    f"{budget:g} s",
                    "chat_template",
                    status=413,
                ) from None
            except ValueError as e:
                raise RequestError(f"chat_template: {e}", "chat_template") from None
        else:
            job = self.tokenizer.template_job(body, self.tokenizer.template_vars)
            size = body_size(body)
            text = await self._off_loop(lambda: self.tokenizer.render(job), size, "messages")
        if len(text) > max_chars:
            raise self._too_long("messages", len(text), max_chars)
        return text

    async def _off_loop(self, fn: Callable[[], Any], size: int, where: str) -> Any:
        """``fn()``: inline when ``size`` (characters) is small, else in the ingress's
        preparation threads within ``ingress.render_timeout_s`` (past it a 413 naming
        ``where``; the thread finishes on its own, bounded by the prompt's size)."""
        if size <= self.cfg.ingress.tokenize_off_loop_chars:
            return fn()
        budget = self.cfg.ingress.render_timeout_s
        fut = asyncio.get_running_loop().run_in_executor(self._prep_pool, fn)
        try:
            return await asyncio.wait_for(fut, budget)
        except TimeoutError:
            self.render_timeouts += 1
            raise RequestError(
                f"{where}: rendering and tokenizing took longer than "
                f"ingress.render_timeout_s={budget:g} s",
                where,
                status=413,
            ) from None

    async def tokenize(
        self, request: Request, body: TokenizeCompletionRequest | TokenizeChatRequest
    ) -> Any:
        """vLLM's ``/tokenize``: the prompt's (or the rendered conversation's) token ids. The
        tokens are charged to the tenant's tokens bucket (work done, however full it is)."""
        try:
            who = await self.principal(request)
            self._check_model(body.model)
            if isinstance(body, TokenizeChatRequest):
                for name in ("media_io_kwargs", "mm_processor_kwargs"):
                    if getattr(body, name) is not None:
                        raise RequestError(f"{name} is not supported", name)
                ids = await self._tokenize_chat(body, who.tenant, self._max_chars(who.tenant))
            else:
                ids = await self._tokenize_text(
                    body.prompt, body.add_special_tokens, self._max_chars(who.tenant)
                )
            await self.charge_tokens(who.tenant, len(ids))
        except RequestError as e:
            return error_response(e)
        out: dict[str, Any] = {
            "count": len(ids),
            "max_model_len": self.cfg.model.max_model_len,
            "tokens": ids,
        }
        if body.return_token_strs:
            out["token_strs"] = self.tokenizer.tok.convert_ids_to_tokens(ids)
        return out

    async def _tokenize_chat(self, body: Any, tenant: str, max_chars: int) -> list[int]:
        text = await self._render_chat(body, max_chars)
        return await self._tokenize_text(text, body.add_special_tokens, max_chars, "messages")

    async def _tokenize_text(
        self,
        text: str,
        add_special_tokens: bool,
        max_chars: int,
        where: str = "prompt",
    ) -> list[int]:
        if len(text) > max_chars:
            raise self._too_long(where, len(text), max_chars)
        return await self._off_loop(
            lambda: self.tokenizer.encode(text, add_special_tokens), len(text), where
        )

    async def detokenize(self, request: Request, body: DetokenizeRequest) -> Any:
        """vLLM's ``/detokenize``: the text of token ids (ids outside the vocabulary: 400;
        more ids than the context holds: 400). Charged as tokens, like ``/tokenize``."""
        try:
            who = await self.principal(request)
            self._check_model(body.model)
            cap = self.cfg.model.max_model_len
            if len(body.tokens) > cap:
                raise RequestError(
                    f"tokens: {len(body.tokens)} ids; at most max_model_len={cap}", "tokens"
                )
            ids = self.tokenizer.check_ids(list(body.tokens), "tokens")
            await self.charge_tokens(who.tenant, len(ids))
            text = await self._off_loop(lambda: self.tokenizer.decode(ids), 4 * len(ids), "tokens")
        except RequestError as e:
            return error_response(e)
        return {"prompt": text}


def echo_of(
    body: CompletionRequest | ChatCompletionRequest,
    prompt_text: str | None,
    decoded: Callable[[], str],
) -> str | None:
    """What an ``echo`` response starts with: a completion's prompt (``decoded()`` when it
    came as token ids); for chat, the last message's content when it is the assistant's
    (vLLM's rule)."""
    if not body.echo:
        return None
    if isinstance(body, CompletionRequest):
        return prompt_text if prompt_text is not None else decoded()
    if body.messages and dict(body.messages[-1]).get("role") == "assistant":
        return text_of(dict(body.messages[-1]).get("content"), "messages")
    return None
