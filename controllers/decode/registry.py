"""Decode policies by name: (dispatcher, admission, pool setting) triples.

``make_decode_policy(name, profile, mode=..., L_bar=...)`` returns a
:class:`DecodePolicySpec` whose ``new_admission()`` builds one admission object per
container (each replica holds its own state) and whose ``dispatcher`` is shared by the
router. ``fast_loading`` tells the serverless pool to use ServerlessLLM-style checkpoint
loading for this policy's cold starts.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from controllers.decode.base import DecodeAdmissionPolicy
from controllers.decode.baselines import DynamicBatchAdmission, FCFSAdmission, PriorityAdmission
from controllers.decode.config import TWPConfig
from controllers.decode.dispatch import (
    ContainerView,
    DispatchRequest,
    HeadroomDispatch,
    LeastLoadedDispatch,
    LocalityAwareDispatch,
    RoundRobinDispatch,
)
from controllers.decode.twp import TWP
from controllers.profile import EngineProfile

Mode = Literal["colocated", "pd"]


class Dispatcher(Protocol):
    name: str

    def choose(self, req: DispatchRequest, containers: list[ContainerView]) -> int | None: ...


@dataclass
class DecodePolicySpec:
    name: str
    dispatcher: Dispatcher
    new_admission: Callable[[], DecodeAdmissionPolicy]
    fast_loading: bool = False


def _twp(
    weights: tuple[float, float, float] | None,
    fast_loading: bool = False,
    update: dict[str, object] | None = None,
) -> Callable[..., DecodePolicySpec]:
    def build(
        name: str, profile: EngineProfile, mode: Mode, L_bar: int, twp: TWPConfig | None
    ) -> DecodePolicySpec:
        cfg = TWPConfig.model_validate(
            {**(twp or TWPConfig()).model_dump(), "L_bar": L_bar, **(update or {})}
        )
        if weights is not None:
            cfg = TWPConfig.model_validate(
                {
                    **cfg.model_dump(),
                    "w1": weights[0],
                    "w2": weights[1],
                    "w3": weights[2],
                    "ablation": True,
                }
            )
        return DecodePolicySpec(
            name,
            HeadroomDispatch(hold_when_full=mode == "pd", scale_out_load=profile.decode.b0),
            lambda: TWP(profile, cfg, name),
            fast_loading=fast_loading,
        )

    return build


_BUILDERS: dict[str, Callable[..., DecodePolicySpec]] = {
    "fcfs": lambda n, p, m, L, t: DecodePolicySpec(
        n, LeastLoadedDispatch(p.decode.b0), lambda: FCFSAdmission(n, L)
    ),
    "round_robin": lambda n, p, m, L, t: DecodePolicySpec(
        n, RoundRobinDispatch(), lambda: FCFSAdmission(n, L)
    ),
    "priority": lambda n, p, m, L, t: DecodePolicySpec(
        n, LeastLoadedDispatch(p.decode.b0), lambda: PriorityAdmission(n, L)
    ),
    "dynamic_batch": lambda n, p, m, L, t: DecodePolicySpec(
        n, LeastLoadedDispatch(p.decode.b0), lambda: DynamicBatchAdmission(p, None, n, L)
    ),
    "serverlessllm": lambda n, p, m, L, t: DecodePolicySpec(
        n, LocalityAwareDispatch(p.decode.b0), lambda: FCFSAdmission(n, L), fast_loading=True
    ),
    "twp": _twp(None),
    # TWP's gate on ServerlessLLM's fast checkpoint loading: separates the gate's effect
    # from the pool's (TWP itself "does not interact with container provisioning").
    "twp_fastload": _twp(None, fast_loading=True),
    # Survival-conditioned L_hat for running requests (not in the paper).
    "twp_survival": _twp(None, update={"survival_l_hat": True}),
    # Ranking ablations: one term off at a time, and equal weights.
    "twp_no_starvation": _twp((0.0, 0.3, 0.2)),
    "twp_no_balance": _twp((0.5, 0.0, 0.2)),
    "twp_no_fairness": _twp((0.5, 0.3, 0.0)),
    "twp_equal_weights": _twp((1 / 3, 1 / 3, 1 / 3)),
}


def decode_policy_names() -> list[str]:
    return list(_BUILDERS)


def make_decode_policy(
    name: str,
    profile: EngineProfile,
    *,
    mode: Mode = "colocated",
    L_bar: int = 50,
    twp: TWPConfig | None = None,
) -> DecodePolicySpec:
    """Build a policy by name; an unknown name is an error listing the known ones."""
    try:
        builder = _BUILDERS[name]
    except KeyError:
        raise ValueError(f"unknown decode policy {name!r}; known: {', '.join(_BUILDERS)}") from None
    return builder(name, profile, mode, L_bar, twp)
