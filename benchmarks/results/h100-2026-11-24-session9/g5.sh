# Call E: GPU tests left (nvJPEG, vision graphs, prefill graphs on the small model), then epdserve launch with the
# new defaults (tensor-core decode, nvJPEG) and the issue workloads, distinct seeds; encoder metrics scraped.
exec > >(tee $OUT/log5.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
echo "== gpu tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_encoder_batching.py tests/test_vision_graph.py \
  tests/test_prefill_graph.py > $OUT/gpu_tests5.log 2>&1; tail -3 $OUT/gpu_tests5.log
RES=/tmp/res; mkdir -p $RES
epdserve launch --model-path /tmp/p3b --port 8000 > $RES/launch.log 2>&1 &
LP=$!
for i in $(seq 300); do grep -q "epdserve ready" $RES/launch.log && break; kill -0 $LP || break; sleep 1; done
grep "ready" $RES/launch.log | tail -1; date +%T
M=$(grep -o "metrics: gateway=.*" $RES/launch.log | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
G="Successful|Failed req|Request throughput|Output token throughput|Median TTFT|Mean TTFT|Mean TPOT|Median TPOT"
B="epdserve bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --scrape-metrics $M"
run() { local tag=$1; shift; echo "-- $tag $(date +%T)"; timeout 150 $B "$@" --output-json $RES/$tag.json 2>&1 | grep -E "$G" | tr -s ' ' | paste -sd'|'; }
run c1_a --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --seed 101
run c1_720p_a --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --image-sizes 1280x720 --seed 102
run c32 --input-len 512 --output-len 128 --num-prompts 128 --max-concurrency 32 --seed 103
run c128_a --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128 --seed 104
run c128_b --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128 --seed 105
run c1_b --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --seed 106
run c1_720p_b --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --image-sizes 1280x720 --seed 107
kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli
cd $RES && for f in c*.json; do python3 -c "
import json; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f launch.log; tar czf $OUT/res5.tgz -C $RES .
echo "done $(date +%T)"
