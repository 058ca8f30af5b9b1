"""Decode admission: Token Window Pacing (TWP) and its baselines (pure).

See :mod:`controllers.decode.base` for the interface (who calls what, when, units) and
:mod:`controllers.decode.twp` for TWP's pure ``observe``/``admit`` step functions.
"""

from controllers.decode.base import (
    AdmissionDecision,
    DecodeAdmissionPolicy,
    DecodeObservation,
    DecodeView,
    EngineView,
    FinishedRequest,
    RunningRequestView,
    WaitingRequestView,
)
from controllers.decode.baselines import (
    DynamicBatchAdmission,
    FCFSAdmission,
    PriorityAdmission,
)
from controllers.decode.config import DynamicBatchConfig, TWPConfig
from controllers.decode.registry import (
    DecodePolicySpec,
    decode_policy_names,
    make_decode_policy,
)
from controllers.decode.twp import (
    TWP,
    TWPCounters,
    TWPParams,
    TWPState,
    admit,
    check_pd_backstop,
    headroom,
    init_state,
    l_hat,
    observe,
    prefill_chunk,
    rank,
    resolve,
)

__all__ = [
    "DecodePolicySpec",
    "DynamicBatchAdmission",
    "FCFSAdmission",
    "PriorityAdmission",
    "decode_policy_names",
    "make_decode_policy",
    "TWP",
    "AdmissionDecision",
    "DecodeAdmissionPolicy",
    "DecodeObservation",
    "DecodeView",
    "DynamicBatchConfig",
    "EngineView",
    "FinishedRequest",
    "RunningRequestView",
    "TWPConfig",
    "TWPCounters",
    "TWPParams",
    "TWPState",
    "WaitingRequestView",
    "admit",
    "check_pd_backstop",
    "headroom",
    "init_state",
    "l_hat",
    "observe",
    "prefill_chunk",
    "rank",
    "resolve",
]
