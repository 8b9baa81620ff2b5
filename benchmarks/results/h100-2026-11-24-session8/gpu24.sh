# H100: where c128 spends CPU (per-process CPU %, py-spy of gateway/encoder/bench client); encoder graphs vs default
exec > >(tee $OUT/log24.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
py-spy --version
epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
mkdir -p /tmp/res
export RES=/tmp/res BT=60 NP1=16 OL1=32
G="Median TTFT|Mean TTFT \(ms\):|Request throughput|Mean TPOT \(ms\):|Successful|Failed"
for round in 1 2; do
  echo "== round $round A: default ($(date +%T))"
  PROF=$([ $round = 1 ] && echo 1) bash .gpu/serve_bench.sh /tmp/p3b a$round c1,c1_720p,c32,c128 | grep -E "$G"
  [ $round = 1 ] && { cat $RES/cpu_a1.txt | tail -14; cat $RES/spy_a1_*.log | tail -6; }
  echo "== round $round EG: --encoder-cuda-graphs 32 ($(date +%T))"
  bash .gpu/serve_bench.sh /tmp/p3b eg$round c1,c1_720p,c32,c128 --encoder-cuda-graphs 32 | grep -E "$G"
done
echo "done $(date +%T)"
