# H100: is the gateway the c128 limit? 1 gateway/1 client, 1 gateway/2 clients, 2 gateways/2 clients, 4 gateways/4 clients
exec > >(tee $OUT/log25.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res; RES=/tmp/res
epdserve launch --model-path /tmp/p3b --port 8000 --encoder-cuda-graphs 32 > $RES/launch.log 2>&1 &
LP=$!
for i in $(seq 600); do grep -q "epdserve ready" $RES/launch.log && break; sleep 1; done
GW=$(pgrep -f "^[^ ]*python[0-9.]* -m epdserve.cli.* gateway " | head -1)
mapfile -d '' ARGS < /proc/$GW/cmdline
echo "gateway: ${ARGS[*]}"
for p in 8001 8002 8003; do
  A=("${ARGS[@]}"); for k in "${!A[@]}"; do [ "${A[$k]}" = 8000 ] && A[$k]=$p; done
  "${A[@]}" > $RES/gw$p.log 2>&1 &
done
for p in 8001 8002 8003; do for i in $(seq 120); do curl -sf localhost:$p/health > /dev/null && break; sleep 0.5; done; done
echo "extra gateways up: $(for p in 8001 8002 8003; do curl -s -o /dev/null -w '%{http_code} ' localhost:$p/health; done)"
B="python3 -m epdserve.cli bench --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --input-len 256 --output-len 256"
G="Successful|Failed req|Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):"
run() {  # run TAG PORTS... : one client per port, 128 concurrent in all, 256 prompts in all
  local tag=$1; shift; local n=$#; local i=0; local pids=()
  echo "== $tag ($(date +%T))"
  for p in "$@"; do
    timeout 90 $B --base-url http://127.0.0.1:$p --num-prompts $((256 / n)) --max-concurrency $((128 / n)) --seed $i --output-json $RES/${tag}_$i.json > $RES/${tag}_$i.txt 2>&1 &
    pids+=($!); i=$((i+1))
  done; wait "${pids[@]}"
  for j in $(seq 0 $((n-1))); do grep -E "$G" $RES/${tag}_$j.txt | tr -s ' ' | paste -sd'|'; done
}
for round in 1 2; do
  run g1c1_r$round 8000
  run g1c2_r$round 8000 8000
  run g2c2_r$round 8000 8001
  run g4c4_r$round 8000 8001 8002 8003
done
kill -INT $LP; pkill -INT -f "epdserve.cli.* gateway "; sleep 5; pkill -9 -f epdserve.cli
python3 - <<'PY'
import json, glob, collections, statistics
runs = collections.defaultdict(list)
for f in sorted(glob.glob('/tmp/res/*_r*_*.json')):
    runs[f.rsplit('_', 1)[0].split('/')[-1]].append(json.load(open(f)))
for tag, ds in runs.items():
    recs = [r for d in ds for r in d['requests']]
    ok = [r for r in recs if r['success']]
    dur = max(d['summary']['duration_s'] for d in ds)
    t = sorted(r['ttft_s'] * 1000 for r in ok)
    tp = [r['tpot_s'] * 1000 for r in ok if r['tpot_s']]
    print(f"{tag:10s} ok {len(ok)}/{len(recs)} req/s {len(ok)/dur:6.2f} TTFT median {statistics.median(t):7.1f} mean {statistics.mean(t):7.1f} p90 {t[int(.9*len(t))]:7.1f} TPOT mean {statistics.mean(tp):5.2f}")
PY
cd $RES && for f in *.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res25.tgz -C $RES .
echo "done $(date +%T)"
