exec > >(tee $OUT/log6.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
echo "== jpeg diff $(date +%T)"
timeout 150 python3 .gpu/jpeg_diff.py /tmp/p3b 2>&1 | grep -v -i warn
echo "== gpu tests $(date +%T)"
timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/test_encoder_batching.py tests/test_vision_graph.py \
  tests/test_prefill_graph.py > $OUT/gpu_tests6.log 2>&1; grep -E "passed|failed|^E  " $OUT/gpu_tests6.log | head
echo "done $(date +%T)"
