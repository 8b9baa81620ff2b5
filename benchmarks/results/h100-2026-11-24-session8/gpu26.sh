# H100: the bench client at c128: aiohttp (new) vs httpx (old, ba367f1's client), one process vs two; then the
# issue's table with the new defaults (encoder graphs 32) and the new client. Two launches.
exec > >(tee $OUT/log26.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site_old .gpu/old 2>&1 | grep -v -i warning
python3 -c "import aiohttp; print('aiohttp', aiohttp.__version__)"
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res; RES=/tmp/res
B="--dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm"
G="Successful|Failed req|Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):|Median TPOT"
one() {  # one TAG CLIENT(new|old) NPROC ARGS... : NPROC client processes sharing the prompts and the concurrency
  local tag=$1 cl=$2 n=$3; shift 3; local pids=() PP=/tmp/site
  [ $cl = old ] && PP=/tmp/site_old:/tmp/site
  echo "== $tag ($(date +%T))"
  for i in $(seq 0 $((n-1))); do
    PYTHONPATH=$PP timeout 120 python3 -m epdserve.cli bench --base-url http://127.0.0.1:8000 $B "$@" --seed $i --output-json $RES/${tag}_$i.json > $RES/${tag}_$i.txt 2>&1 &
    pids+=($!)
  done; wait "${pids[@]}"
  for i in $(seq 0 $((n-1))); do grep -E "$G" $RES/${tag}_$i.txt | tr -s ' ' | paste -sd'|'; done
}
C128="--input-len 256 --output-len 256"
for L in 1 2; do
  epdserve launch --model-path /tmp/p3b --port 8000 > $RES/launch$L.log 2>&1 &
  LP=$!
  for i in $(seq 600); do grep -q "epdserve ready" $RES/launch$L.log && break; sleep 1; done
  ps -eo args | grep -o "encoder .*cuda-graphs [0-9]*" | grep -o "cuda-graphs [0-9]*" | head -1
  one L${L}_new1 new 1 $C128 --num-prompts 256 --max-concurrency 128
  one L${L}_old1 old 1 $C128 --num-prompts 256 --max-concurrency 128
  one L${L}_new2 new 2 $C128 --num-prompts 128 --max-concurrency 64
  one L${L}_c1 new 1 --input-len 64 --output-len 32 --num-prompts 16 --max-concurrency 1
  one L${L}_c1_720p new 1 --input-len 64 --output-len 32 --num-prompts 16 --max-concurrency 1 --image-sizes 1280x720
  one L${L}_c32 new 1 --input-len 512 --output-len 128 --num-prompts 128 --max-concurrency 32
  kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli; sleep 1
  for i in $(seq 30); do U=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1); [ "$U" -lt 2000 ] && break; sleep 1; done
done
python3 - <<'PY'
import json, glob, collections, statistics
runs = collections.defaultdict(list)
for f in sorted(glob.glob('/tmp/res/L*_*.json')):
    runs[f.rsplit('_', 1)[0].split('/')[-1]].append(json.load(open(f)))
for tag, ds in runs.items():
    recs = [r for d in ds for r in d['requests']]
    ok = [r for r in recs if r['success']]
    dur = max(d['summary']['duration_s'] for d in ds)
    t = sorted(r['ttft_s'] * 1000 for r in ok)
    tp = [r['tpot_s'] * 1000 for r in ok if r['tpot_s']]
    lag = [d['summary']['client']['loop_lag_ms'] for d in ds]
    print(f"{tag:12s} ok {len(ok)}/{len(recs)} req/s {len(ok)/dur:6.2f} TTFT median {statistics.median(t):7.1f} mean {statistics.mean(t):7.1f} p90 {t[int(.9*len(t))]:7.1f} TPOT mean {statistics.mean(tp):5.2f} | client loop lag mean/p99 " + ", ".join(f"{l['mean']:.1f}/{l['p99']:.1f}" for l in lag))
PY
cd $RES && for f in *.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res26.tgz -C $RES .
echo "done $(date +%T)"
