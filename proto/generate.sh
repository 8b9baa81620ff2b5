#!/usr/bin/env bash
# Regenerate NAME_pb2.py, NAME_pb2_grpc.py and NAME_pb2.pyi from each NAME.proto here: encoder.proto (epdserve's
# encoder service) and grpc_predict_v2.proto (the Open Inference Protocol v2 of KServe and Triton; its source and
# licence are in its header).
#
# protoc names generated imports after the .proto's path under its include root, so the .proto is copied into a
# temporary tree epdserve/proto/ first: the generated gRPC module then reads `from epdserve.proto import encoder_pb2`,
# which is where the package installs it.
# The checked-in code comes from grpcio-tools==1.73.1 (protobuf gencode 6.31): it runs on grpcio >= 1.73.1 and
# protobuf 6.31 to 7.x, the floors in pyproject.toml. Generate with that version to keep those floors.
# Usage: proto/generate.sh [python]   (python defaults to $PYTHON, then /work/venv/bin/python, then python3)
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
py="${1:-${PYTHON:-}}"
if [[ -z "$py" ]]; then
  if [[ -x /work/venv/bin/python ]]; then py=/work/venv/bin/python; else py=python3; fi
fi
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src/epdserve/proto" "$tmp/out"
for name in encoder grpc_predict_v2; do
  cp "$here/$name.proto" "$tmp/src/epdserve/proto/"
  "$py" -m grpc_tools.protoc -I "$tmp/src" --python_out="$tmp/out" --pyi_out="$tmp/out" --grpc_python_out="$tmp/out" \
    "$tmp/src/epdserve/proto/$name.proto"
  cp "$tmp/out/epdserve/proto/${name}_pb2.py" "$tmp/out/epdserve/proto/${name}_pb2.pyi" \
    "$tmp/out/epdserve/proto/${name}_pb2_grpc.py" "$here/"
  echo "generated $here/${name}_pb2{.py,.pyi,_grpc.py}"
done
