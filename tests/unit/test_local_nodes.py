"""The local multi-node layout (deployments/local_nodes.py) and the config that pins to it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from deployments.config import load_app_config
from deployments.local_nodes import ROLE_RESOURCE, parse_nodes, ray_start_command

ROOT = Path(__file__).resolve().parents[2]


def test_nodes_get_distinct_loopback_addresses_in_the_order_written() -> None:
    specs = parse_nodes("prefill=2,decode=1,ingress=1")
    assert [(s.name, s.ip) for s in specs] == [
        ("prefill-0", "127.0.0.2"),
        ("prefill-1", "127.0.0.3"),
        ("decode-0", "127.0.0.4"),
        ("ingress-0", "127.0.0.5"),
    ]
    assert specs[0].resources == {"pdserve_prefill": 2.0}
    assert specs[0].num_cpus == 2  # two engine replicas of 1 CPU
    assert specs[3].resources == {"pdserve_ingress": 2.0} and specs[3].num_cpus == 1
    one = parse_nodes("decode=1", slots=3)
    assert one[0].ip == "127.0.0.2" and one[0].resources == {"pdserve_decode": 3.0}
    assert one[0].num_cpus == 3


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("prefill", "not ROLE=COUNT"),
        ("gpu=1", "unknown role 'gpu'"),
        ("prefill=1,prefill=2", "prefill is given twice"),
        ("decode=99", "outside 0..32"),
        ("", "no node given"),
    ],
)
def test_a_bad_nodes_spec_names_its_part(text: str, says: str) -> None:
    with pytest.raises(ValueError, match="--nodes") as e:
        parse_nodes(text)
    assert says in str(e.value)


def test_ray_start_joins_the_node_on_its_own_address_with_its_roles_resource() -> None:
    spec = parse_nodes("prefill=1")[0]
    cmd = ray_start_command(spec, "192.0.2.1:6379", "ray")
    assert cmd[:3] == ["ray", "start", "--address=192.0.2.1:6379"]
    assert "--node-ip-address=127.0.0.2" in cmd
    assert "--num-cpus=2" in cmd and "--num-gpus=0" in cmd
    res = next(a for a in cmd if a.startswith("--resources="))
    assert json.loads(res.split("=", 1)[1]) == {"pdserve_prefill": 2.0}
    assert "--head" not in cmd and "--block" not in cmd  # a daemon that joins
    assert "--include-log-monitor=false" in cmd  # the head's log monitor reads every node's


def test_the_multinode_config_pins_each_role_to_its_nodes_only() -> None:
    """Every replica of pd_multinode.yaml reserves its role's resource, which only that role's
    nodes of ``--nodes prefill=2,decode=1,ingress=1`` advertise (the head none), and the
    role's replicas fit its nodes with a slot to spare for a lost node's replacement."""
    raw = yaml.safe_load((ROOT / "configs/pd_multinode.yaml").read_text())
    cfg = load_app_config(raw["applications"][0]["args"], environ={})
    specs = parse_nodes("prefill=2,decode=1,ingress=1")
    for role, sec in (("prefill", cfg.prefill), ("decode", cfg.decode), ("ingress", cfg.ingress)):
        assert sec.resources == {ROLE_RESOURCE[role]: 1}, role
        hosts = [s for s in specs if ROLE_RESOURCE[role] in s.resources]
        assert hosts and all(s.role == role for s in hosts)
        slots = sum(s.resources[ROLE_RESOURCE[role]] for s in hosts)
        assert slots >= sec.num_replicas + 1, role  # room for one replacement
        cpus = sum(s.num_cpus for s in hosts)
        assert cpus >= sec.num_cpus * (sec.num_replicas + 1), role
    assert cfg.index.backend == "redis"
    assert cfg.prefill.num_replicas == 2 and cfg.decode.num_replicas == 1
