# Device machine set-up: wheels and epdserve itself (no deps) into /tmp/site in one install (pip --target will not
# merge a second install's bin/), flashinfer's JIT cache in .ficache.
rm -rf /tmp/site
python3 -m pip install -q --no-index --no-deps --no-build-isolation --no-compile --no-cache-dir --target /tmp/site .whl/*.whl . || return 1
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
export FLASHINFER_WORKSPACE_BASE=$PWD/.ficache
mkdir -p .ficache; [ -f .ficache/cache.tgz ] && tar xzf .ficache/cache.tgz
python3 -c "import torch, flashinfer, epdserve, fastapi, grpc_health; print('setup ok', torch.__version__, flashinfer.__version__, torch.cuda.get_device_name())"
which epdserve
