exec > >(tee $OUT/log3.txt) 2>&1
source .gpu/setup.sh > /tmp/setup.log 2>&1; tail -2 /tmp/setup.log
[ -f /tmp/p3b/config.json ] || epdserve make-tiny-model /tmp/p3b --preset qwen2.5-vl-3b --device cuda > /tmp/mk.log 2>&1 || tail /tmp/mk.log
echo "== encoder one at a time + c128 under py-spy $(date +%T)"
timeout 150 python3 .gpu/enc_one.py /tmp/p3b 2>&1 | grep -v -i warn
gzip -f $OUT/spy_enc.txt
echo "== attention variants $(date +%T)"
timeout 280 python3 .gpu/attn_variants.py 2>&1 | grep -v -i warn
tar czf $OUT/ficache.tgz --exclude cache.tgz .ficache
echo "done $(date +%T)"
