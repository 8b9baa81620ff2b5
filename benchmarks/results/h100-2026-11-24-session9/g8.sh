# Call H: the encoder alone at 448², nvJPEG on (default), --max-batch-patches 65536 vs 16384 alternated.
exec > >(tee $OUT/log8.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -1 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
i=0
for mbp in 65536 16384 65536 16384; do i=$((i+1))
  echo "== max-batch-patches $mbp (run $i) $(date +%T)"
  timeout 120 python3 -m epdserve.bench.encoder --model-path /tmp/p3b --image-sizes 448x448 --batch 64 128 \
    --num-images 512 --device cuda --cuda-graphs 32 --max-batch-patches $mbp --seed $i --output-json $OUT/enc8_${i}_$mbp.json 2>&1 | grep -v -i warn | tail -3
done
echo "done $(date +%T)"
