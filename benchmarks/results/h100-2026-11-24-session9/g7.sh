# Call G: side by side on one machine, the same workloads against two launches: nvJPEG (default) and PIL.
exec > >(tee $OUT/log7.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
RES=/tmp/res; mkdir -p $RES; s=200
G="Request throughput|Median TTFT|Mean TTFT \(ms\):|Mean TPOT \(ms\):"
for L in gpu pil gpu2; do
  F=""; [ $L = pil ] && F="--no-encoder-gpu-jpeg-decode"
  epdserve launch --model-path /tmp/p3b --port 8000 $F > $RES/launch_$L.log 2>&1 &
  LP=$!
  for i in $(seq 300); do grep -q "epdserve ready" $RES/launch_$L.log && break; kill -0 $LP || break; sleep 1; done
  echo "== launch $L ready $(date +%T)"
  B="epdserve bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer /tmp/p3b --temperature 0 --disable-tqdm"
  for w in "c1 --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1" \
           "c1_720p --input-len 64 --output-len 128 --num-prompts 12 --max-concurrency 1 --image-sizes 1280x720" \
           "c128 --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128"; do
    set -- $w; tag=$1; shift; s=$((s+1))
    echo "-- $L $tag seed $s: $(timeout 150 $B "$@" --seed $s --output-json $RES/${L}_$tag.json 2>&1 | grep -E "$G" | tr -s ' ' | paste -sd'|')"
  done
  kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done; pkill -9 -f epdserve.cli; sleep 1
  [ $L = pil ] || true
done
cd $RES && for f in *.json; do python3 -c "
import json; d=json.load(open('$f'))
for r in d['requests']: r.pop('itl_s', None)
json.dump(d, open('$f','w'))"; done; gzip -f *.log; tar czf $OUT/res7.tgz -C $RES .
echo "done $(date +%T)"
