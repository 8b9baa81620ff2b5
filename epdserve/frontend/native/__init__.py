"""SGLang's native ``/generate``: its request (:mod:`.protocol`), answers (:mod:`.generate`) and router
(:mod:`.routes`)."""
