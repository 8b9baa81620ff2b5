"""The front end shared by the gateway and the prefill/decode HTTP fronts: a protocol-neutral core (the modules
here) and one package per protocol beside it, each importing the core and never another protocol package, while
the core imports none (``tests/test_layout.py`` checks both):

- ``openai``: OpenAI's chat completions (tools, structured outputs, logprobs), completions and model list;
- ``native``: SGLang's native ``/generate``;
- ``kserve``: the Open Inference Protocol (v2) over HTTP (its gRPC servicer is the gateway's: ``kserve_grpc``);
- ``sglang``: SGLang's scheduler gRPC service, for smg's ``grpc://`` prefill/decode workers;
- ``tokenspeed``: TokenSpeed's scheduler gRPC service, for smg's EPD mode.

A protocol turns its wire format into the core's request model (:mod:`~epdserve.frontend.request`) and a
:class:`~epdserve.frontend.serving.Call` on one request path (:mod:`~epdserve.frontend.serving`), which admits a
request, prepares it with :class:`~epdserve.frontend.chat.ChatService` and answers it; the request's
:class:`~epdserve.frontend.lifetime.RequestLifetime` cleans up. The stages behind it are any
:class:`~epdserve.frontend.stages.Stages`. The servers compose the protocols they serve: the gateway in
``gateway/app.py``, a PD front in :mod:`epdserve.entry.front`.

:data:`PUBLIC` names the core modules a protocol package may import; the others (stage and encoder clients,
admission, media fetching, the request lifetime, observability, the PD front, the app factory, processes) belong to
the servers.
"""

import logging

PUBLIC = ("chat", "choices", "detokenizer", "errors", "grpc_service", "grpc_tensor", "httputil", "image_slots",
          "prompt", "request", "scheduler_grpc", "scheduler_requests", "serving", "structured", "tool_prompt")
PROTOCOLS = ("openai", "native", "kserve", "sglang", "tokenspeed")

# The front end's log lines keep the logger name they had when this code was the gateway's ("epdserve" child
# "gateway"): log readers (timelines, tests, dashboards) select lines by it. It names a logger, not a module.
logger = logging.getLogger("epdserve").getChild("gateway")
