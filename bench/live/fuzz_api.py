"""Fuzz a live pdserve endpoint from its own OpenAPI schema (schemathesis).

Every operation of ``/openapi.json`` gets ``examples`` generated requests in each generation
mode: ``positive`` (bodies the schema allows: they must succeed or get a 4xx, e.g. a
tenant's cap) and ``negative`` (bodies the schema forbids: they must get a 4xx). The report
counts cases by operation and status; every 5xx is kept with its curl command, so it can be
replayed. The goal is zero 5xx and no request left hanging (each call is bounded by
``timeout_s``; a time-out counts as a failure, like a 5xx).

Fuzzed requests are real requests: use a tenant whose caps keep them small (``max_tokens``,
``max_context_tokens``), as the e2e test does.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class FuzzReport:
    """Cases sent, by ``"METHOD /path"`` and HTTP status; the failures (5xx, time-outs,
    connection errors) with a curl command each."""

    cases: int = 0
    by_status: Counter[int] = field(default_factory=Counter)
    by_operation: dict[str, Counter[int]] = field(default_factory=dict)
    failures: list[dict[str, Any]] = field(default_factory=list)
    #: ``"METHOD /path (mode)"`` with no case to generate (no inputs to make invalid)
    skipped: list[str] = field(default_factory=list)

    @property
    def server_errors(self) -> int:
        return sum(n for s, n in self.by_status.items() if s >= 500) + sum(
            1 for f in self.failures if f["status"] is None
        )

    def as_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "server_errors": self.server_errors,
            "by_status": {str(k): v for k, v in sorted(self.by_status.items())},
            "by_operation": {
                op: {str(k): v for k, v in sorted(c.items())} for op, c in self.by_operation.items()
            },
            "failures": self.failures[:50],
            "skipped": self.skipped,
        }


def fuzz(
    url: str,
    api_key: str | None = None,
    examples: int = 20,
    modes: tuple[str, ...] = ("positive", "negative"),
    operations: Callable[[str, str], bool] | None = None,
    timeout_s: float = 60.0,
    seed: int = 0,
    progress: bool = True,
) -> FuzzReport:
    """Fuzz the endpoint at ``url``; ``operations(method, path)`` picks the operations
    (default: all)."""
    import httpx
    import hypothesis.strategies as st
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hseed
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode
    from tqdm import tqdm

    base = url.rstrip("/")
    auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    spec = httpx.get(f"{base}/openapi.json", headers=auth, timeout=timeout_s).json()
    schema = schemathesis.openapi.from_dict(spec)
    ops = []
    for r in schema.get_all_operations():
        op = getattr(r, "ok", None)
        if op is None:  # an operation schemathesis cannot read: say so, do not skip silently
            raise ValueError(f"the OpenAPI schema has an unusable operation: {r}")
        ops.append(op())
    ops = [o for o in ops if operations is None or operations(o.method.upper(), o.path)]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    report = FuzzReport()
    bar = tqdm(
        total=len(ops) * len(modes) * examples, desc="fuzz (live endpoint)", disable=not progress
    )
    with httpx.Client(base_url=base, timeout=timeout_s, headers=headers) as client:

        def send(case: Any, name: str, mode: str, counts: Counter[int]) -> None:
            kw = case.as_transport_kwargs(base_url=base)
            status: int | None
            try:
                body_kw: dict[str, Any] = {}
                if "json" in kw:
                    body_kw["json"] = kw["json"]
                elif kw.get("data") is not None:  # bodies that are not JSON (negative mode)
                    raw = kw["data"]
                    body_kw["content"] = raw if isinstance(raw, bytes) else str(raw).encode()
                r = client.request(
                    case.method,
                    case.formatted_path,
                    params=kw.get("params"),
                    headers={**(kw.get("headers") or {}), **headers},
                    **body_kw,
                )
                status, body = r.status_code, r.text[:300]
            except httpx.HTTPError as e:
                status, body = None, f"{type(e).__name__}: {e}"
            report.cases += 1
            if status is not None:
                report.by_status[status] += 1
                counts[status] += 1
            if status is None or status >= 500:
                report.failures.append(
                    {
                        "operation": name,
                        "mode": mode,
                        "status": status,
                        "response": body,
                        "curl": case.as_curl_command(),
                    }
                )
            bar.update(1)

        def runner(strategy: Any, name: str, mode: str, counts: Counter[int]) -> Any:
            @hseed(seed)
            @settings(
                max_examples=examples,
                deadline=None,
                database=None,
                suppress_health_check=list(HealthCheck),
                phases=[Phase.explicit, Phase.generate],
            )
            @given(st.data())
            def run(data: Any) -> None:
                send(data.draw(strategy), name, mode, counts)

            return run

        for op in ops:
            name = f"{op.method.upper()} {op.path}"
            counts = report.by_operation.setdefault(name, Counter())
            for mode in modes:
                strategy = op.as_strategy(generation_mode=GenerationMode(mode))
                try:
                    runner(strategy, name, mode, counts)()
                except Unsatisfiable:  # e.g. no negative case for an operation without inputs
                    report.skipped.append(f"{name} ({mode})")
    bar.close()
    return report
