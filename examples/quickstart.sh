#!/usr/bin/env bash
# Install epdserve into .venv, serve the default (tiny, generated) model, and ask it about a real photo.
# The servers keep running after the answer; Ctrl-C stops them.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
.venv/bin/pip install -q -e '.[test]'
PORT="${PORT:-8000}"
.venv/bin/epdserve launch --port "$PORT" &
SERVER=$!
trap 'kill -TERM $SERVER 2>/dev/null; wait $SERVER' EXIT INT TERM
.venv/bin/python examples/openai_chat.py --base-url "http://127.0.0.1:$PORT/v1" --wait 600
echo "epdserve is serving on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
wait $SERVER
