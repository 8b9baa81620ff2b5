# Call B: attention variants; encoder pipeline stages; 448 and 720p one request at a time with the DEBUG timeline.
exec > >(tee $OUT/log2.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
echo "== attention variants $(date +%T)"
timeout 120 python3 .gpu/attn_variants.py 2>&1 | grep -v -i warn
echo "== encoder stages $(date +%T)"
timeout 200 python3 .gpu/enc_stages.py /tmp/p3b 2>&1 | grep -v -i warn
echo "== debug launch $(date +%T)"
RES=/tmp/res; mkdir -p $RES
epdserve --log-level DEBUG launch --model-path /tmp/p3b --port 8000 > $RES/launch_debug.log 2>&1 &
LP=$!
for i in $(seq 300); do grep -q "epdserve ready" $RES/launch_debug.log && break; kill -0 $LP || break; sleep 1; done
grep ready $RES/launch_debug.log | tail -1; echo "ready $(date +%T)"
B="epdserve bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1"
timeout 60 $B --seed 1 --output-json $RES/c1.json | grep -E "TTFT|TPOT"
timeout 60 $B --seed 2 --image-sizes 1280x720 --output-json $RES/c1_720p.json | grep -E "TTFT|TPOT"
kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli
python3 -m epdserve.bench.timeline $RES/launch_debug.log
gzip -f $RES/launch_debug.log; tar czf $OUT/res2.tgz -C $RES .
tar czf $OUT/ficache.tgz --exclude cache.tgz .ficache
echo "done $(date +%T)"
