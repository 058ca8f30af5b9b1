"""An engine replica's own listening ports (NIXL side channel, KV events) come from outside
the kernel's ephemeral range, so no outgoing connection takes one between its choice and the
engine's bind (a replica hung in its start-up when that happened)."""

from __future__ import annotations

import random
import socket

from deployments.engine.identity import PORT_FLOOR, ephemeral_ports, free_port


def test_ports_are_free_distinct_and_below_the_ephemeral_range() -> None:
    lo, hi = ephemeral_ports()
    assert PORT_FLOOR < lo <= hi
    taken: set[int] = set()
    ports = [free_port(taken, random.Random(7)) for _ in range(20)]
    assert len(set(ports)) == 20 and set(ports) == taken
    assert all(PORT_FLOOR <= p < lo for p in ports)
    for p in ports[:3]:  # each one binds now
        with socket.socket() as s:
            s.bind(("", p))


def test_a_port_in_use_is_not_chosen() -> None:
    rng = random.Random(3)
    first = free_port(set(), random.Random(3))
    with socket.socket() as held:
        held.bind(("", first))
        held.listen()
        again = free_port(set(), rng)  # the same draw comes first: in use, passed over
    assert again != first
