"""The scheduler policy's parameters in an engine replica: calibrated at start, changed live.

Not on a request's path, but deciding it: Fairway orders the prefill queue and TWP gates
decode admission inside the engine (:mod:`engines.scheduler`). At start a replica that
decodes (decode role, or colocated; ``calibrate_decode``) measures its own single-stream
inter-token latency and hands it to TWP (``_calibrate_decode``); while it serves, Serve's
``user_config`` changes Fairway's and TWP's parameters between two engine steps without a
restart (``reconfigure``); ``live_config`` is what the engine runs with now.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from deployments.engine.calls import Calls
from deployments.protocol import EngineRequest, Sampling
from engines.runtime import AsyncLLMEngine

log = logging.getLogger(__name__)


class LiveConfig(Calls):
    """Calibration and live reconfiguration (see the module docstring)."""

    async def _calibrate_decode(self, tokens: int = 64, skip: int = 8) -> None:
        """Measure this engine's single-stream inter-token latency as it serves (two requests
        of ``tokens`` output tokens through the engine thread; the median of the ITLs the
        scheduler recorded after the first ``skip`` steps, the lower of the two runs: other
        replicas starting on the node only add to it) and hand it to the TWP gate
        (:meth:`engines.scheduler.PdserveSchedulerMixin.calibrate_decode`); from then on the
        scheduler re-estimates it from the lone streams it serves
        (:meth:`~engines.scheduler.PdserveSchedulerMixin.track_l_min`)."""
        policy = self.engine.load.get("policy")
        if policy is None or policy.get("twp_state") is None:
            return
        floors: list[float] = []
        for _ in range(2):  # two runs, the lower floor: a neighbour's start-up only adds
            start = int((await self.engine.rpc("report"))["policy"]["step"])
            self._seq += 1
            probe = EngineRequest(
                request_id=f"calibrate-{self._seq}",
                prompt_token_ids=tuple(range(5, 21)),
                sampling=Sampling(max_tokens=tokens, temperature=0.0, ignore_eos=True),
            )
            kw = probe.sampling.to_vllm_kwargs()
            async for _ in self._generate(probe, kw, None, delta=True):
                pass
            itls = sorted(await self.engine.rpc("lone_itls", start + skip))
            if len(itls) >= 8:
                floors.append(itls[len(itls) // 2])
        if not floors:
            return

        self.calibration = await self.engine.rpc("calibrate_decode", min(floors))
        await self.engine.rpc("track_l_min")
        log.info("decode replica %s: TWP calibration %s", self.replica_id, self.calibration)

    async def reconfigure(self, user_config: dict[str, Any]) -> None:
        """Serve's ``user_config`` hook (at start and on every change, no restart): Fairway's
        and TWP's parameters (:class:`~deployments.config.EngineLiveConfig`), applied between
        two engine steps, keeping every request's state; streams go on. A bad value is
        refused with the field named (logged, and in :meth:`stats` as
        ``live_config_error``) and the old values stay: raising here would make Serve fail
        the replica."""
        from deployments.config import EngineLiveConfig, LiveConfigError, parse_live_config

        try:
            live = parse_live_config(EngineLiveConfig, user_config)
            if live.fairway is not None or live.twp is not None:
                if self.engine.load.get("policy") is None:
                    raise LiveConfigError(
                        f"user_config: {self.role}.scheduler_cls is vLLM's own scheduler; "
                        "no pdserve parameters to change (the old values stay)"
                    )
                await self.engine.rpc(
                    "update_params",
                    None if live.fairway is None else live.fairway.model_dump(),
                    None if live.twp is None else live.twp.model_dump(),
                )
                await self._refresh_load()  # the new values, as the engine now runs them
        except (LiveConfigError, ValueError) as e:
            self.live_config_error = str(e)
            self.live_config_refused += 1
            log.error("%s replica %s: %s", self.role, self.replica_id, e)
            return
        self.live_config_error = None
        self.live_config_applied += 1

    async def _refresh_load(self) -> None:
        """Take the engine's report now (the in-process engine's thread refreshes its own)."""
        if isinstance(self.engine, AsyncLLMEngine):
            await self.engine.refresh()
        else:
            self.engine.load = {**await self.engine.rpc("report"), "ts": time.time()}

    def live_config(self) -> dict[str, Any]:
        """The parameters the engine's scheduler runs with now (its last report), and the
        last refusal."""
        policy = self.engine.load.get("policy") or {}
        return {
            "fairway": policy.get("fairway"),
            "twp": policy.get("twp"),
            "window_tokens": self.engine.load.get("window_tokens"),
            "calibration": self.calibration,
            "twp_state": policy.get("twp_state"),
            "twp_counters": policy.get("twp_counters"),
            "applied": self.live_config_applied,
            "refused": self.live_config_refused,
            "error": self.live_config_error,
        }
