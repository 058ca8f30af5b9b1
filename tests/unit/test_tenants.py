"""Tenants, pure and in memory: the GCRA token bucket, hashed keys and the keys file's
reloads, the in-memory rate limiter, and the config's per-tenant limits."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from pydantic import ValidationError

from cluster.tenants import (
    Charge,
    KeyStore,
    RateLimiter,
    hash_key,
    is_key_hash,
    new_key,
    read_keys_file,
    write_keys_file,
)
from controllers.tenants import Bucket, available, refund, take
from deployments.config import load_app_config


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def test_bucket_worked_example() -> None:
    """2 requests/s with a burst of 3: three at once, the fourth waits 0.5 s, and a bucket left
    alone for 1.5 s is full again (not fuller)."""
    b = Bucket(rate=2.0, capacity=3.0)
    tat, now = 0.0, 10.0
    for _ in range(3):
        got = take(b, tat, now, 1)
        assert got.allowed
        tat = got.tat
    fourth = take(b, tat, now, 1)
    assert not fourth.allowed and fourth.retry_after_s == pytest.approx(0.5)
    assert fourth.tat == tat  # a refusal takes nothing
    assert take(b, tat, now + 0.5, 1).allowed
    assert available(b, tat, now + 1.5) == pytest.approx(3.0)
    assert available(b, tat, now + 100) == pytest.approx(3.0)
    assert not take(b, 0.0, now, 4).allowed and take(b, 0.0, now, 4).retry_after_s == float("inf")


def test_refund_gives_back_at_most_a_full_bucket() -> None:
    b = Bucket(rate=10.0, capacity=600.0)  # 600 tokens per minute
    got = take(b, 0.0, 0.0, 500)
    assert got.allowed and available(b, got.tat, 0.0) == pytest.approx(100)
    tat = refund(b, got.tat, 0.0, 300)  # 300 of the reserved 500 were not produced
    assert available(b, tat, 0.0) == pytest.approx(400)
    assert available(b, refund(b, tat, 0.0, 10_000), 0.0) == pytest.approx(600)
    with pytest.raises(ValueError):
        Bucket(rate=0, capacity=1)


def test_keys_are_stored_hashed() -> None:
    k = new_key()
    assert k.startswith("pds-") and len(k) > 40 and new_key() != k
    h = hash_key(k)
    assert is_key_hash(h) and k not in h
    assert not is_key_hash("sha256:" + "A" * 64) and not is_key_hash("md5:" + "a" * 64)


def test_key_store_config_hashes_and_file_reload(tmp_path: Path) -> None:
    clock = Clock()
    f = tmp_path / "keys.yaml"
    ka, kb, kc = new_key(), new_key(), new_key()
    write_keys_file(f, {hash_key(kb): "bob"})
    assert oct(f.stat().st_mode & 0o777) == "0o600"
    store = KeyStore({hash_key(ka): "alice"}, file=f, clock=clock, file_check_s=1.0)

    def who(k: str) -> str | None:
        return asyncio.run(store.tenant(k))

    assert who(ka) == "alice" and who(kb) == "bob" and who(kc) is None and who("") is None
    # add carol and revoke bob without a restart; seen once the check period has passed
    write_keys_file(f, {hash_key(kc): "carol"})
    os.utime(f, (clock.t + 5, clock.t + 5))
    assert who(kc) is None  # within file_check_s of the last check
    clock.t += 1.5
    assert who(kc) == "carol" and who(kb) is None
    assert store.stats.file_reloads == 1
    # a broken file keeps the last good keys: a bad entry, then text that is not YAML
    f.write_text("sha256:nothex: carol\n")
    os.utime(f, (clock.t + 9, clock.t + 9))
    clock.t += 1.5
    assert who(kc) == "carol" and store.stats.file_errors == 1
    f.write_text("{: [unclosed\n")
    os.utime(f, (clock.t + 19, clock.t + 19))
    clock.t += 1.5
    assert who(kc) == "carol" and store.stats.file_errors == 2


def test_keys_file_errors_name_the_entry(tmp_path: Path) -> None:
    f = tmp_path / "keys.yaml"
    f.write_text("abc: alice\n")
    with pytest.raises(ValueError, match="'abc' is not"):
        read_keys_file(f)
    f.write_text(f"{hash_key('x')}: 'bad name!'\n")
    with pytest.raises(ValueError, match="tenant 'bad name!'"):
        read_keys_file(f)


def test_memory_limiter_takes_all_charges_or_none() -> None:
    clock = Clock()
    lim = RateLimiter(clock=clock)
    req = Bucket(2.0, 2.0)
    tok = Bucket(10.0, 100.0)

    async def go() -> list[tuple[bool, str | None]]:
        out = []
        for cost in (60, 30, 30):
            v = await lim.admit("a", [Charge("requests", req, 1), Charge("tokens", tok, cost)])
            out.append((v.allowed, v.refused_by))
        return out

    assert asyncio.run(go()) == [(True, None), (True, None), (False, "requests")]
    # the third was refused by requests, and took no tokens either: 10 tokens left
    v = asyncio.run(lim.admit("a", [Charge("tokens", tok, 11)]))
    assert not v.allowed and v.retry_after_s == pytest.approx(0.1)
    asyncio.run(lim.give_back("a", "tokens", tok, 50))
    assert asyncio.run(lim.admit("a", [Charge("tokens", tok, 60)])).allowed
    # another tenant has its own buckets
    assert asyncio.run(lim.admit("b", [Charge("requests", req, 1)])).allowed
    assert lim.stats.refused == 2 and lim.stats.allowed == 4


def test_tenant_limits_merge_and_name_bad_fields() -> None:
    cfg = load_app_config(
        {
            "tenants": {
                "default": {"requests_per_second": 2.5, "max_tokens": 64},
                "by_name": {"bob": {"tokens_per_minute": 600, "cache_group": "acme"}},
            }
        }
    )
    bob = cfg.tenants.limits("bob")
    assert bob.requests_per_second == 2.5 and bob.max_tokens == 64 and bob.cache_group == "acme"
    assert bob.buckets() == {"requests": (2.5, 3.0), "tokens": (10.0, 600.0)}
    # the tokens limit nobody set is the shipped default: no tenant is unlimited by omission
    assert cfg.tenants.limits("zed").buckets() == {
        "requests": (2.5, 3.0),
        "tokens": (1_000_000 / 60, 1_000_000.0),
    }
    free = load_app_config(
        {"tenants": {"by_name": {"bulk": {"requests_per_second": None, "tokens_per_minute": None}}}}
    )
    assert free.tenants.limits("bulk").buckets() == {}  # unlimited: said explicitly
    assert set(free.tenants.limits("other").buckets()) == {"requests", "tokens"}
    for bad, field in (
        ({"key_hashes": {"abc": "x"}}, "tenants.key_hashes"),
        ({"by_name": {"bad name": {}}}, "tenants.by_name"),
        ({"default": {"requests_per_second": 0}}, "tenants.default.requests_per_second"),
        ({"default": {"rps": 1}}, "tenants.default.rps"),
    ):
        with pytest.raises(ValidationError) as e:
            load_app_config({"tenants": bad})
        assert field in str(e.value).replace("\n", " ") or field.split(".")[-1] in str(e.value)
