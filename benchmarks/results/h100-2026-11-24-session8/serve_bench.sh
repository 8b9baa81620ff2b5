# serve_bench.sh MODEL TAG WORKLOADS [launch flags...]; WORKLOADS: comma list of c1,c1_720p,c32,c128
M=$1; T=$2; W=$3; shift 3; RES=${RES:-/tmp/res}; mkdir -p $RES
epdserve --log-level ${LOGLEVEL:-INFO} launch --model-path $M --port 8000 "$@" > $RES/launch_$T.log 2>&1 &
LP=$!
for i in $(seq 600); do grep -q "epdserve ready" $RES/launch_$T.log && break; sleep 1; kill -0 $LP || break; done
grep "ready" $RES/launch_$T.log | tail -6
[ -n "$COLLECT" ] && bash .gpu/collect_ficache.sh
METRICS=$(grep -o "metrics: gateway=.*" $RES/launch_$T.log | tail -1 | grep -o "http://[^ ]*" | paste -sd, -)
B="timeout ${BT:-150} python3 -m epdserve.cli bench --base-url http://127.0.0.1:8000 --dataset random-mm --tokenizer $M --temperature 0 --disable-tqdm ${METRICS:+--scrape-metrics $METRICS}"
for w in ${W//,/ }; do
  if [ -n "$PROF" ] && [ $w = c128 ]; then (sleep ${PROF_AT:-4}; python3 .gpu/cpusample.py 6 > $RES/cpu_$T.txt 2>&1) &
    (sleep ${PROF_AT:-4}; for r in gateway encoder bench; do P=$(pgrep -f "^[^ ]*python[0-9.]* -m epdserve.cli.* $r " | head -1); [ -n "$P" ] && timeout 20 py-spy record -d 5 -r 100 --nonblocking -f raw -o $RES/spy_${T}_$r.txt -p $P > $RES/spy_${T}_$r.log 2>&1 & done; wait) & fi
  case $w in
    c1) $B --input-len 64 --output-len ${OL1:-128} --num-prompts ${NP1:-12} --max-concurrency 1 --save-text --output-json $RES/${T}_c1.json ;;
    c1_720p) $B --input-len 64 --output-len ${OL1:-128} --num-prompts ${NP1:-12} --max-concurrency 1 --image-sizes 1280x720 --output-json $RES/${T}_c1_720p.json ;;
    c32) $B --input-len 512 --output-len 128 --num-prompts 128 --max-concurrency 32 --output-json $RES/${T}_c32.json ;;
    c128) $B --input-len 256 --output-len 256 --num-prompts 256 --max-concurrency 128 --output-json $RES/${T}_c128.json ;;
  esac 2>&1 | grep -E -i "Successful|Failed|Request throughput|Output token throughput|Mean TTFT|Median TTFT|Mean TPOT|Median TPOT|Traceback|Error|kv|batch"
  [ ${PIPESTATUS[0]} = 124 ] && { echo "BENCH $w TIMED OUT"; python3 .gpu/loads.py $RES/launch_$T.log; pkill -USR1 -f "epdserve.cli.*decode"; sleep 2; grep -v DEBUG $RES/launch_$T.log | tail -${STK:-45}; }
done
kill -INT $LP; for i in $(seq 20); do kill -0 $LP 2>/dev/null || break; sleep 1; done
pkill -9 -f "epdserve.cli" ; sleep 1
for i in $(seq 30); do U=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | sort -n | tail -1); [ "$U" -lt 2000 ] && break; sleep 1; done
[ "${LOGLEVEL:-INFO}" = DEBUG ] && python3 -m epdserve.bench.timeline $RES/launch_$T.log | tee $RES/timeline_$T.txt
gzip -f $RES/launch_$T.log; tar czf $OUT/res_$T.tgz -C $RES .
