"""``pdserve bench hostile``: a victim tenant's latency alone and beside each class of
hostile request (:mod:`bench.live.hostile`), on the live app."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import typer

from pdserve.apps import bench_app
from pdserve.output import table, write_json

DEFAULT_BASE = Path("configs/pd_default.yaml")


def hostile_config(base: Path, out: Path) -> tuple[Path, dict[str, str]]:
    """``base`` (a Serve YAML) with keys on (``ingress.auth: keys``, a keys file in ``out``):
    an unlimited victim, a limited attacker, a flood tenant of its own and an operator key.
    Returns the new YAML's path and the keys by role."""
    import yaml

    from bench.live.hostile import ATTACKER_LIMITS, FLOOD_LIMITS
    from cluster.tenants import OPERATOR, hash_key, new_key, write_keys_file

    raw = yaml.safe_load(base.read_text())
    args = raw["applications"][0].setdefault("args", {})
    keys = {role: new_key() for role in ("victim", "attacker", "flood", "operator")}
    tenants = {"victim": "victim", "attacker": "mallory", "flood": "flood", "operator": OPERATOR}
    out.mkdir(parents=True, exist_ok=True)
    keys_file = out / "hostile_keys.yaml"
    write_keys_file(keys_file, {hash_key(keys[r]): tenants[r] for r in keys})
    ingress = args.setdefault("ingress", {})
    ingress["auth"] = "keys"
    ingress.pop("api_keys", None)
    args["tenants"] = {
        "keys_file": str(keys_file.resolve()),
        "default": {"requests_per_second": 20, "tokens_per_minute": 1_000_000},
        "by_name": {
            "victim": {"requests_per_second": None, "tokens_per_minute": None},
            "mallory": dict(ATTACKER_LIMITS),
            "flood": dict(FLOOD_LIMITS),
        },
    }
    path = out / "hostile.yaml"
    path.write_text(yaml.safe_dump(raw, sort_keys=False))
    return path, keys


def _fmt(v: Any, f: str = "{:.3f}") -> str:
    return "-" if v is None else f.format(v)


@bench_app.command("hostile")
def bench_hostile(
    url: str | None = typer.Option(
        None, help="Base URL of a running app (with --victim-key, --attacker-key, --flood-key)."
    ),
    config: Path = typer.Option(
        DEFAULT_BASE, help="Serve YAML the app comes up from (keys added), without --url."
    ),
    victim_key: str | None = typer.Option(None, help="The victim tenant's key (--url)."),
    attacker_key: str | None = typer.Option(None, help="The attacker tenant's key (--url)."),
    flood_key: str | None = typer.Option(None, help="The flooding tenant's key (--url)."),
    streams: int = typer.Option(4, min=1, max=64, help="The victim's streams at once."),
    per_stream: int = typer.Option(12, min=1, help="Requests per victim stream per phase."),
    rate: float = typer.Option(
        20.0, min=0.1, help="Attack requests per second (every class, and the control)."
    ),
    classes: str | None = typer.Option(
        None, help="Comma-separated attack classes to run (default: every one)."
    ),
    out: Path = typer.Option(Path("out/hostile"), help="Folder for the generated config."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the results as JSON."),
    plot_out: Path | None = typer.Option(None, "--plot", help="Write the ratios as a PNG."),
    progress: bool = typer.Option(True, help="Show a progress bar."),
) -> None:
    """The victim's TTFT and ITL p50/p99 alone, then under each attack class, as ratios to
    alone (goal: at most 1.5x at p99). Without --url the app comes up from --config with keys
    on and goes down at the end."""
    import yaml

    from bench.live.hostile import ATTACKS, plot, run
    from bench.live.warm_start import pdserve_cli

    attacks = ATTACKS
    if classes is not None:
        want = {c.strip() for c in classes.split(",") if c.strip()}
        unknown = want - {a.name for a in ATTACKS}
        if unknown:
            names = ", ".join(a.name for a in ATTACKS)
            raise typer.BadParameter(
                f"unknown {sorted(unknown)}; one of {names}", param_hint="--classes"
            )
        attacks = tuple(a for a in ATTACKS if a.name in want)

    up = url is None
    if up:
        if not config.exists():
            raise typer.BadParameter(f"{config} does not exist", param_hint="--config")
        path, keys = hostile_config(config, out)
        raw = yaml.safe_load(path.read_text())
        http = raw.get("http_options") or {}
        url = f"http://{http.get('host', '127.0.0.1')}:{int(http.get('port', 8000))}"
        pdserve_cli("up", "--config", str(path))
    else:
        if not (victim_key and attacker_key and flood_key):
            raise typer.BadParameter(
                "--url needs --victim-key, --attacker-key and --flood-key", param_hint="--url"
            )
        keys = {"victim": victim_key, "attacker": attacker_key, "flood": flood_key}
    assert url is not None
    try:
        res = run(
            url,
            keys,
            streams=streams,
            per_stream=per_stream,
            rate=rate,
            attacks=attacks,
            progress=progress,
        )
    finally:
        if up:
            pdserve_cli("down")
    typer.echo(f"[{res['label']}]")
    typer.echo(
        table(
            ["phase", "victim done", "TTFT p50 ms", "TTFT p99 ms", "ITL p50 ms", "ITL p99 ms",
             "TTFT p99 x", "ITL p99 x", "attack answers"],
            [
                [r["phase"], f"{r['victim_complete']}/{r['victim_streams']}",
                 _fmt(r["ttft_p50_s"] and 1000 * r["ttft_p50_s"], "{:.0f}"),
                 _fmt(r["ttft_p99_s"] and 1000 * r["ttft_p99_s"], "{:.0f}"),
                 _fmt(r["itl_p50_s"] and 1000 * r["itl_p50_s"], "{:.1f}"),
                 _fmt(r["itl_p99_s"] and 1000 * r["itl_p99_s"], "{:.1f}"),
                 _fmt(r["ttft_p99_ratio"], "{:.2f}"), _fmt(r["itl_p99_ratio"], "{:.2f}"),
                 " ".join(f"{k}:{v}" for k, v in sorted(r["attack_statuses"].items()))]
                for r in res["rows"]
            ],
        )
    )  # fmt: skip
    write_json(json_out, res)
    if plot_out is not None:
        plot_out.parent.mkdir(parents=True, exist_ok=True)
        plot(res, str(plot_out))
        typer.echo(f"plot: {plot_out}")
