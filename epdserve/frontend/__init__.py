"""The OpenAI-compatible front end shared by the gateway and the prefill/decode HTTP fronts.

Protocol routers (``openai``, ``native``) turn HTTP bodies into calls on one request path (``serving``), which
admits a request, prepares it with :class:`~epdserve.frontend.chat.ChatService` and answers it; the request's
:class:`~epdserve.frontend.lifetime.RequestLifetime` cleans up. The stages behind it are any
:class:`~epdserve.frontend.stages.Stages`.
"""

import logging

# The front end's log lines keep the logger name they had when this code was the gateway's ("epdserve" child
# "gateway"): log readers (timelines, tests, dashboards) select lines by it. It names a logger, not a module.
logger = logging.getLogger("epdserve").getChild("gateway")
