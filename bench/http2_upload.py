"""Upload throughput of one large fragment into the synchronizer's HTTP stack, side by side.

    .venv/bin/python bench/http2_upload.py --mb 256 --repeat 3
    .venv/bin/python bench/http2_upload.py --mb 64 --repeat 3 --no-httpx   # TLS arms included

Starts the real synchronizer app on loopback (uvicorn + zttp with HTTP/2 in cleartext;
uvicorn h11; uvicorn + zttp over TLS, ALPN h2 and http/1.1, as `--tls-cert` serves it),
posts the same safetensors-sized body with each client, and prints GB/s and the ratio to the
fastest. Clients: pycurl over h2c (what the learner uses), pycurl over HTTP/1.1, pycurl over
TLS (h2 and HTTP/1.1 by ALPN, verifying a CA issued by wire/tls.py), and httpx over h2
(pure-Python h2), the naive choice we measured against. TLS costs are printed as ratios to
the same protocol in cleartext on the same run. The route used drains the body exactly as the
update route does, then answers 422 (the bytes are not a real model), so only transport is
measured. `--no-tls` and `--no-httpx` drop those arms.

The body goes to PUT /v1/init: the update route of an uninitialized synchronizer now refuses
a body from its header alone (413, before reading it; service.py `body_limit`), which would
measure the refusal instead of the transfer. The init route reads the whole body through the
same guard (`read_body`), then refuses the bytes (422), and keeps no state.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import pycurl
import uvicorn

from ddiloco.learner.sync_client import ClientTLS, SyncClient, SyncRefused
from ddiloco.local.processes import free_port
from ddiloco.synchronizer.app import create_app
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.server import tls_factory
from ddiloco.wire import tls

HTTPX_TIMEOUT_S = 60.0


def issue(d: Path) -> ClientTLS:
    """A CA and a server certificate for 127.0.0.1 in `d`; the client's files."""
    ca = tls.issue_ca("bench CA", days=1)
    tls.write_pem(ca.cert_pem, d / "ca.crt")
    tls.write_pair(tls.issue_server(ca, ["localhost"], ["127.0.0.1"]), d / "s.crt", d / "s.key")
    return ClientTLS(ca_file=d / "ca.crt")


def serve(http2: bool, tls_dir: Path | None = None) -> tuple[str, uvicorn.Server]:
    port = free_port()
    settings = SyncSettings(
        token="b",
        state_dir=Path(tempfile.mkdtemp()),
        port=port,
        tls_cert_file=tls_dir / "s.crt" if tls_dir else None,
        tls_key_file=tls_dir / "s.key" if tls_dir else None,
    )
    kw: dict[str, Any] = {"http": "zttp", "http2": True} if http2 else {"http": "h11"}
    if tls_dir is not None:  # exactly as `ddiloco synchronizer --tls-cert ... --tls-key ...`
        kw["ssl_context_factory"] = tls_factory(settings, http1_only=not http2)
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error", **kw)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"{'https' if tls_dir else 'http'}://127.0.0.1:{port}", server


def pycurl_post(url: str, body: bytes, http2: bool, files: ClientTLS | None = None) -> None:
    client = SyncClient(url, "b", http2=http2, timeout=600, tls=files)
    try:
        client.request("PUT", "/v1/init", body, "application/vnd.safetensors")
    except SyncRefused as e:  # the body is not a real model: 422 once all of it arrived
        if e.status != 422:
            raise
    else:
        raise AssertionError("the bench body was accepted as a model")
    client.close()


def httpx_post(url: str, body: bytes) -> None:
    with httpx.Client(http2=True, http1=False, timeout=HTTPX_TIMEOUT_S) as c:
        c.put(url + "/v1/init", content=body, headers={"Authorization": "Bearer b"})


H2C = "pycurl h2c -> uvicorn+zttp"
H1_ZTTP = "pycurl HTTP/1.1 -> uvicorn+zttp (same port)"
H2_TLS = "pycurl h2 TLS (ALPN) -> uvicorn+zttp"
H1_TLS = "pycurl HTTP/1.1 TLS (ALPN) -> uvicorn+zttp"


def main() -> None:
    import logging

    logging.disable(logging.WARNING)  # the 422 refusals of the fake update are expected
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--no-tls", action="store_true", help="skip the TLS arms")
    ap.add_argument("--no-httpx", action="store_true", help="skip the httpx arm (it can stall)")
    args = ap.parse_args()
    body = b"\x00" * (args.mb << 20)
    h2_url, h2 = serve(http2=True)
    h1_url, h1 = serve(http2=False)
    servers = [h2, h1]
    arms = {
        H2C: lambda: pycurl_post(h2_url, body, True),
        "pycurl HTTP/1.1 -> uvicorn+h11": lambda: pycurl_post(h1_url, body, False),
        H1_ZTTP: lambda: pycurl_post(h2_url, body, False),
    }
    if not args.no_tls:
        tls_dir = Path(tempfile.mkdtemp())
        files = issue(tls_dir)
        tls_url, tls_server = serve(http2=True, tls_dir=tls_dir)
        servers.append(tls_server)
        arms[H2_TLS] = lambda: pycurl_post(tls_url, body, True, files)
        arms[H1_TLS] = lambda: pycurl_post(tls_url, body, False, files)
    if not args.no_httpx:
        arms["httpx h2 (pure Python) -> uvicorn+zttp"] = lambda: httpx_post(h2_url, body)
    results = {}
    for name, fn in arms.items():
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            try:
                fn()
            except httpx.TimeoutException:  # httpx's h2 against zttp's 64 KiB windows can stall
                times.append(float("inf"))
                break
            times.append(time.perf_counter() - t0)
        results[name] = len(body) / statistics.median(times) / 1e9
        print(f"  {name:<44} {results[name]:6.2f} GB/s", flush=True)
    best = max(results.values())
    print(f"{args.mb} MiB body, median of {args.repeat}, pycurl {pycurl.version.split()[0]}")
    for name, gbps in results.items():
        print(f"  {name:<44} {gbps:6.2f} GB/s   {gbps / best:5.2f}x of best")
    if H2_TLS in results:
        print("TLS against cleartext, same server code and port handling:")
        print(f"  h2 over TLS / h2c                    {results[H2_TLS] / results[H2C]:5.2f}x")
        print(f"  HTTP/1.1 over TLS / HTTP/1.1 (zttp)  {results[H1_TLS] / results[H1_ZTTP]:5.2f}x")
        print(f"  HTTP/1.1 over TLS / h2c              {results[H1_TLS] / results[H2C]:5.2f}x")
    for server in servers:
        server.should_exit = True


if __name__ == "__main__":
    main()
