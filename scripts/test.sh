#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the whole test suite, slow tests included.
# Extra arguments go to pytest, e.g. `scripts/test.sh -m "not slow"` for the inner loop.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# the suite's Ray cluster runs token authentication with a token of its own
# (tests/fixtures/ray_cluster.py), as `pdserve up` starts a head
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
set +e
.venv/bin/python -m pytest "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then echo "test.sh: pytest collected no tests"; exit 1; fi
exit "$rc"
