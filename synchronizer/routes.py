"""The synchronizer's HTTP routes: they only translate HTTP.

Each handler authenticates, reads the body within its limit, calls the `Synchronizer` in a
worker thread (its methods take locks and fsync: never on the event loop) and returns the
answer; a refusal is a `SyncError`, which app.py turns into `{"error", "detail"}`.

Bodies are guarded (`BodyGuard`, on every route of the router): a declared Content-Length
over the route's limit is refused with 413 before a byte of the body is read, an undeclared
(chunked) body is refused as soon as it passes the limit, and a body that sends nothing for
`body_timeout_s` is refused with 408. JSON routes take at most `JSON_BODY_LIMIT`; the binary
routes set theirs from the layout (`Synchronizer.body_limit`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable, Coroutine
from typing import Annotated, Any, Final

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.routing import APIRoute
from pydantic import BaseModel
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect
from starlette.types import Message, Receive

from ddiloco.synchronizer.fragment import Busy
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire.auth import Principal, Tokens, authenticate
from ddiloco.wire.errors import Refusal, SyncError
from ddiloco.wire.protocol import (
    API_PREFIX,
    CONTENT_TYPE,
    VERSION_HEADER,
    EvaluationReport,
    EvaluationStatus,
    Heartbeat,
    HeartbeatResponse,
    InitResponse,
    JoinRequest,
    JoinResponse,
    ModelSpec,
    Status,
    UpdateResponse,
)

JSON_BODY_LIMIT: Final = 4 << 20
"""The largest JSON request body (a heartbeat of a few thousand fragments fits many times)."""


class ErrorBody(BaseModel):
    """Every refusal's body."""

    error: str
    """The reason (`errors.Refusal`; `not_found`/`method_not_allowed` for unknown routes)."""
    detail: str
    """Why, and what to do about it."""


class BodyGuard:
    """An ASGI `receive` that enforces a body limit and a per-chunk timeout.

    The limit may be raised by the handler before it reads (`read_body`); the declared
    Content-Length is checked at the first read, before waiting for any byte. The first
    refusal is kept in `refused`, so it wins over whatever the framework makes of it."""

    def __init__(self, receive: Receive, limit: int, timeout_s: float, declared: int | None):
        self.receive = receive
        self.limit = limit
        self.timeout_s = timeout_s
        self.declared = declared
        self.seen = 0
        self.done = False
        self.refused: SyncError | None = None

    def refuse(self, kind: Refusal, detail: str) -> SyncError:
        self.refused = SyncError(kind, detail)
        return self.refused

    async def __call__(self) -> Message:
        if self.done:  # the body is complete: later reads wait for the disconnect, unbounded
            return await self.receive()
        if self.declared is not None and self.declared > self.limit:
            raise self.refuse(
                Refusal.TOO_LARGE,
                f"declared body of {self.declared} bytes is larger than the {self.limit} "
                "bytes this route can need",
            )
        try:
            async with asyncio.timeout(self.timeout_s):  # no task per chunk, as wait_for made
                message = await self.receive()
        except TimeoutError:
            raise self.refuse(
                Refusal.TIMEOUT,
                f"the request body sent nothing for {self.timeout_s:g} s "
                f"({self.seen} bytes arrived)",
            ) from None
        if message["type"] == "http.request":
            self.seen += len(message.get("body", b""))
            if self.seen > self.limit:
                raise self.refuse(
                    Refusal.TOO_LARGE,
                    f"body is larger than the {self.limit} bytes this route can need",
                )
            self.done = not message.get("more_body", False)
        return message


def declared_length(request: Request) -> int | None:
    value = request.headers.get("content-length")
    if value is None or not (value.isascii() and value.isdigit()):
        return None  # none, or malformed (the server's HTTP parser refuses those itself)
    return int(value)


