"""End to end with Ray's own autoscaler: a cluster on Ray's ``fake_multinode`` node provider
(the provider starts and stops raylets as a cloud provider starts and stops machines), with
pdserve's application-level policy sizing the decode role. Load makes the policy want a second
decode replica; Ray's autoscaler must start a ``pdserve_decode`` node for it; the replica
starts there and serves; after the load, the policy lets it go and Ray terminates the idle
node.

The run is ``pdserve bench multinode --parts autoscale`` itself, in a subprocess: the fake
provider needs a head of its own (its id and autoscaling config are set when it starts), so
it runs as a second local cluster on a GCS port of its own beside the session's, which this
module leaves idle.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def autoscaled(
    ray_cluster: dict[str, Any], tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("ray-autoscaler") / "res.json"
    env = {
        **os.environ,  # the session's Ray token: the bench's cluster runs token auth too
        "PDSERVE_MODEL": str(tiny_model_dir),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
    }
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pdserve",
            "bench",
            "multinode",
            "--parts",
            "autoscale",
            "--streams",
            "4",
            "--stream-tokens",
            "192",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert r.returncode == 0, (r.stdout[-3000:], r.stderr[-3000:])
    res: dict[str, Any] = json.loads(out.read_text())["autoscale"]
    print(f"ray autoscaler events (s from the load's start): {res['events_s']}")
    return res


def test_ray_adds_a_decode_node_for_the_replica_the_policy_wants_and_removes_it_after(
    autoscaled: dict[str, Any],
) -> None:
    from bench.live.multinode import EVENTS

    ev = autoscaled["events_s"]
    assert all(k in ev for k in EVENTS), ev
    times = [ev[k] for k in EVENTS]
    assert times == sorted(times), ev  # each step after the one it depends on
    assert autoscaled["errors"] == 0 and autoscaled["requests"] > 0, autoscaled["error_samples"]
    # one decode node and replica before; two, each replica on its own node, under load
    assert len(autoscaled["placement_before"]["decode"]) == 1
    under = autoscaled["placement_under_load"]["decode"]
    assert len(under) == 2 and len(set(under)) == 2, under
    # the prefill and ingress replicas stayed on the head (its resources), not on a decode node
    head = set(autoscaled["placement_before"]["prefill"])
    assert set(autoscaled["placement_under_load"]["prefill"]) == head
    assert head.isdisjoint(under)
    # after: one replica, and Ray's autoscaler terminated the node it no longer needed
    assert len(autoscaled["placement_after"]["decode"]) == 1
    last = autoscaled["samples"][-1]
    assert last["nodes"] == 1 and last["running"] == 1, last


def test_the_second_cluster_leaves_no_process_behind(autoscaled: dict[str, Any]) -> None:
    from bench.live.multinode import cluster_processes

    assert autoscaled["processes_stopped"] > 0
    left = [
        " ".join(p.info["cmdline"] or [])[:200] for p in cluster_processes(autoscaled["gcs_port"])
    ]
    assert left == [], left
