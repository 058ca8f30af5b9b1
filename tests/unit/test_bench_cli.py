"""The live-app benchmark commands refuse bad input before bringing anything up."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

import pdserve.cli  # noqa: F401  (registers the commands)
from pdserve.apps import app

runner = CliRunner()
ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", ["serve", "warm-start", "soak"])
def test_a_missing_config_is_refused_naming_it(command: str, tmp_path: Path) -> None:
    res = runner.invoke(app, ["bench", command, "--config", str(tmp_path / "nope.yaml")])
    assert res.exit_code == 2 and "--config" in res.output


@pytest.mark.parametrize("levels", ["0", "x,4", "-1"])
def test_bench_serve_refuses_bad_levels(levels: str) -> None:
    config = ROOT / "configs" / "pd_default.yaml"
    res = runner.invoke(app, ["bench", "serve", "--config", str(config), "--levels", levels])
    assert res.exit_code == 2, res.output
    assert "levels" in res.output or "integers" in res.output


@pytest.mark.parametrize("args", [["--levels", "0"], ["--levels", "1,x"], ["--duration", "1"]])
def test_bench_soak_refuses_bad_input(args: list[str]) -> None:
    res = runner.invoke(app, ["bench", "soak", "--url", "http://127.0.0.1:9", *args])
    assert res.exit_code == 2, res.output
    assert "levels" in res.output or "numbers" in res.output or "duration" in res.output


@pytest.mark.parametrize(
    ("args", "names"),
    [
        (["--caps", "0,8"], "--caps"),
        (["--caps", "8,x"], "--caps"),
        (["--requests", "0"], "--requests"),
    ],
)
def test_bench_kv_pressure_refuses_bad_input_before_starting_an_engine(
    args: list[str], names: str, tmp_path: Path
) -> None:
    (tmp_path / "config.json").write_text("{}")
    res = runner.invoke(app, ["bench", "kv-pressure", "--model", str(tmp_path), *args])
    assert res.exit_code == 2, res.output
    assert names in res.output


def test_bench_kv_pressure_refuses_a_folder_without_a_model(tmp_path: Path) -> None:
    res = runner.invoke(app, ["bench", "kv-pressure", "--model", str(tmp_path)])
    assert res.exit_code == 2 and "--model" in res.output and "config.json" in res.output


@pytest.mark.parametrize("steps", ["tokens:8", "target:0", "target:x", "chunks:4", "512"])
def test_bench_tenant_flood_refuses_a_bad_step_cap_before_starting_an_engine(
    steps: str, tmp_path: Path
) -> None:
    res = runner.invoke(
        app, ["bench", "tenant-flood", "--model", str(tmp_path), "--steps", f"tokens:512,{steps}"]
    )
    assert res.exit_code == 2, res.output
    assert "--steps" in res.output and steps in res.output


def test_bench_tenant_flood_refuses_the_running_order_comparison_without_a_step_cap(
    tmp_path: Path,
) -> None:
    res = runner.invoke(
        app, ["bench", "tenant-flood", "--model", str(tmp_path), "--vllm-running-order"]
    )
    assert res.exit_code == 2, res.output
    assert "--vllm-running-order" in res.output and "--steps" in res.output
