# Call A: set-up, decode step profile at batch 128 + attention variants, encoder alone at rising concurrency.
exec > >(tee $OUT/log1.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
nproc; nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /dev/null 2>&1
echo "== decode profile $(date +%T)"
timeout 330 python3 .gpu/prof_decode.py /tmp/p3b 2>&1 | grep -v -i warn
tar czf $OUT/ficache.tgz .ficache; ls -la $OUT/ficache.tgz
for mbp in 16384 32768; do
  echo "== encoder alone, max-batch-patches $mbp $(date +%T)"
  timeout 150 python3 -m epdserve.bench.encoder --model-path /tmp/p3b --image-sizes 448x448 --batch 1 32 64 128 \
    --num-images 256 --device cuda --cuda-graphs 32 --max-batch-patches $mbp --output-json $OUT/enc_$mbp.json 2>&1 | grep -v -i warn | tail -8
done
echo "done $(date +%T)"
