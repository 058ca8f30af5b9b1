"""PrefixProbe over vLLM's real BlockPool: look-ups repeat only for new or affected requests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

pytestmark = pytest.mark.slow  # imports vLLM (a few seconds)


@dataclass
class FakeRequest:
    request_id: str
    block_hashes: list[bytes]
    num_tokens: int


@dataclass
class FakeCoordinator:
    """Answers from the pool's map like vLLM's coordinator: leading hashes present."""

    pool: Any
    calls: list[str] = field(default_factory=list)

    def find_longest_cache_hit(self, hashes: list[Any], max_len: int) -> tuple[Any, int, int]:
        from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

        n = 0
        for h in hashes:
            if (
                self.pool.cached_block_hash_to_block.get_one_block(
                    make_block_hash_with_group_id(h, 0)
                )
                is None
            ):
                break
            n += 1
        return None, min(n * 16, max_len), 0


class FakeKVM:
    def __init__(self) -> None:
        from vllm.v1.core.block_pool import BlockPool

        self.block_pool = BlockPool(num_gpu_blocks=16, enable_caching=True, hash_block_size=16)
        self.coordinator = FakeCoordinator(self.block_pool)

    def prefix_cache_lookup_enabled(self, request: Any) -> bool:
        return True


def test_probe_looks_up_new_and_affected_requests_only() -> None:
    from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

    from engines.prefix_probe import PrefixProbe

    kvm = FakeKVM()
    probe = PrefixProbe(kvm)
    h1: Any = b"h1"  # a BlockHash is a NewType of bytes
    a = FakeRequest("a", [h1, b"h2"], 40)
    b = FakeRequest("b", [b"x1"], 40)
    assert probe.refresh([a, b]) == {"a": 0, "b": 0}
    assert probe.lookups == 2
    probe.refresh([a, b])
    assert probe.lookups == 2  # nothing changed

    blk = kvm.block_pool.blocks[1]
    kvm.block_pool.cached_block_hash_to_block.insert(make_block_hash_with_group_id(h1, 0), blk)
    assert probe.refresh([a, b]) == {"a": 16, "b": 0}
    assert probe.lookups == 3  # only "a" holds h1

    kvm.block_pool.cached_block_hash_to_block.pop(make_block_hash_with_group_id(h1, 0), 1)
    assert probe.refresh([a]) == {"a": 0}  # "b" left the queue and is forgotten
    assert probe.lookups == 4 and probe.evictions == 1

    kvm.block_pool.reset_prefix_cache()  # a new map: detected, everything recomputed
    probe.refresh([a])
    assert probe.lookups == 5
