"""`ddiloco synchronizer`: serve the synchronizer over HTTP/2 (and HTTP/1.1), h2c or TLS.

    DDILOCO_TOKEN=s3cret ddiloco synchronizer --state-dir /tmp/ddiloco-state --port 8470
    DDILOCO_TOKEN_FILE=/run/secrets/token ddiloco synchronizer \
        --tls-cert server.crt --tls-key server.key [--tls-client-ca ca.crt]
    ddiloco synchronizer --shard 1 --shards 2 --state-dir state-1 --port 8471   # shards.py
    ddiloco synchronizer --upload-port 8471     # updates read straight off the socket (upload_port.py)

Settings come from the environment (`DDILOCO_*`, see config.py); the few flags here
override them. uvicorn >= 0.54 with its zttp protocol serves h2c by prior knowledge when TLS
is off. With DDILOCO_TLS_CERT_FILE + DDILOCO_TLS_KEY_FILE (`--tls-cert`, `--tls-key`; both or
neither) the same port serves HTTPS instead, and uvicorn's zttp dispatcher picks HTTP/2 or
HTTP/1.1 per connection from ALPN (h2, http/1.1). DDILOCO_TLS_CLIENT_CA_FILE (`--tls-client-ca`)
also requires a client certificate signed by that CA (mutual TLS). The bearer token is checked
either way; DDILOCO_TOKEN_FILE is re-read when it changes (token rotation, auth.py).

Why uvicorn (bench/RESULTS.md, "Figures behind the code"): with many clients posting large bodies to
an app that only reads them, uvicorn costs less CPU per GB than hypercorn and more than granian, but
the synchronizer's own work per GB is several times any of them, so the server is not what bounds
ingest, and granian would need the TLS/mTLS path redone. HTTP/2 bulk uploads reach under half of
HTTP/1.1 on every server measured (zttp's fixed 64 KiB window), so learners upload over HTTP/1.1
(`LearnerConfig.upload_http2` False) and keep HTTP/2 for heartbeats and downloads. Those uploads go
to `--upload-port` (upload_port.py), a thread per connection reading each body straight into its buffer, at
a fraction of uvicorn's CPU per GB.
"""

from __future__ import annotations

import argparse
import logging
import os
import ssl
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import uvicorn

from ddiloco.cli.errors import RuntimeFailure, usage_errors
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.shards import check_state_dir
from ddiloco.wire import tls
from ddiloco.wire.protocol import BROADCAST_ENCODINGS

log = logging.getLogger(__name__)

SWITCH_INTERVAL_S = 0.001
"""The synchronizer's `sys.setswitchinterval` (Python's default is 0.005; `main` says why)."""


