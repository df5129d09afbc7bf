"""The synchronizer's HTTP API (FastAPI), in full-stack-fastapi-template's shape.

    from ddiloco.synchronizer.app import create_app
    app = create_app(SyncSettings(token="t", state_dir=tmp))   # served by server.py over h2c

The routes (routes.py) only translate HTTP; this module builds the app around them: the
lifespan that opens the `Synchronizer`, a background task that merges due rounds, and the
exception handlers that make every refusal a 4xx whose JSON body is
`{"error": <reason>, "detail": <why>}` (wire/errors.py), whatever raised it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from http import HTTPStatus
from typing import Any, Final

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from ddiloco.synchronizer.config import SyncSettings, get_settings
from ddiloco.synchronizer.routes import public, v1
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.synchronizer.spares import SpareBook
from ddiloco.synchronizer.spares import router as spares_router
from ddiloco.synchronizer.upload_port import UploadServer
from ddiloco.wire import tls
from ddiloco.wire.auth import Tokens
from ddiloco.wire.errors import HTTP_STATUS, Refusal, SyncError

log = logging.getLogger(__name__)

MERGE_TICK_S = 0.005
MAX_DETAIL: Final = 2000
"""Characters of a validation error's detail (it never echoes the input)."""
_BY_STATUS: Final = {401: Refusal.UNAUTHORIZED, 408: Refusal.TIMEOUT, 413: Refusal.TOO_LARGE}


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


def refusal(kind: Refusal | str, detail: str, status: int, **headers: str) -> JSONResponse:
    if kind == Refusal.UNAUTHORIZED:
        headers["WWW-Authenticate"] = "Bearer"
    if kind in (Refusal.TOO_LARGE, Refusal.TIMEOUT):
        headers["Connection"] = "close"  # HTTP/1.1: the rest of the body is never read
    return JSONResponse({"error": str(kind), "detail": detail}, status, headers=headers)


async def count(request: Request, kind: Refusal) -> None:
    sync: Synchronizer | None = getattr(request.app.state, "sync", None)
    if sync is not None:
        await asyncio.to_thread(sync.reject, kind)


def describe(errors: Sequence[Any]) -> str:
    """A validation error's text: where and what, never the input (it may be bytes that are
    not UTF-8, or a non-finite number, which no JSON can carry)."""
    parts = []
    for e in errors:
        loc = ".".join(str(x) for x in e.get("loc", ()))
        parts.append(f"{loc}: {e.get('msg', 'invalid')}")
    return "; ".join(parts)[:MAX_DETAIL] or "request failed validation"


def http_name(status: int) -> str:
    """`not_found` for 404, `method_not_allowed` for 405, ..."""
    try:
        return HTTPStatus(status).name.lower()
    except ValueError:
        return "http_error"


def add_handlers(app: FastAPI) -> None:
    @app.exception_handler(SyncError)
    async def _sync_error(request: Request, exc: SyncError) -> JSONResponse:
        await count(request, exc.kind)
        log.warning("Refused %s %s: %s", request.method, request.url.path, exc)
        return refusal(exc.kind, str(exc), exc.status)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        await count(request, Refusal.INVALID)
        detail = describe(exc.errors())
        log.warning("Refused %s %s: %s", request.method, request.url.path, detail)
        return refusal(Refusal.INVALID, detail, HTTP_STATUS[Refusal.INVALID])

    @app.exception_handler(HTTPException)
    async def _http(request: Request, exc: HTTPException) -> JSONResponse:
        # Starlette's 404/405, and FastAPI's 400 for a body it could not parse (an invalid one)
        status = HTTP_STATUS[Refusal.INVALID] if exc.status_code == 400 else exc.status_code
        kind: Refusal | str = _BY_STATUS.get(status) or (
            Refusal.INVALID if status == 422 else http_name(status)
        )
        if isinstance(kind, Refusal):
            await count(request, kind)
        return refusal(kind, str(exc.detail), status, **(exc.headers or {}))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("Failed %s %s: %r", request.method, request.url.path, exc)
        return JSONResponse({"error": "internal", "detail": "see the synchronizer's log"}, 500)


class ProtocolCounter:
    """ASGI middleware: counts HTTP requests by (scheme, HTTP version) into `counts`, which
    /metrics shows as `ddiloco_http_requests_total{scheme="https",version="2"}` (so that
    one can see what learners negotiated: h2c, h2 over TLS by ALPN, or HTTP/1.1)."""

    def __init__(self, app: ASGIApp, counts: Counter[tuple[str, str]]) -> None:
        self.app = app
        self.counts = counts

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            self.counts[(str(scope.get("scheme", "http")), str(scope.get("http_version", "")))] += 1
        await self.app(scope, receive, send)


def upload_server(
    sync: Synchronizer, tokens: Tokens, settings: SyncSettings, protocols: Counter[tuple[str, str]]
) -> UploadServer | None:
    """The upload port's listener (upload_port.py), started; None when `upload_port` is off."""
    if settings.upload_port is None:
        return None
    context = None
    if settings.tls:
        assert settings.tls_cert_file is not None and settings.tls_key_file is not None
        context = tls.server_context(
            settings.tls_cert_file,
            settings.tls_key_file,
            client_ca_file=settings.tls_client_ca_file,
            alpn=["http/1.1"],
        )
    server = UploadServer(sync, tokens, settings, context=context, protocols=protocols)
    sync.upload_port = server.start()
    return server


def create_app(settings: SyncSettings | None = None) -> FastAPI:
    settings = settings or get_settings()

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        app.state.sync = sync = await asyncio.to_thread(Synchronizer, settings)
        sync.metrics.watch_protocols(app.state.protocols)
        app.state.tokens = settings.tokens()
        loop = asyncio.get_running_loop()
        app.state.changed = asyncio.Event()

        def wake() -> None:  # runs on the loop: wake every waiting long poll, re-arm
            app.state.changed.set()
            app.state.changed = asyncio.Event()

        sync.on_change = lambda: loop.call_soon_threadsafe(wake)
        app.state.uploads = uploads = upload_server(
            sync, app.state.tokens, settings, app.state.protocols
        )
        task = asyncio.create_task(merge_loop(app.state.sync))
        try:
            yield
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            if uploads is not None:
                await asyncio.to_thread(uploads.close)  # lets uploads in flight finish
            sync.close()

    app = FastAPI(title="ddiloco synchronizer", version="1", lifespan=lifespan)
    app.state.protocols = Counter()
    app.add_middleware(ProtocolCounter, counts=app.state.protocols)
    add_handlers(app)
    app.include_router(public)
    app.include_router(v1)
    app.state.spares = SpareBook()  # hot spares' assignments, in memory (spares.py)
    app.include_router(spares_router)
    return app
