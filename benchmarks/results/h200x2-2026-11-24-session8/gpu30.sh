# 2x H200: as gpu29 (enc1, encpre1) with two encoders on GPU 1
exec > >(tee $OUT/log30.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res; RES=/tmp/res; s=11
G="Successful|Failed req|Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):"
for cfg in enc1x2 encpre1x2; do
  FL=""; [ $cfg = enc1x2 ] && FL="--encoder-gpu 1 --num-encoders 2"; [ $cfg = encpre1x2 ] && FL="--encoder-gpu 1 --prefill-base-gpu 1 --decode-base-gpu 0 --num-encoders 2"
  epdserve launch --model-path /tmp/p3b --port 8000 $FL > $RES/launch_$cfg.log 2>&1 &
  LP=$!
  for i in $(seq 300); do grep -q "epdserve ready" $RES/launch_$cfg.log && break; sleep 1; done
  M=$(grep -o "metrics: gateway=.*" $RES/launch_$cfg.log | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
  B="timeout 90 python3 -m epdserve.cli bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm --scrape-metrics $M"
  echo "== $cfg ($(date +%T))"
  $B --input-len 64 --output-len 32 --num-prompts 8 --max-concurrency 1 --seed $((100+s)) | grep -E "Median TTFT"
  $B --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128 --seed $s --output-json $RES/${cfg}_c128.json 2>&1 | grep -E "$G" | tr -s ' ' | paste -sd'|'
  s=$((s+1))
  kill -INT $LP; for i in $(seq 15); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli; sleep 2
done
python3 - <<'PY'
import json, glob
for f in sorted(glob.glob('/tmp/res/*_c128.json')):
    s = json.load(open(f))['summary']; m = s.get('server_metrics', {}); g = lambda d, k: d.get(k) or 0
    e, p, gw, d = next((v for k, v in m.items() if k.startswith('encoder')), {}), m.get('prefill', {}), m.get('gateway', {}), m.get('decode', {})
    print([k for k in m], ' '.join(f"{k}: imgs {g(v,'images'):.0f} batch {g(v,'batch_size_mean'):.2f} lat {g(v,'encode_latency_ms_mean'):.0f}" for k, v in m.items() if k.startswith('encoder'))); print(f.split('/')[-1], f"req/s {s['request_throughput_rps']:.2f} TTFT med {s['ttft_ms']['median']:.0f} mean {s['ttft_ms']['mean']:.0f} TPOT {s['tpot_ms']['mean']:.2f} errors {s['errors']} cached {s['cached_token_share']:.3f} | gw ttft {g(gw,'ttft_ms_mean'):.0f} | enc batch {g(e,'batch_size_mean'):.2f} lat {g(e,'encode_latency_ms_mean'):.0f} q {g(e,'queue_time_ms_mean'):.0f} stage {g(e,'stage_latency_ms_mean'):.0f} | prefill batch {g(p,'batch_size_mean'):.2f} stage {g(p,'stage_latency_ms_mean'):.0f} | decode batch {g(d,'batch_size_mean'):.1f}")
PY
cd $RES && for f in *c128.json; do python3 -c "
import json,sys; d=json.load(open('$f'))
d.pop('requests'); d.pop('warmup_requests')
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res30.tgz -C $RES .
echo "done $(date +%T)"
