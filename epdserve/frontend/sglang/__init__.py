"""SGLang's scheduler gRPC protocol on a prefill or decode front's ``--grpc-port``: the service (:mod:`.service`) and
its request conversion (:mod:`.requests`)."""
