#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default.
# Until the serving stack lands, the main job is the best comparison the project can
# run so far: the per-step ordering cost of Fairway against its baselines.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
mkdir -p out
.venv/bin/pdserve bench ordering --waiting 100,1000,10000 --policies fcfs,lpm,klpm4,ragcache,preble,peek,fairway --json out/ordering.json
