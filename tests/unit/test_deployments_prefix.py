"""The ingress's index view over real ZMQ loopback publishers and the in-memory index: it follows
the replicas the router lists, reads each replica in its own hash mode (a replica whose probe
found misaligned hashes is re-hashed from its events' token ids), and forgets a replica that
Serve no longer runs at once."""

from __future__ import annotations

import asyncio

import zmq
import zmq.asyncio

from cluster.events import BlockStored
from cluster.hashing import BlockHasher
from deployments.config import AppConfig
from deployments.prefix import IndexView
from tests.unit.test_cluster_feed import Publisher, free_port

BS = 16
T = 5.0


def view() -> IndexView:
    cfg = AppConfig.model_validate(
        {"hashing": {"block_size": BS, "seed": "7"}, "index": {"backend": "memory"}}
    )
    return IndexView(cfg, "test")


def stored(hashes: list[int], tokens: list[int], extra: list[object] | None = None) -> BlockStored:
    return BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=tokens,
        block_size=BS,
        medium="CPU",
        extra_keys=extra,  # type: ignore[arg-type]
    )


def test_follows_replicas_in_their_hash_mode_and_drops_the_gone() -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        ix = view()
        prompt = list(range(100, 100 + 3 * BS))
        engine_hashes = BlockHasher(ix.cfg.hashing.hash_config()).prefix_hashes(prompt, "t")
        pa, pb = free_port(), free_port()
        a, b = Publisher(ctx, pa, None), Publisher(ctx, pb, None)
        reports = {
            "A": {"role": "prefill", "kv_events": f"tcp://127.0.0.1:{pa}", "hash_mode": "engine"},
            "B": {"role": "prefill", "kv_events": f"tcp://127.0.0.1:{pb}", "hash_mode": "tokens"},
        }
        try:
            await ix.sync(reports)
            assert set(ix.feed.replicas) == {"A", "B"} and ix.stats.replicas_followed == 2
            await a.subscribed()
            await b.subscribed()
            for r in ("A", "B"):
                await ix.feed.wait_for(r, lambda rf: rf.epoch is not None, T)
            # A publishes our own hashes of the first two blocks (aligned engine).
            sa = await a.send(stored(engine_hashes[:2], prompt[: 2 * BS]))
            # B's engine hashes differ (say another seed); its events carry the tokens and the
            # salt as vLLM's do, so the view re-hashes them.
            sb = await b.send(stored([11, 12, 13], prompt, [("t",), None, None]))
            await ix.feed.wait_for("A", lambda rf: (rf.tracker.next_seq or 0) > sa, T)
            await ix.feed.wait_for("B", lambda rf: (rf.tracker.next_seq or 0) > sb, T)
            hashes = ix.hashes(prompt, "t")
            assert set(hashes) == {"engine", "tokens"}
            m = await ix.match(hashes)
            assert m is not None and m.by_replica == {"A": 2 * BS, "B": 3 * BS}
            assert ix.stats.hash_fallback_replicas == 1
            # another tenant's salt matches nothing on either replica
            other = await ix.match(ix.hashes(prompt, "u"))
            assert other is not None and other.by_replica == {}
            # Serve no longer lists A: its entries are gone at once
            await ix.sync({"B": reports["B"]})
            m2 = await ix.match(ix.hashes(prompt, "t"))
            assert m2 is not None and m2.by_replica == {"B": 3 * BS}
            assert set(ix.feed.replicas) == {"B"} and ix.stats.replicas_dropped == 1
            assert set(ix.hashes(prompt, "t")) == {"tokens"}  # only the modes still in use
        finally:
            a.close()
            b.close()
            await ix.close()
            ctx.destroy(linger=0)

    asyncio.run(main())


def test_no_index_answers_nothing_and_never_raises() -> None:
    async def main() -> None:
        cfg = AppConfig.model_validate({"index": {"backend": "none"}})
        ix = IndexView(cfg, "test")
        assert ix.hashes([1] * 300, None) == {}
        assert await ix.match({}) is None
        await ix.sync({"A": {"kv_events": "tcp://127.0.0.1:1"}})

    asyncio.run(main())


def test_an_index_that_fails_degrades_to_no_answer() -> None:
    class Broken:
        async def match(self, hashes: list[int]) -> dict[str, int]:
            raise KeyError("a bug in a backend")

    async def main() -> None:
        ix = view()
        ix.index = Broken()
        assert await ix.match(ix.hashes(list(range(64)), None)) is None
        assert ix.stats.errors == 1 and ix.stats.timeouts == 1

    asyncio.run(main())
