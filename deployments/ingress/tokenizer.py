"""The model's tokenizer and chat template at the ingress (which tokenizes once; the engines
get token ids), and the cheap measures of a request's text taken before any tokenizer runs.

A request's ``chat_template_kwargs`` reach the model's template only where the template
reads them (vLLM's rule, :func:`template_variables`); the reserved ones are a 400
(:data:`RESERVED_TEMPLATE_KWARGS`). A request's own template renders elsewhere
(:mod:`deployments.ingress.template_sandbox`), and only when the operator trusts them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from deployments.ingress.openai_requests import RequestError, single_prompt

#: ``chat_template_kwargs`` a request may not send: vLLM refuses ``chat_template`` and
#: ``tokenize`` (the template itself, and whether the call returns text); the others are set
#: by the request's own fields or change what HF's ``apply_chat_template`` returns
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "chat_template",
        "tokenize",
        "messages",
        "conversation",
        "tools",
        "documents",
        "add_generation_prompt",
        "continue_final_message",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
    }
)


def template_variables(template: str | None) -> frozenset[str]:
    """The variables a chat template reads that it does not set itself (vLLM's
    ``_resolve_chat_template_kwargs``: Jinja's own parser, the template is not run)."""
    if not template:
        return frozenset()
    import jinja2.ext
    import jinja2.meta
    import jinja2.sandbox
    from jinja2.exceptions import TemplateSyntaxError

    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    try:
        return frozenset(jinja2.meta.find_undeclared_variables(env.parse(template)))
    except TemplateSyntaxError:
        return frozenset()


class Tokenizer:
    """The model's tokenizer and chat template, loaded once per ingress replica (the ingress
    tokenizes once; the engines get token ids)."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(path)
        self.vocab = len(self.tok)
        template = self.tok.chat_template if isinstance(self.tok.chat_template, str) else None
        #: what the model's template reads: the only chat_template_kwargs that reach it
        self.template_vars = template_variables(template)

    def check_ids(self, ids: list[int], where: str) -> list[int]:
        bad = next((t for t in ids if not 0 <= t < self.vocab), None)
        if bad is not None:
            raise RequestError(
                f"{where}: token id {bad} is outside the vocabulary [0, {self.vocab})", where
            )
        return ids

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        return list(self.tok(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, ids: list[int] | tuple[int, ...], skip_special: bool = False) -> str:
        return str(self.tok.decode(list(ids), skip_special_tokens=skip_special))

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id])

    def completion_prompt(
        self, prompt: Any, add_special_tokens: bool
    ) -> tuple[list[int], str | None]:
        """``(token ids, prompt text)`` of one completion prompt: the text when it came as
        text, ``None`` when it came as token ids (decoded only if ``echo`` needs it)."""
        p = single_prompt(prompt)
        if isinstance(p, list):
            return self.check_ids(p, "prompt"), None
        return self.encode(p, add_special_tokens), p

    def template_job(self, req: Any, template_vars: frozenset[str]) -> dict[str, Any]:
        """What rendering ``req`` takes: its messages (content parts as text) and the
        template's keyword arguments, as vLLM passes them: tools and documents, and those
        ``chat_template_kwargs`` the template reads (``template_vars``; others are dropped,
        as vLLM drops them). A reserved kwarg (:data:`RESERVED_TEMPLATE_KWARGS`) is a 400
        naming it."""
        msgs = []
        for i, m in enumerate(req.messages):
            d = dict(m)
            d["content"] = text_of(d.get("content"), f"messages.{i}.content")
            if d.get("role") == "assistant":
                _assistant_turn(d, f"messages.{i}")
            msgs.append(d)
        asked: dict[str, Any] = dict(getattr(req, "chat_template_kwargs", None) or {})
        reserved = sorted(set(asked) & RESERVED_TEMPLATE_KWARGS)
        if reserved:
            name = f"chat_template_kwargs.{reserved[0]}"
            raise RequestError(
                f"{name}: may not be set by a request (vLLM refuses it too); "
                + (
                    "a request's own template goes in the 'chat_template' field, and only "
                    "when the operator trusts them (ingress.trust_request_chat_template)"
                    if reserved[0] == "chat_template"
                    else "it is set by the request's own fields or by pdserve"
                ),
                name,
            )
        kwargs = {k: v for k, v in asked.items() if k in template_vars}
        effort = getattr(req, "reasoning_effort", None)
        if effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
            # vLLM turns thinking on or off by the effort, where the template reads it
            if "enable_thinking" in template_vars:
                kwargs.setdefault("enable_thinking", effort != "none")
        tools = getattr(req, "tools", None)
        documents = getattr(req, "documents", None)
        return {
            "messages": msgs,
            "tools": [t.model_dump(mode="json", exclude_none=True) for t in tools]
            if tools
            else None,
            "documents": documents or None,
            "add_generation_prompt": req.add_generation_prompt,
            "continue_final_message": req.continue_final_message,
            "kwargs": kwargs,
        }

    def render(self, job: dict[str, Any]) -> str:
        """``job`` (:meth:`template_job`) through the model's own chat template."""
        kwargs = dict(job["kwargs"])
        for name in ("tools", "documents"):
            if job.get(name):
                kwargs[name] = job[name]
        try:
            return str(
                self.tok.apply_chat_template(
                    job["messages"],
                    tokenize=False,
                    add_generation_prompt=job["add_generation_prompt"],
                    continue_final_message=job["continue_final_message"],
                    **kwargs,
                )
            )
        except Exception as e:  # the template refuses the conversation (roles, kwargs, ...)
            raise RequestError(f"messages: the chat template refused them: {e}", "messages") from e

    def special_tokens(self) -> dict[str, Any]:
        """The template variables ``apply_chat_template`` adds (``bos_token``, ...), for a
        template rendered elsewhere (:mod:`deployments.ingress.template_sandbox`)."""
        return {k: v for k, v in self.tok.special_tokens_map.items() if isinstance(v, str)}


def _assistant_turn(msg: dict[str, Any], where: str) -> None:
    """An assistant message as vLLM hands it to the chat template (``vllm.renderers.
    chat_utils``): its tool calls' ``arguments`` as objects, not JSON strings (what
    templates expect; vLLM's own ``_postprocess_messages``), its ``reasoning`` also as
    ``reasoning_content``. ``msg`` is the request's message copied; its tool calls are
    copied before they change."""
    import copy

    from vllm.exceptions import VLLMValidationError
    from vllm.renderers.chat_utils import _postprocess_messages

    reasoning = msg.get("reasoning")
    if reasoning is not None:
        msg["reasoning_content"] = reasoning
    calls = msg.get("tool_calls")
    if calls is None:
        return
    msg["tool_calls"] = copy.deepcopy(list(calls))
    try:
        _postprocess_messages([msg])  # type: ignore[list-item]
    except VLLMValidationError as e:
        raise RequestError(f"{where}.tool_calls: {e}", f"{where}.tool_calls") from None


def model_defaults(path: str) -> dict[str, Any]:
    """The model's default sampling values (vLLM's ``default_sampling_params``: the keys of
    its ``generation_config.json`` that vLLM's server applies)."""
    f = Path(path) / "generation_config.json"
    if not f.is_file():
        return {}
    cfg = json.loads(f.read_text())
    keys = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p")
    out = {k: cfg[k] for k in keys if cfg.get(k) is not None}
    if cfg.get("max_new_tokens") is not None:
        out["max_tokens"] = cfg["max_new_tokens"]
    return out


def text_of(content: Any, where: str) -> str:
    """A message's content as text: a string, or text parts joined by newlines (vLLM's
    "string" content format); any other part is refused (text-only models)."""
    if content is None or isinstance(content, str):
        return content or ""
    try:
        content = list(content)  # vLLM's Iterable fields validate lazily, here
    except ValidationError as e:
        errs = e.errors()
        msg = errs[0]["msg"] if errs else "invalid content part"
        raise RequestError(f"{where}: {msg}", where) from None
    parts = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in ("text", "input_text", "output_text", "refusal"):
            raise RequestError(
                f"{where}: content part of type {kind!r} is not supported (text only)", where
            )
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if not isinstance(text, str):
            raise RequestError(f"{where}: a {kind} part needs a string, not {text!r}"[:300], where)
        parts.append(text)
    return "\n".join(parts)


def contents_of(messages: Any) -> list[str]:
    """The string contents of a chat's messages (text parts and tool calls' arguments
    included), cheaply: before the template runs, to refuse a conversation no context could
    hold."""
    out: list[str] = []
    for m in messages or ():
        d = dict(m)
        c = d.get("content")
        if isinstance(c, str):
            out.append(c)
        elif isinstance(c, list):
            out.extend(
                p.get("text") or ""
                for p in c
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        calls = d.get("tool_calls")
        if isinstance(calls, list):  # an assistant's calls are rendered too
            for call in calls:
                f = call.get("function") if isinstance(call, dict) else None
                if isinstance(f, dict) and isinstance(f.get("arguments"), str):
                    out.append(f["arguments"])
    return out


def body_size(body: Any) -> int:
    """A cheap size of the work in characters: a chat's contents (and its tools), a prompt's
    text (token ids count as a few each); any request with ``messages`` (``/tokenize``'s too)
    is a chat."""
    if getattr(body, "messages", None) is not None:
        total = sum(len(c) for c in contents_of(body.messages))
        total += 64 * (len(body.messages) + len(getattr(body, "tools", None) or ()))
        return total
    p = body.prompt
    if isinstance(p, str):
        return len(p)
    return sum(len(x) if isinstance(x, (str, list)) else 4 for x in p or ())
