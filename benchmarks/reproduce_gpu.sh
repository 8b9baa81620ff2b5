#!/usr/bin/env bash
# Re-measure docs/performance.md's GPU tables on one CUDA machine with epdserve installed.
#
#   bash benchmarks/reproduce_gpu.sh RESULTS_DIR [launch flags...]
#   e.g. bash benchmarks/reproduce_gpu.sh /tmp/res --encoder-cuda-graphs 32
#        bash benchmarks/reproduce_gpu.sh /tmp/res --kv-transfer zmq     # the host KV path (default: auto)
#        PRESET=qwen3.5-9b MODEL=/tmp/q9 bash benchmarks/reproduce_gpu.sh /tmp/res --num-pages 8192
#        (the 9B twice does not fit an 80 GB card with the default KV sizing)
#
# Steps: the $PRESET preset (default qwen2.5-vl-3b; random bf16 weights, ~30 s), the decode step beside its
# roofline with its top kernels, the GPU tests, the encoder alone (eager and
# torch.compile, each without and with CUDA graphs, side by side), then `epdserve launch` with the given flags
# and the issue workloads: 1 request at a time (448x448 and 1280x720), 32 and 128 concurrent; then the same
# launch with DEBUG logs for the one-request stage timeline. JSON records go to RESULTS_DIR. A workload that runs
# past BENCH_TIMEOUT_S (default 300) gets every server's Python stacks dumped into the launch log (SIGUSR1) and the
# GPU's utilization printed before the next one: a hung GPU shows 100 % or 0 %, a slow one in between.
set -uo pipefail
RES=${1:?results directory}; shift
MODEL=${MODEL:-/tmp/p3b}
mkdir -p "$RES"
run() { echo "+ $*"; "$@"; }

[ -f "$MODEL/config.json" ] || run epdserve make-tiny-model "$MODEL" --preset "${PRESET:-qwen2.5-vl-3b}" --device cuda
run python -m epdserve.bench.step --model-path "$MODEL" --batch-sizes 1 32 128 --profile --output-json "$RES/step.json" \
    > "$RES/step.txt" 2>&1
head -6 "$RES/step.txt"
# The whole pytest output stays in RESULTS_DIR: a failure's message is in its middle, not its last lines.
EPDSERVE_GPU_TEST_MODELS=$MODEL run python -m pytest -q -p no:cacheprovider -m gpu tests/ > "$RES/gpu_tests.log" 2>&1
tail -3 "$RES/gpu_tests.log"
run python -m epdserve.bench.encoder --model-path "$MODEL" --image-sizes 448x448 1280x720 --batch 1 32 \
    --num-images 96 --device cuda --max-batch-patches 65536 --compile 0 1 --cuda-graphs 0 32 \
    --output-json "$RES/encoder.json"

epdserve launch --model-path "$MODEL" --port 8000 "$@" > "$RES/launch.log" 2>&1 &
LAUNCH=$!
for _ in $(seq 900); do grep -q "epdserve ready" "$RES/launch.log" && break; kill -0 $LAUNCH || break; sleep 1; done
grep "ready" "$RES/launch.log" | tail -1

# Every stage's /metrics, from the launcher's "metrics: gateway=URL encoder0=URL ..." line: the bench reports
# what moved on the servers (KV hand-off bytes and latency, encoder batch sizes) beside its own figures.
METRICS=$(grep -o "metrics: gateway=.*" "$RES/launch.log" | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
B=(epdserve bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer "$MODEL" --temperature 0
   --disable-tqdm ${METRICS:+--scrape-metrics "$METRICS"})
declare -A LOADS=(
  [c1]="--input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1"
  [c1_720p]="--input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --image-sizes 1280x720"
  [c32]="--input-len 512 --output-len 128 --num-prompts 128 --max-concurrency 32"
  [c128]="--input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128"
)
for w in c1 c1_720p c32 c128; do
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-300}" "${B[@]}" ${LOADS[$w]} --output-json "$RES/$w.json" 2>&1 |
    grep -E -i "Successful|Failed|Request throughput|Output token throughput|TTFT|TPOT|kv|batch"
  if [ "${PIPESTATUS[0]}" = 124 ]; then
    echo "$w timed out"
    nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv
    pkill -USR1 -f "epdserve\.cli --log-level [A-Z]+ --log-format [a-z]+ (encoder|prefill|decode) "
    sleep 2
  fi
done
kill -INT $LAUNCH; wait $LAUNCH

# Where one request's time goes: the same launch with DEBUG logs (their cost stays out of the figures above),
# one request at a time, then the stage timeline of epdserve.bench.timeline.
epdserve --log-level DEBUG launch --model-path "$MODEL" --port 8000 "$@" > "$RES/launch_debug.log" 2>&1 &
LAUNCH=$!
for _ in $(seq 900); do grep -q "epdserve ready" "$RES/launch_debug.log" && break; kill -0 $LAUNCH || break; sleep 1; done
for w in c1 c1_720p; do  # without --scrape-metrics: this launch's metrics ports are new
  # shellcheck disable=SC2086
  timeout "${BENCH_TIMEOUT_S:-300}" epdserve bench --base-url http://127.0.0.1:8000 --dataset random-mm \
    --tokenizer "$MODEL" --temperature 0 --disable-tqdm ${LOADS[$w]} --output-json "$RES/${w}_debug.json" > /dev/null
done
kill -INT $LAUNCH; wait $LAUNCH
python -m epdserve.bench.timeline "$RES/launch_debug.log" | tee "$RES/timeline_c1.txt"
