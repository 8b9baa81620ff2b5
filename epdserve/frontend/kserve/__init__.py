"""The Open Inference Protocol (v2, KServe's and Triton's): tensors and their meaning (:mod:`.v2`) and the HTTP routes
(:mod:`.http`); the gateway serves it over gRPC too (``epdserve.gateway.kserve_grpc``)."""