class GuardedRoute(APIRoute):
    """An APIRoute whose handler reads the request body through a `BodyGuard`."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def guarded(request: Request) -> Response:
            sync: Synchronizer = request.app.state.sync
            guard = BodyGuard(
                request.receive,
                JSON_BODY_LIMIT,
                sync.settings.body_timeout_s,
                declared_length(request),
            )
            try:
                return await handler(Request(request.scope, guard))
            except Exception as e:
                # FastAPI turns a failed JSON body read into a 400: say what really happened
                if guard.refused is not None and e is not guard.refused:
                    raise guard.refused from e
                raise

        return guarded


async def read_body(request: Request, limit: int) -> bytes | bytearray:
    """The whole body, refused (413) beyond `limit` bytes or (408) when it stalls.

    With a Content-Length (within the limit) the body is read once into a buffer of that
    size, each chunk copied in where it belongs: no list of chunks joined at the end (a
    second copy of every byte, and a second body-sized allocation). A body that does not
    match its Content-Length is refused (422). Without one (chunked), chunks are joined."""
    guard = request.receive
    if not isinstance(guard, BodyGuard):
        raise TypeError("routes read bodies through GuardedRoute, which guards them")
    guard.limit = limit
    size = guard.declared
    if size is None or size > limit:
        return await request.body()  # the guard refuses an oversized declaration itself
    buf = bytearray(size)
    view, at, more = memoryview(buf), 0, True
    while more:
        message = await guard()
        if message["type"] != "http.request":  # http.disconnect: the client went away
            raise ClientDisconnect()
        chunk: bytes = message.get("body", b"")
        more = message.get("more_body", False)
        if at + len(chunk) > size:
            raise SyncError(Refusal.INVALID, f"body is longer than its Content-Length ({size})")
        view[at : at + len(chunk)] = chunk
        at += len(chunk)
    if at != size:
        raise SyncError(
            Refusal.INVALID, f"body of {at} bytes is shorter than its Content-Length ({size})"
        )
    return buf


def get_sync(request: Request) -> Synchronizer:
    return request.app.state.sync


SyncDep = Annotated[Synchronizer, Depends(get_sync)]


async def require_token(request: Request) -> Principal:
    """Who the request's bearer credential speaks for (auth.py), kept in
    `request.state.principal`; 401 when it is missing or wrong."""
    tokens: Tokens = request.app.state.tokens
    principal = authenticate(request.headers.get("authorization", ""), tokens)
    if principal is None:
        raise SyncError(Refusal.UNAUTHORIZED, "missing or wrong bearer token")
    request.state.principal = principal
    return principal


def get_principal(request: Request) -> Principal:
    return request.state.principal


PrincipalDep = Annotated[Principal, Depends(get_principal)]


def speak_for(principal: Principal, learner_id: str) -> None:
    """403 unless `principal` may act as `learner_id` (auth.Principal.speaks_for)."""
    if not principal.speaks_for(learner_id):
        raise SyncError(
            Refusal.FORBIDDEN,
            f"this credential ({principal}) does not speak for learner {learner_id!r}: "
            "a learner speaks only for itself",
        )


def _binary_body(what: str) -> dict[str, Any]:
    schema = {"type": "string", "format": "binary", "contentMediaType": CONTENT_TYPE}
    return {
        "requestBody": {
            "required": True,
            "description": what,
            "content": {CONTENT_TYPE: {"schema": schema}},
        }
    }


ERRORS: Final[dict[int | str, dict[str, Any]]] = {
    code: {"model": ErrorBody, "description": why}
    for code, why in {
        401: "unauthorized: missing or wrong bearer token",
        403: "forbidden: the credential does not speak for that learner, or may not use "
        "this route (an evaluator's, a spare's)",
        404: "unknown_learner: POST /v1/join first",
        408: "timeout: the body stopped arriving",
        409: "not_initialized, stale or conflict",
        413: "too_large: the body is larger than the route can need",
        415: "unsupported_encoding: an update encoding this synchronizer does not accept",
        421: "wrong_shard: another synchronizer shard owns this fragment",
        422: "invalid: malformed, non-finite, wrong shape or failed validation",
    }.items()
}

public = APIRouter(route_class=GuardedRoute)
v1 = APIRouter(
    prefix=API_PREFIX,
    route_class=GuardedRoute,
    dependencies=[Depends(require_token)],
    responses=ERRORS,
)


@public.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@public.get("/metrics", response_class=Response, responses={200: {"content": {"text/plain": {}}}})
async def prometheus(sync: SyncDep) -> Response:
    """Prometheus text exposition (docs/operations.md "Metrics"); 404 with DDILOCO_METRICS=0."""
    if not sync.metrics.enabled:
        raise HTTPException(404, "metrics are off on this synchronizer (DDILOCO_METRICS=0)")
    body = await asyncio.to_thread(sync.metrics.render)
    return Response(body, media_type="text/plain; version=0.0.4")


@v1.post("/join")
async def join(req: JoinRequest, sync: SyncDep, who: PrincipalDep) -> JoinResponse:
    speak_for(who, req.learner_id)
    return await asyncio.to_thread(sync.join, req)


@v1.put("/init", openapi_extra=_binary_body("safetensors of the initial model, layout metadata"))
async def init(request: Request, sync: SyncDep, who: PrincipalDep) -> InitResponse:
    if not who.trains():  # a spare or an evaluator: readers of the model
        raise SyncError(Refusal.FORBIDDEN, f"{who} may not initialize the job's model")
    return await asyncio.to_thread(sync.init, await read_body(request, sync.body_limit(None)))


@v1.get(
    "/fragments/{p}",
    response_class=Response,
    responses={200: {"content": {CONTENT_TYPE: {}}, "description": "the global fragment"}},
)
async def fragment(p: int, sync: SyncDep, held: Annotated[str | None, Query()] = None) -> Response:
    """The served fragment p; `held`: the token of the copy the learner holds (wire/broadcast.py),
    for a delta from it where the encoding has one."""
    version, body = await asyncio.to_thread(sync.fragment, p, held)
    return Response(body, media_type=CONTENT_TYPE, headers={VERSION_HEADER: str(version)})


@v1.get(
    "/fragments/{p}/float32",
    response_class=Response,
    responses={
        200: {"content": {CONTENT_TYPE: {}}, "description": "Theta of fragment p in float32"},
        503: {"model": ErrorBody, "description": "busy: p's float32 copy is being read already"},
    },
)
async def exact_fragment(p: int, sync: SyncDep, who: PrincipalDep) -> Response:
    """Fragment p's Theta in float32, bit for bit, at the version in the version header
    (`Synchronizer.exact_fragment`): what `ddiloco export --sync-url` writes, whatever the
    broadcast encoding. The job key only: an administrator's read. Learners, spares and
    evaluators train on or measure the broadcast, and each copy this route encodes holds up
    the fragment's update admissions while it is made: a credential every pod holds must not
    be able to keep that going (403). One copy of a fragment at a time; a second meanwhile
    is 503 with Retry-After. Not on the upload port: an occasional read."""
    if who.kind != "job":
        raise SyncError(
            Refusal.FORBIDDEN,
            f"{who} may not read the float32 Theta: the job key only (ddiloco export)",
        )
    try:
        version, body = await asyncio.to_thread(sync.exact_fragment, p)
    except Busy as e:
        raise HTTPException(503, f"{e}: ask again", headers={"Retry-After": "1"}) from None
    return Response(body, media_type=CONTENT_TYPE, headers={VERSION_HEADER: str(version)})


@v1.post(
    "/fragments/{p}/updates",
    openapi_extra=_binary_body("safetensors of the learner's progress on p, UpdateMeta metadata"),
)
async def update(p: int, request: Request, sync: SyncDep, who: PrincipalDep) -> UpdateResponse:
    sync.check_owner(p)  # a misdirected update is refused before its body is read (421)
    if not who.trains():  # before the body: a spare or an evaluator has no slot
        raise SyncError(Refusal.FORBIDDEN, f"{who} has no learner slot to update for")
    body = await read_body(request, sync.body_limit(p))
    return await asyncio.to_thread(sync.submit, body, p, who)


@v1.post("/heartbeat")
async def heartbeat(
    hb: Heartbeat, request: Request, sync: SyncDep, who: PrincipalDep
) -> HeartbeatResponse:
    """Long poll: answer at once if something is new for the learner, else as soon as a
    fragment merges or a round opens, at the latest after `wait_s`."""
    speak_for(who, hb.learner_id)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + hb.wait_s
    changed: asyncio.Event = request.app.state.changed  # taken before polling: no lost wake-up
    resp = await asyncio.to_thread(sync.heartbeat, hb)
    while not Synchronizer.news(hb, resp):  # pure comparison of two answers, no lock
        left = deadline - loop.time()
        if left <= 0:
            break
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(changed.wait(), timeout=left)
        changed = request.app.state.changed
        resp = await asyncio.to_thread(sync.poll, hb.learner_id)
    return resp


@v1.get("/model")
async def model(sync: SyncDep) -> ModelSpec:
    """What the job trains (from the init upload): what `ddiloco export` writes out."""
    return await asyncio.to_thread(sync.model_spec)


@v1.get("/status")
async def status(sync: SyncDep) -> Status:
    return await asyncio.to_thread(sync.status)


@v1.post("/evaluations")
async def evaluation(
    report: EvaluationReport, sync: SyncDep, who: PrincipalDep
) -> EvaluationStatus:
    """An evaluator's held-out loss of the global model (evaluations.py): kept durably as the
    latest, shown in /v1/status and /metrics. Job key or evaluator credential only."""
    versions = sync.versions() if sync.layout is not None else None
    sync.evaluations.check(report, who, versions, sync.settings.shards)
    return await asyncio.to_thread(sync.evaluations.record, report, who)
