"""The state every part of the ingress reads: the config, the engine handles, the tokenizer,
the index view, the routers' directories, telemetry. :class:`IngressState` declares it;
:class:`~deployments.ingress.core.IngressCore` sets it up, and each part (a mixin) adds the
state it owns in its ``_init_*``.

The parts inherit what they call, so each one's dependencies are its bases::

    IngressState
    ├── RoutePhase                       (route)
    │   └── MigrationPhase               (migration; also a HopsPhase)
    └── AdmissionPhase                   (admission)
        ├── PreparePhase                 (prepare)
        ├── HopsPhase                    (hops)
        │   └── HealthPhase              (warmup)
        └── Records                      (stats)
            └── RespondPhase             (respond)
                └── ResponsesPhase       (responses_api)

and :class:`~deployments.ingress.core.IngressCore` joins them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from opentelemetry.trace import Tracer

    from deployments.config import AppConfig
    from deployments.ingress.tokenizer import Tokenizer
    from deployments.prefix import IndexView
    from deployments.router_registry import HandleWaits, ReplicaDirectory
    from deployments.telemetry import Metrics


class IngressState:
    """What :meth:`IngressCore.__init__ <deployments.ingress.core.IngressCore>` sets up."""

    #: the app's config (its ``routing`` section replaced live by ``user_config``)
    cfg: AppConfig
    app_name: str
    #: this ingress replica's id (reported in each non-streamed response)
    replica_id: str
    #: Serve handles of the two engine deployments (``decode`` is ``prefill`` when colocated)
    prefill: Any
    decode: Any
    decode_stream: Any
    #: colocated mode: one engine deployment does both phases
    colocated: bool
    tokenizer: Tokenizer
    #: the model's default sampling values (its ``generation_config.json``)
    defaults: dict[str, Any]
    model_name: str
    tracer: Tracer
    metrics: Metrics
    #: the prefix index as this ingress sees it
    index: IndexView
    #: the routers' replica directories per role, with each replica's last load report
    directories: dict[str, ReplicaDirectory]
    #: where the routers note how long a call waited at its handle (cold starts)
    waits: dict[str, HandleWaits]
    #: the serverless autoscaler manages the engine deployments
    autoscaling: bool
    #: requests that passed ``prepare``
    requests: int
    #: tasks that outlive the request they start from (releases, give-backs)
    _background: set[asyncio.Task[Any]]

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> None:
        """Run ``coro`` in a task of its own, kept until it ends (the event loop holds tasks
        only weakly)."""
        task = asyncio.get_running_loop().create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
