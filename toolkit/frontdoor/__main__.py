"""``python -m toolkit.frontdoor REPOSITORY --triton-grpc HOST:PORT [--metrics-url URL] [--host H] [--port P]``

The front door as its own process (a detached deployment runs it this way).  Over replicas of the
repository (``rtk serve --replicas N``) ``--triton-grpc`` and ``--metrics-url`` are given once per replica,
in the same order.  ``--set`` takes the
spec's dotted overrides for ``serving.frontend`` / ``serving.guard`` / ``serving.cache``, e.g.
``--set serving.guard.ttft_deadline_ms=300``.  It prints ``ready URL`` once it listens.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    from ..errors import RtkError
    from ..spec import apply_overrides
    from .app import create_app
    from .config import config_from
    from .runner import FrontDoorServer, quiet_third_party

    ap = argparse.ArgumentParser(prog="python -m toolkit.frontdoor", description=__doc__.splitlines()[0])
    ap.add_argument("repository")
    ap.add_argument("--triton-grpc", required=True, action="append", help="HOST:PORT; once per replica")
    ap.add_argument("--metrics-url", action="append", help="Triton's metrics URL; once per replica")
    ap.add_argument(
        "--model",
        default="ensemble",
        help="Triton model: ensemble (default; requests go straight to its tensorrt_llm unless "
        "serving.frontend.primary_model is ensemble) or tensorrt_llm_bls",
    )
    ap.add_argument("--host")
    ap.add_argument("--port", type=int)
    ap.add_argument("--set", action="append", default=[], metavar="serving.SECTION.FIELD=VALUE")
    ap.add_argument("--serving-json", help="the spec's front-door sections of serving, as JSON (used by rtk serve)")
    ap.add_argument("--ready-file", help="write the URL here once listening (used by rtk serve --detach)")
    ap.add_argument(
        "--follow-state-file",
        action="store_true",
        help="on SIGHUP switch to the server the repository's state file names (rtk serve --reload)",
    )
    args = ap.parse_args(argv)
    if args.metrics_url and len(args.metrics_url) != len(args.triton_grpc):
        print(
            f"error: --metrics-url: give one per --triton-grpc ({len(args.triton_grpc)} gRPC addresses, "
            f"{len(args.metrics_url)} metrics URLs)",
            file=sys.stderr,
        )
        return 2
    quiet_third_party()
    try:
        cfg = config_from(args.repository, triton_model=args.model)
        if args.serving_json:
            for name, section in json.loads(args.serving_json).items():
                if hasattr(cfg, name):
                    setattr(cfg, name, type(getattr(cfg, name))(**section))
            cfg.model_name = cfg.frontend.model_name or cfg.model_name
        if args.set:
            data = apply_overrides(
                {
                    "serving": {
                        "frontend": cfg.frontend.model_dump(),
                        "guard": cfg.guard.model_dump(),
                        "cache": cfg.cache.model_dump(),
                    }
                },
                args.set,
            )
            s = data["serving"]
            cfg.frontend = type(cfg.frontend)(**s["frontend"])
            cfg.guard = type(cfg.guard)(**s["guard"])
            cfg.cache = type(cfg.cache)(**s["cache"])
        host = args.host or cfg.frontend.host
        port = args.port or cfg.frontend.port
        app = create_app(cfg, args.triton_grpc, metrics_url=args.metrics_url)
        server = FrontDoorServer(app, host, port).start()
    except (RtkError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.follow_state_file:  # before the ready file: rtk serve --reload may signal at once
        server.follow_state_file(args.repository)
    print(f"ready {server.url}", flush=True)
    if args.ready_file:
        Path(args.ready_file).write_text(server.url)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    stop.wait()
    server.stop()
    return 0


if __name__ == "__main__":
    sys.exit(main())
