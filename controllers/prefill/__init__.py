"""Prefill waiting-queue orderings: Fairway and its baselines (pure)."""

from controllers.prefill.base import (
    LanedPolicy,
    PrefillPolicy,
    PrefillQueueView,
    PrefillRequestView,
    ProtectingPolicy,
    patience_s,
)
from controllers.prefill.fairway import Fairway, FairwayPlan
from controllers.prefill.registry import (
    make_prefill_policy,
    prefill_policy_names,
    register_prefill_policy,
)

__all__ = [
    "Fairway",
    "FairwayPlan",
    "LanedPolicy",
    "PrefillPolicy",
    "PrefillQueueView",
    "PrefillRequestView",
    "ProtectingPolicy",
    "make_prefill_policy",
    "patience_s",
    "prefill_policy_names",
    "register_prefill_policy",
]
