# Call D: GPU tests (flashinfer tensor-core decode, nvJPEG), decode step bench, prefill attention backends,
# the encoder one at a time with PIL vs nvJPEG.
exec > >(tee $OUT/log4.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
echo "== gpu tests $(date +%T)"
EPDSERVE_GPU_TEST_MODELS=/tmp/p3b timeout 330 python3 -m pytest -q -p no:cacheprovider -m gpu -x \
  tests/test_model_runtime.py tests/test_cuda_graph.py tests/test_prefill_graph.py tests/test_encoder_batching.py \
  tests/test_vision_graph.py > $OUT/gpu_tests.log 2>&1; tail -4 $OUT/gpu_tests.log
echo "== decode step $(date +%T)"
timeout 120 python3 -m epdserve.bench.step --model-path /tmp/p3b --batch-sizes 1 32 128 --context 512 --output-json $OUT/step.json 2>&1 | grep -v -i warn
echo "== prefill attention $(date +%T)"
timeout 120 python3 .gpu/prefill_attn.py 2>&1 | grep -v -i warn
echo "== encoder alone, PIL vs nvJPEG $(date +%T)"
timeout 200 python3 -m epdserve.bench.encoder --model-path /tmp/p3b --image-sizes 448x448 1280x720 --batch 1 64 \
  --num-images 128 --device cuda --cuda-graphs 32 --gpu-jpeg-decode 0 1 --output-json $OUT/enc_jpeg.json 2>&1 | grep -v -i warn | tail -10
tar czf $OUT/ficache.tgz --exclude cache.tgz .ficache
echo "done $(date +%T)"
