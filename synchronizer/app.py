"""The synchronizer's HTTP API (FastAPI), in full-stack-fastapi-template's shape.

    from ddiloco.synchronizer.app import create_app
    app = create_app(SyncSettings(token="t", state_dir=tmp))   # served by server.py over h2c

Routes only translate HTTP: they authenticate, read the body, hand the work to the
`Synchronizer` in a worker thread (tensor math never runs on the event loop) and turn its
`SyncError`s into 4xx answers that say why. A background task merges due rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from fastapi.responses import JSONResponse

from ddiloco.synchronizer import metrics
from ddiloco.synchronizer.config import SyncSettings, get_settings
from ddiloco.synchronizer.errors import SyncError
from ddiloco.synchronizer.protocol import (
    API_PREFIX,
    CONTENT_TYPE,
    VERSION_HEADER,
    Heartbeat,
    HeartbeatResponse,
    InitResponse,
    JoinRequest,
    JoinResponse,
    Status,
    UpdateResponse,
)
from ddiloco.synchronizer.service import Synchronizer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 8 << 30
MERGE_TICK_S = 0.005


def get_sync(request: Request) -> Synchronizer:
    return request.app.state.sync


SyncDep = Annotated[Synchronizer, Depends(get_sync)]


def require_token(request: Request) -> None:
    expected: str = request.app.state.token
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.encode(), expected.encode()):
        raise HTTPException(
            401, detail="missing or wrong bearer token", headers={"WWW-Authenticate": "Bearer"}
        )


async def read_body(request: Request) -> bytes:
    chunks = bytearray()
    async for chunk in request.stream():
        chunks += chunk
        if len(chunks) > MAX_BODY_BYTES:
            raise HTTPException(413, detail=f"body larger than {MAX_BODY_BYTES} bytes")
    return bytes(chunks)


async def merge_loop(sync: Synchronizer) -> None:
    """Merge every round that is due; merges of distinct fragments may overlap."""
    running: dict[int, asyncio.Task[int | None]] = {}
    while True:
        await asyncio.sleep(MERGE_TICK_S)
        if sync.layout is None:
            continue
        for p in await asyncio.to_thread(sync.due):
            if p not in running:
                running[p] = asyncio.create_task(asyncio.to_thread(sync.merge, p))
        for p, task in list(running.items()):
            if task.done():
                del running[p]
                if task.exception() is not None:
                    log.error("Merge of fragment %d failed: %r", p, task.exception())


def create_app(settings: SyncSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.sync = sync = await asyncio.to_thread(Synchronizer, settings)
        app.state.token = settings.bearer_token()
        loop = asyncio.get_running_loop()
        app.state.changed = asyncio.Event()

        def wake() -> None:  # runs on the loop: wake every waiting long poll, re-arm
            app.state.changed.set()
            app.state.changed = asyncio.Event()

        sync.on_change = lambda: loop.call_soon_threadsafe(wake)
        task = asyncio.create_task(merge_loop(app.state.sync))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    app = FastAPI(title="ddiloco synchronizer", version="1", lifespan=lifespan)

    @app.exception_handler(SyncError)
    async def _sync_error(request: Request, exc: SyncError) -> JSONResponse:
        request.app.state.sync.reject(exc.kind)
        log.warning("Refused %s %s: %s", request.method, request.url.path, exc)
        return JSONResponse({"error": str(exc.kind), "detail": str(exc)}, status_code=exc.status)

    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus(sync: SyncDep) -> Response:
        body = await asyncio.to_thread(metrics.render, sync.status)
        return Response(body, media_type="text/plain; version=0.0.4")

    v1 = [Depends(require_token)]

    @app.post(f"{API_PREFIX}/join", dependencies=v1)
    async def join(req: JoinRequest, sync: SyncDep) -> JoinResponse:
        return await asyncio.to_thread(sync.join, req)

    @app.put(f"{API_PREFIX}/init", dependencies=v1)
    async def init(request: Request, sync: SyncDep) -> InitResponse:
        return await asyncio.to_thread(sync.init, await read_body(request))

    @app.get(f"{API_PREFIX}/fragments/{{p}}", dependencies=v1)
    async def fragment(p: int, sync: SyncDep) -> Response:
        version, body = await asyncio.to_thread(sync.fragment, p)
        return Response(body, media_type=CONTENT_TYPE, headers={VERSION_HEADER: str(version)})

    @app.post(f"{API_PREFIX}/fragments/{{p}}/updates", dependencies=v1)
    async def update(p: int, request: Request, sync: SyncDep) -> UpdateResponse:
        body = await read_body(request)
        return await asyncio.to_thread(sync.submit, body, p)

    @app.post(f"{API_PREFIX}/heartbeat", dependencies=v1)
    async def heartbeat(hb: Heartbeat, request: Request, sync: SyncDep) -> HeartbeatResponse:
        resp = await asyncio.to_thread(sync.heartbeat, hb)
        deadline = asyncio.get_running_loop().time() + hb.wait_s
        while not sync.news(hb, resp):
            left = deadline - asyncio.get_running_loop().time()
            if left <= 0:
                break
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(request.app.state.changed.wait(), timeout=left)
            resp = sync.poll(hb.learner_id)
        return resp

    @app.get(f"{API_PREFIX}/status", dependencies=v1)
    async def status(sync: SyncDep) -> Status:
        return await asyncio.to_thread(sync.status)

    return app