def init_logging(level: str = "INFO") -> None:
    logging.basicConfig(level=level, format="%(asctime)s sync %(levelname)s %(name)s: %(message)s")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="ddiloco synchronizer", description=__doc__.split("\n\n")[0])
    ap.add_argument("--host", help="address to bind (env DDILOCO_HOST)")
    ap.add_argument("--port", type=int, help="TCP port (env DDILOCO_PORT, default 8470)")
    ap.add_argument(
        "--upload-port",
        type=int,
        help="also serve update uploads on this port, HTTP/1.1 read straight into the "
        "update's buffer (env DDILOCO_UPLOAD_PORT; learners learn it at join)",
    )
    ap.add_argument("--state-dir", help="durable state directory (env DDILOCO_STATE_DIR)")
    ap.add_argument(
        "--snapshot-lag",
        type=int,
        help="merges a fragment's file may trail its served version; 0 writes it before "
        "serving (env DDILOCO_SNAPSHOT_LAG, default 8; synchronizer/storage/journal.py)",
    )
    ap.add_argument(
        "--snapshot-every",
        type=int,
        help="merges a fragment's file trails before the background writer writes it "
        "(env DDILOCO_SNAPSHOT_EVERY, default 0: half the lag, at least 1)",
    )
    ap.add_argument(
        "--quorum", type=int, help="K, minimum contributors per merge (env DDILOCO_QUORUM)"
    )
    ap.add_argument("--no-grace", action="store_true", help="merge at the quorum, no grace window")
    ap.add_argument(
        "--merge", choices=["rda", "mean"], help="non-embedding merge rule (env DDILOCO_MERGE)"
    )
    ap.add_argument("--shard", type=int, help="this shard's index, 0..S-1 (env DDILOCO_SHARD)")
    ap.add_argument(
        "--shards", type=int, help="S, the job's synchronizer shards (env DDILOCO_SHARDS)"
    )
    ap.add_argument(
        "--update-encoding",
        action="append",
        choices=["float32", "bfloat16", "int8", "int4"],
        help="an update encoding to accept; repeat for several (env DDILOCO_UPDATE_ENCODINGS, "
        "a comma list; default float32 and bfloat16)",
    )
    ap.add_argument(
        "--broadcast-encoding",
        choices=list(BROADCAST_ENCODINGS),
        help="how merged fragments are served (env DDILOCO_BROADCAST_ENCODING; default bfloat16; "
        "int8-delta / int4-delta: quantized deltas from the copy a learner holds)",
    )
    ap.add_argument(
        "--total-tokens",
        type=int,
        help="the job's budget in merged tokens: finished once merged (env DDILOCO_TOTAL_TOKENS,"
        " default 0: none)",
    )
    ap.add_argument(
        "--init-from",
        help="on a fresh state dir, start from this checkpoint, checkpoint destination or model "
        "directory, a path or URL (env DDILOCO_INIT_FROM; synchronizer/checkpoints.py)",
    )
    ap.add_argument(
        "--checkpoint-dest",
        help="write periodic checkpoints here, a directory or URL (env DDILOCO_CHECKPOINT_DEST)",
    )
    ap.add_argument(
        "--checkpoint-every-versions",
        type=int,
        help="a checkpoint per this many global versions (env DDILOCO_CHECKPOINT_EVERY_VERSIONS)",
    )
    ap.add_argument(
        "--checkpoint-every-seconds",
        type=float,
        help="a checkpoint per this many seconds (env DDILOCO_CHECKPOINT_EVERY_SECONDS)",
    )
    ap.add_argument(
        "--checkpoint-keep", type=int, help="checkpoints kept (env DDILOCO_CHECKPOINT_KEEP, 3)"
    )
    ap.add_argument("--http1", action="store_true", help="serve HTTP/1.1 only (comparison runs)")
    ap.add_argument(
        "--tls-cert", help="PEM server certificate: serve HTTPS (DDILOCO_TLS_CERT_FILE)"
    )
    ap.add_argument("--tls-key", help="PEM key of --tls-cert (env DDILOCO_TLS_KEY_FILE)")
    ap.add_argument(
        "--tls-client-ca",
        help="PEM CA: require client certificates it signed, mutual TLS "
        "(env DDILOCO_TLS_CLIENT_CA_FILE)",
    )
    ap.add_argument("--log-level", default=os.environ.get("DDILOCO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


def tls_factory(
    settings: SyncSettings, *, http1_only: bool = False
) -> Callable[[uvicorn.Config, Callable[[], ssl.SSLContext]], ssl.SSLContext]:
    """uvicorn's `ssl_context_factory`: our context (TLS >= 1.2, ALPN, optional mTLS)."""
    assert settings.tls_cert_file is not None and settings.tls_key_file is not None
    cert, key, client_ca = (
        settings.tls_cert_file,
        settings.tls_key_file,
        settings.tls_client_ca_file,
    )

    def factory(_config: uvicorn.Config, _default: Callable[[], ssl.SSLContext]) -> ssl.SSLContext:
        alpn = ["http/1.1"] if http1_only else tls.ALPN_PROTOCOLS
        return tls.server_context(cert, key, client_ca_file=client_ca, alpn=alpn)

    return factory


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    init_logging(args.log_level)
    overrides = {
        k: v
        for k, v in {
            "host": args.host,
            "port": args.port,
            "upload_port": args.upload_port,
            "state_dir": args.state_dir,
            "snapshot_lag": args.snapshot_lag,
            "snapshot_every": args.snapshot_every,
            "quorum": args.quorum,
            "merge": args.merge,
            "shard": args.shard,
            "shards": args.shards,
            "update_encodings": args.update_encoding,
            "broadcast_encoding": args.broadcast_encoding,
            "total_tokens": args.total_tokens,
            "init_from": args.init_from,
            "checkpoint_dest": args.checkpoint_dest,
            "checkpoint_every_versions": args.checkpoint_every_versions,
            "checkpoint_every_seconds": args.checkpoint_every_seconds,
            "checkpoint_keep": args.checkpoint_keep,
            "grace": False if args.no_grace else None,
            "tls_cert_file": args.tls_cert,
            "tls_key_file": args.tls_key,
            "tls_client_ca_file": args.tls_client_ca,
        }.items()
        if v is not None
    }
    with usage_errors("ddiloco synchronizer"):  # one line, exit 2 (cli/errors.py)
        settings = SyncSettings(**overrides)
        settings.tokens()  # refuse a missing or empty token file now, by name
        from ddiloco.synchronizer.storage.statedir import StateDirBusy, open_state_dir

        try:  # the lock held while `held` is open: for the process's life
            held = open_state_dir(Path(settings.state_dir))  # every file's format checked
        except StateDirBusy as e:  # another synchronizer on it: one line, exit 1
            raise RuntimeFailure(str(e)) from None
        check_state_dir(settings)  # another shard's (or another S's) state dir: one line
        if settings.init_from and not (Path(settings.state_dir) / "layout.json").exists():
            from ddiloco.synchronizer.checkpoints import check_source

            check_source(settings.init_from)  # not there, or not a checkpoint: one line
    import torch

    from ddiloco.synchronizer.app import create_app  # torch: after the settings are checked

    torch.set_num_threads(settings.tuning.op_threads())

    shown = settings.model_dump(exclude={"token"})  # paths only: never a token or a key
    log.info("Starting synchronizer config=%s op_threads=%d", shown, torch.get_num_threads())
    http: dict[str, Any] = {"http": "h11"} if args.http1 else {"http": "zttp", "http2": True}
    if settings.tls:
        http["ssl_context_factory"] = tls_factory(settings, http1_only=args.http1)
    config = uvicorn.Config(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=args.log_level.lower(),
        access_log=False,
        timeout_graceful_shutdown=5,
        **http,
    )
    # Threads hand the GIL over every 1 ms rather than Python's 5: a merge's torch calls
    # each give the GIL up and queue to take it back behind 16 upload threads; at the
    # default a merge's tail was mostly that wait (bench/RESULTS.md, "Figures behind the code").
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    uvicorn.Server(config).run()
    held.close()
    return 0
