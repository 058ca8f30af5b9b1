"""The HTTP ingress: OpenAI's completions, chat completions and Responses API over the prefill
and decode replicas, one module per phase of a request.

==================  ==============================================================
module              what it holds
==================  ==============================================================
``http``            the FastAPI app, its middlewares and error envelope, the Serve
                    ingress deployment (the routes)
``core``            :class:`IngressCore`: ``complete`` as the request's phases in
                    order, batches, settling, live config, the index sync loop
``state``           the state every part reads, and how the parts depend on each
                    other
``request``         ``Prepared`` (a request's fixed facts), its ``RunState``, and
                    the tally of a response's parts
``prepare``         validation, bounds, templates, tokenizing, hashing
``tokenizer``       the model's tokenizer and chat template
``admission``       every admission decision: key, tenant tokens, queue, wait bound
``route``           the prefix index's hint; the decode-local rule
``hops``            the prefill call, the decode stream, KV releases, retries
``respond``         SSE and JSON bodies, error bodies, the settling stream
``responses_api``   OpenAI's Responses API: the request as a chat, its output items
                    and events
``warmup``          ``/health`` and the warm-up of replica pairs
``stats``           each finished request's record; ``/v1/pdserve/stats``
==================  ==============================================================

``docs/design.md`` walks one request through them.
"""

from __future__ import annotations

from typing import Any

__all__ = ["IngressCore"]


def __getattr__(name: str) -> Any:
    """``IngressCore`` on first use: importing a leaf module (the template sandbox's child
    process runs ``python -m deployments.ingress.template_sandbox``) must not import vLLM."""
    if name == "IngressCore":
        from deployments.ingress.core import IngressCore

        return IngressCore
    raise AttributeError(name)
