# H100: the encoder alone (images/s), then one launch: c128 with distinct images per run, aiohttp (new) and httpx
# (old, ba367f1's) clients alternated twice, server metrics scraped, per-process CPU during the first new run
exec > >(tee $OUT/log28.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site_old .gpu/old 2>&1 | grep -v -i warning
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res; RES=/tmp/res
echo "== encoder alone ($(date +%T))"
timeout 200 python3 -m epdserve.bench.encoder --model-path /tmp/p3b --image-sizes 448x448 1280x720 --batch 1 32 --num-images 128 --device cuda --cuda-graphs 32 --output-json $RES/encoder_alone.json 2>&1 | grep -v -i "warn" | tail -8
epdserve launch --model-path /tmp/p3b --port 8000 > $RES/launch.log 2>&1 &
LP=$!
for i in $(seq 600); do grep -q "epdserve ready" $RES/launch.log && break; sleep 1; done
M=$(grep -o "metrics: gateway=.*" $RES/launch.log | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
G="Successful|Failed req|Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):"
B="-m epdserve.cli bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --scrape-metrics $M"
timeout 60 python3 $B --input-len 64 --output-len 32 --num-prompts 8 --max-concurrency 1 --seed 100 | grep -E "Median TTFT"
s=1
for round in 1 2; do for cl in new old; do
  PP=/tmp/site; [ $cl = old ] && PP=/tmp/site_old:/tmp/site
  [ $round$cl = 1new ] && (sleep 4; python3 .gpu/cpusample.py 6 > $RES/cpu.txt 2>&1) &
  echo "-- c128 $cl round $round seed $s ($(date +%T))"
  PYTHONPATH=$PP timeout 120 python3 $B --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128 --seed $s --output-json $RES/c128_${cl}_$round.json 2>&1 | grep -E "$G" | tr -s ' ' | paste -sd'|'
  s=$((s+1))
done; done
tail -3 $RES/cpu.txt
kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob('/tmp/res/c128_*.json')):
    s = json.load(open(f))['summary']; m = s.get('server_metrics', {}); g = lambda d, k: d.get(k) or 0
    e, p, gw = m.get('encoder', {}), m.get('prefill', {}), m.get('gateway', {})
    print(f.split('/')[-1], f"req/s {s['request_throughput_rps']:.2f} TTFT med {s['ttft_ms']['median']:.0f} mean {s['ttft_ms']['mean']:.0f} errors {s['errors']} lag p99 {s['client']['loop_lag_ms']['p99']:.1f} | gw ttft {g(gw,'ttft_ms_mean'):.0f} encwait {g(gw,'encode_wait_ms_mean'):.0f} | enc imgs {g(e,'images'):.0f} hits {g(e,'cache_hits'):.0f} batch {g(e,'batch_size_mean'):.2f} lat {g(e,'encode_latency_ms_mean'):.0f} q {g(e,'queue_time_ms_mean'):.0f} stage {g(e,'stage_latency_ms_mean'):.0f} | prefill batch {g(p,'batch_size_mean'):.2f} stage {g(p,'stage_latency_ms_mean'):.0f} cached {s['total_cached_tokens']}")
PY
cd $RES && for f in c128*.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res28.tgz -C $RES .
echo "done $(date +%T)"
