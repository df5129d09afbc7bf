"""Upload throughput of one large fragment into the synchronizer's HTTP stack, side by side.

    .venv/bin/python bench/http2_upload.py --mb 256 --repeat 3

Starts the real synchronizer app twice on loopback (uvicorn + zttp with HTTP/2; uvicorn
h11), posts the same safetensors-sized body with each client, and prints GB/s and the
ratio to the fastest. Clients: pycurl over h2c (what the learner uses), pycurl over
HTTP/1.1, and httpx over h2 (pure-Python h2), the naive choice we measured against.
The route used drains the body exactly as the update route does, then answers 422 (the
bytes are not a real update), so only transport is measured.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx
import pycurl
import uvicorn

from ddiloco.local.processes import free_port
from ddiloco.synchronizer.app import create_app
from ddiloco.synchronizer.client import SyncClient, SyncRefused
from ddiloco.synchronizer.config import SyncSettings

HTTPX_TIMEOUT_S = 60.0


def serve(http2: bool) -> tuple[str, uvicorn.Server]:
    port = free_port()
    settings = SyncSettings(token="b", state_dir=Path(tempfile.mkdtemp()), port=port)
    kw = {"http": "zttp", "http2": True} if http2 else {"http": "h11"}
    server = uvicorn.Server(
        uvicorn.Config(create_app(settings), host="127.0.0.1", port=port, log_level="error", **kw)
    )
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{port}", server


def pycurl_post(url: str, body: bytes, http2: bool) -> None:
    client = SyncClient(url, "b", http2=http2, timeout=600)
    with contextlib.suppress(SyncRefused):  # the body is not a real update: 422 after draining it
        client.request("POST", "/v1/fragments/0/updates", body, "application/vnd.safetensors")
    client.close()


def httpx_post(url: str, body: bytes) -> None:
    with httpx.Client(http2=True, http1=False, timeout=HTTPX_TIMEOUT_S) as c:
        c.post(url + "/v1/fragments/0/updates", content=body, headers={"Authorization": "Bearer b"})


def main() -> None:
    import logging

    logging.disable(logging.WARNING)  # the 422 refusals of the fake update are expected
    ap = argparse.ArgumentParser()
    ap.add_argument("--mb", type=int, default=256)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    body = b"\x00" * (args.mb << 20)
    h2_url, h2 = serve(http2=True)
    h1_url, h1 = serve(http2=False)
    arms = {
        "pycurl h2c -> uvicorn+zttp": lambda: pycurl_post(h2_url, body, True),
        "pycurl HTTP/1.1 -> uvicorn+h11": lambda: pycurl_post(h1_url, body, False),
        "pycurl HTTP/1.1 -> uvicorn+zttp (same port)": lambda: pycurl_post(h2_url, body, False),
        "httpx h2 (pure Python) -> uvicorn+zttp": lambda: httpx_post(h2_url, body),
    }
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
        print(f"  {name:<42} {results[name]:6.2f} GB/s", flush=True)
    best = max(results.values())
    print(f"{args.mb} MiB body, median of {args.repeat}, pycurl {pycurl.version.split()[0]}")
    for name, gbps in results.items():
        print(f"  {name:<42} {gbps:6.2f} GB/s   {gbps / best:5.2f}x of best")
    h2.should_exit = h1.should_exit = True


if __name__ == "__main__":
    main()
