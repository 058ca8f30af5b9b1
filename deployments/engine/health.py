"""An engine replica's health: ready once it has served, replaced by Serve once wedged.

The ingress's ``/health`` asks each role's ``ready``, which answers only once that engine
has served a probe request end to end, so ``/health`` means both engines can serve; Serve
calls ``check_health`` on its own period and replaces a replica whose engine is
:meth:`Health.wedged`; the routers stop sending to it as soon as its load report says so
(:mod:`.reports`).
"""

from __future__ import annotations

import math

from deployments.engine.calls import Calls
from deployments.protocol import EngineRequest, Sampling


class Health(Calls):
    """Readiness and wedge detection (see the module docstring)."""

    async def ready(self) -> bool:
        """True once this engine has served a probe request end to end (cached after)."""
        if self._ready:
            return True
        self._seq += 1
        probe = EngineRequest(
            request_id=f"ready-probe-{self._seq}",
            prompt_token_ids=(1, 2, 3, 4),
            sampling=Sampling(max_tokens=1, temperature=0.0),
        )
        async for _ in self._generate(probe, probe.sampling.to_vllm_kwargs(), None, delta=False):
            pass
        self._ready = True
        return True

    def wedged(self) -> str | None:
        """Why this replica's engine cannot serve (its thread failed or died, or its step loop
        has not come round for ``wedge_timeout_s``), or ``None``."""
        eng = self.engine
        if eng.failure is not None:
            return f"engine failed: {eng.failure!r}"
        stalled = eng.stalled_s()
        if math.isinf(stalled):
            return "the engine thread has died"
        limit = self.cfg.engine(self.role).wedge_timeout_s
        if stalled > limit:
            return f"the engine's step loop has not come round for {stalled:.0f} s (> {limit:g} s)"
        return None

    async def check_health(self) -> None:
        """Serve's health probe: raises when the engine is wedged (:meth:`wedged`), so Serve
        replaces the replica; the routers stop sending to it as soon as its report says so."""
        why = self.wedged()
        if why is not None:
            raise RuntimeError(why)
