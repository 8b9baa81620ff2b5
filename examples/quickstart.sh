#!/usr/bin/env bash
# Install epdserve (the base package, and the openai client the example uses) into .venv with uv, serve the
# default (tiny, generated) model, and ask it about a real photo. The servers keep running after the answer;
# Ctrl-C stops them (exit code 0).
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m venv .venv
# uv (from PyPI, into the venv) fetches and unpacks the ~3 GB of torch's CUDA wheels in parallel: 21 s on the
# development machine against 107 s for pip itself.
.venv/bin/pip install -q uv
.venv/bin/uv pip install -q --python .venv/bin/python -e . openai
PORT="${PORT:-8000}"
.venv/bin/epdserve launch --port "$PORT" &
SERVER=$!
# Stop the servers on the way out, whichever way that is; Ctrl-C (or TERM) is a normal end.
stop() { kill -TERM "$SERVER" 2>/dev/null || true; wait "$SERVER" 2>/dev/null || true; }
trap stop EXIT
trap 'exit 0' INT TERM
.venv/bin/python examples/openai_chat.py --base-url "http://127.0.0.1:$PORT/v1" --wait 600
echo "epdserve is serving on http://127.0.0.1:$PORT/v1 (Ctrl-C to stop)"
wait "$SERVER"
