"""An OpenAI-compatible HTTP front door in front of Triton that keeps a TTFT deadline under overload.

::

    from toolkit.frontdoor import create_app, FrontDoorServer
    app = create_app(spec_or_repository, "127.0.0.1:8001", metrics_url="http://127.0.0.1:8002")
    with FrontDoorServer(app, "127.0.0.1", 8080) as fd:
        ...   # POST fd.url + "/v1/chat/completions"

See docs/guard.md.
"""

from .app import DEADLINE_HEADER, TIER_HEADER, FrontDoor, create_app
from .config import FrontDoorConfig, config_from
from .runner import FrontDoorServer

__all__ = [
    "DEADLINE_HEADER",
    "TIER_HEADER",
    "FrontDoor",
    "FrontDoorConfig",
    "FrontDoorServer",
    "config_from",
    "create_app",
]
