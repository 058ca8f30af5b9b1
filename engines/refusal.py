"""An engine's refusal of a request's parameters, told apart from an engine failure.

vLLM checks a request's sampling parameters when they are built, verified or added
(``logprobs`` above ``max_logprobs``, token ids outside the vocabulary, a schema the
structured-output backend cannot compile, ...). Both engine runtimes
(:mod:`engines.runtime`) and the replica's own check before a prefill
(:mod:`deployments.engine.calls`) turn such an error into :class:`EngineRefused`, which
crosses back to the ingress (pickled by Ray) and becomes a 400 naming the field; any other
engine error stays what it is and becomes a 502.
"""

from __future__ import annotations

from typing import Any


class EngineRefused(ValueError):
    """An engine replica refused a request's parameters before running it (vLLM's own checks:
    ``logprobs`` above ``max_logprobs``, token ids outside the vocabulary, a schema the
    structured-output backend cannot compile, ...). The ingress answers it with a 400 naming
    ``param``; any other engine failure is a 502."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def __reduce__(self) -> tuple[Any, ...]:  # Ray pickles it back to the ingress
        return (EngineRefused, (self.message, self.param))


def as_refusal(e: Exception) -> Exception:
    """vLLM's refusal of a request (its sampling parameters, at construction, ``verify`` or
    ``add_request``) as :class:`EngineRefused`; anything else as it is."""
    from vllm.exceptions import VLLMClientError

    if isinstance(e, (ValueError, TypeError, VLLMClientError)):
        return EngineRefused(str(e).strip()[:500], getattr(e, "parameter", None))
    return e


class EngineDown(RuntimeError):
    """The engine itself failed, not the request: its step thread or engine core died while
    the request ran (or before it was added). It crosses back to the ingress (pickled by
    Ray) as the replica's fault, so a stream under way there moves to another replica
    (stream migration, ``docs/design/migration.md``) instead of ending with an error."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message

    def __reduce__(self) -> tuple[Any, ...]:
        return (EngineDown, (self.message,))
