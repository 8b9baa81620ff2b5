"""The transfer engines ``--kv-transfer`` names, without importing them or torch (the launcher checks the flag
before it starts any stage; :mod:`epdserve.kvcache.engine` makes them)."""

# name -> (module, class, how to install its package)
KV_ENGINES = {"nixl": ("epdserve.kvcache.engine_nixl", "NixlEngine", "pip install 'epdserve[nixl]'"),
              "mooncake": ("epdserve.kvcache.engine_mooncake", "MooncakeEngine",
                           "pip install 'epdserve[mooncake]' (its CUDA build: needs libcudart.so.12), or "
                           "'epdserve[mooncake-cpu]' on a machine without CUDA (needs libibverbs.so.1)")}
