# H100: the first c128 burst after launch (DEBUG timeline), then 1 vs 2 encoders at c128 (each c128 twice)
exec > >(tee $OUT/log27.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res; RES=/tmp/res
G="Successful|Failed req|Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):"
B="timeout 120 python3 -m epdserve.cli bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128"
for cfg in dbg enc2 enc1; do
  LV=INFO; FL=""; [ $cfg = dbg ] && LV=DEBUG; [ $cfg = enc2 ] && FL="--num-encoders 2"
  epdserve --log-level $LV launch --model-path /tmp/p3b --port 8000 $FL > $RES/launch_$cfg.log 2>&1 &
  LP=$!
  for i in $(seq 600); do grep -q "epdserve ready" $RES/launch_$cfg.log && break; sleep 1; done
  echo "== $cfg ready $(date +%T.%N | cut -c1-12)"
  M=$(grep -o "metrics: gateway=.*" $RES/launch_$cfg.log | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
  for k in 1 2; do
    echo "-- $cfg c128 #$k start $(date +%T.%N | cut -c1-12)"
    $B --scrape-metrics $M --output-json $RES/${cfg}_c128_$k.json 2>&1 | grep -E "$G" | tr -s ' ' | paste -sd'|'
  done
  kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli; sleep 1
  for i in $(seq 30); do U=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1); [ "$U" -lt 2000 ] && break; sleep 1; done
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob('/tmp/res/*_c128_*.json')):
    s = json.load(open(f))['summary']; m = s.get('server_metrics', {})
    e = {k: v for k, v in m.items() if k.startswith('encoder')}
    print(f.split('/')[-1], f"req/s {s['request_throughput_rps']:.2f} TTFT med {s['ttft_ms']['median']:.0f} gw_ttft {m.get('gateway',{}).get('ttft_ms_mean',0):.0f} gw_encwait {m.get('gateway',{}).get('encode_wait_ms_mean',0):.0f} prefill q/stage {m.get('prefill',{}).get('queue_time_ms_mean',0):.0f}/{m.get('prefill',{}).get('stage_latency_ms_mean',0):.0f} pbatch {m.get('prefill',{}).get('batch_size_mean',0):.2f}", ' '.join(f"{k}: imgs {v.get('images',0):.0f} batch {v.get('batch_size_mean',0):.2f} q {v.get('queue_time_ms_mean',0):.0f} stage {v.get('stage_latency_ms_mean',0):.0f} lat {v.get('encode_latency_ms_mean',0):.0f}" for k, v in e.items()))
PY
cd $RES && for f in *.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res27.tgz -C $RES .
echo "done $(date +%T)"
