"""`ddiloco synchronizer`: serve the synchronizer over HTTP/2 cleartext (and HTTP/1.1).

    DDILOCO_TOKEN=s3cret ddiloco synchronizer --state-dir /tmp/ddiloco-state --port 8470

Settings come from the environment (`DDILOCO_*`, see config.py); the few flags here
override them. uvicorn >= 0.54 with its zttp protocol serves h2c by prior knowledge.
"""

from __future__ import annotations

import argparse
import logging
import os

import uvicorn

from ddiloco.synchronizer.app import create_app
from ddiloco.synchronizer.config import SyncSettings


def init_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s sync %(levelname)s %(name)s: %(message)s")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ddiloco synchronizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", help="address to bind (env DDILOCO_HOST)")
    ap.add_argument("--port", type=int, help="TCP port (env DDILOCO_PORT, default 8470)")
    ap.add_argument("--state-dir", help="durable state directory (env DDILOCO_STATE_DIR)")
    ap.add_argument(
        "--quorum", type=int, help="K, minimum contributors per merge (env DDILOCO_QUORUM)"
    )
    ap.add_argument("--no-grace", action="store_true", help="merge at the quorum, no grace window")
    ap.add_argument(
        "--merge", choices=["rda", "mean"], help="non-embedding merge rule (env DDILOCO_MERGE)"
    )
    ap.add_argument("--http1", action="store_true", help="serve HTTP/1.1 only (comparison runs)")
    ap.add_argument("--log-level", default=os.environ.get("DDILOCO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    init_logging(args.log_level)
    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "state_dir": args.state_dir,
            "quorum": args.quorum,
            "merge": args.merge,
            "grace": False if args.no_grace else None,
        }.items()
        if v is not None
    }
    settings = SyncSettings(**overrides)
    shown = settings.model_dump(exclude={"token", "token_file"})
    logging.getLogger("ddiloco.synchronizer").info("Starting synchronizer config=%s", shown)
    http = {"http": "h11"} if args.http1 else {"http": "zttp", "http2": True}
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        **http,
    )
    uvicorn.Server(config).run()
    return 0
