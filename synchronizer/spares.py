"""Hot spares' assignments: the operator hands a failed slot's identity to a waiting spare.

    PUT /v1/spares/{pod}   (operator)  body SpareAssignment -> {"pod", "delivered", ...}
    GET /v1/spares/{pod}?wait_s=20     (the spare, learner/spare.py) -> 200 SpareAssignment,
                                       or 204 when none arrived within wait_s: poll again

A hot spare pod (operator/spares.py) starts `ddiloco learner` with no slot identity, warms up,
and long-polls GET for its pod name; the operator promotes it by patching its labels, then
PUTs the slot's identity here, which wakes the waiting GET at once. PUT takes the job key
alone (the operator's credential, auth.py). GET takes the spare's own credential
(`spare:<pod>:...`, naming that pod), the credential of the slot the pod was assigned (once
promoted, the operator rewrites the spare's credential file to it), or the job key; it answers
the slot's identity with the slot's learner credential, which the spare speaks with from then
on. Assignments live in memory only (`SpareBook`): a restarted synchronizer has none, and the
operator re-sends an assignment not yet fetched for as long as the promoted pod lives (PUT is
idempotent; the answer's `delivered` says whether the spare has fetched it, so the operator
stops). A second PUT with another identity for a pod that already fetched one is refused
(409): a spare becomes one slot, once.

These routes are part of the operator's control plane, not of the learners' training API:
they are left out of /openapi.json (docs/protocol.md lists them).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Annotated, Final

from fastapi import APIRouter, Depends, Path, Query, Request, Response

from ddiloco.synchronizer.routes import ERRORS, GuardedRoute, PrincipalDep, require_token
from ddiloco.wire.auth import Principal, Tokens, learner_token
from ddiloco.wire.errors import Refusal, SyncError
from ddiloco.wire.protocol import API_PREFIX, SpareAnswer, SpareAssignment, SpareGrant

MAX_WAIT_S: Final = 30.0
DEFAULT_WAIT_S: Final = 20.0
MAX_PODS: Final = 4096
"""Assignments kept; past it the oldest delivered ones are forgotten first."""
POD_NAME: Final = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"  # a DNS-1123 subdomain


@dataclass
class _Entry:
    assignment: SpareAssignment | None = None
    delivered: bool = False
    arrived: asyncio.Event = field(default_factory=asyncio.Event)
    at: float = field(default_factory=time.monotonic)


class SpareBook:
    """Assignments by pod name, in memory, used on the event loop only (no locks needed)."""

    def __init__(self, max_pods: int = MAX_PODS) -> None:
        self.max_pods = max_pods
        self.entries: OrderedDict[str, _Entry] = OrderedDict()

    def _entry(self, pod: str) -> _Entry:
        entry = self.entries.get(pod)
        if entry is None:
            entry = self.entries[pod] = _Entry()
            self._trim()
        return entry

    def _trim(self) -> None:
        while len(self.entries) > self.max_pods:
            victim = next((k for k, e in self.entries.items() if e.delivered), None)
            if victim is None:
                victim = next(iter(self.entries))
            self.entries.pop(victim)

    def put(self, pod: str, assignment: SpareAssignment) -> SpareAnswer:
        entry = self._entry(pod)
        if entry.delivered and entry.assignment != assignment:
            assert entry.assignment is not None
            raise SyncError(
                Refusal.CONFLICT,
                f"spare {pod} already took over {entry.assignment.learner_id} "
                f"(attempt {entry.assignment.attempt}); a spare becomes one slot, once",
            )
        if entry.assignment != assignment:
            entry.assignment, entry.at = assignment, time.monotonic()
        entry.arrived.set()
        return SpareAnswer(pod=pod, delivered=entry.delivered, assignment=assignment)

    async def wait(self, pod: str, wait_s: float) -> SpareAssignment | None:
        entry = self._entry(pod)
        if entry.assignment is None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(entry.arrived.wait(), timeout=wait_s)
        if entry.assignment is None:
            return None
        entry.delivered = True
        return entry.assignment


def get_book(request: Request) -> SpareBook:
    book: SpareBook | None = getattr(request.app.state, "spares", None)
    if book is None:
        book = request.app.state.spares = SpareBook()
    return book


BookDep = Annotated[SpareBook, Depends(get_book)]
PodName = Annotated[str, Path(min_length=1, max_length=253, pattern=POD_NAME)]


# the same body guard, token check and error bodies as every /v1 route
router = APIRouter(
    prefix=API_PREFIX,
    route_class=GuardedRoute,
    dependencies=[Depends(require_token)],
    responses=ERRORS,
    include_in_schema=False,
)


@router.put("/spares/{pod}")
async def assign(
    pod: PodName, body: SpareAssignment, book: BookDep, who: PrincipalDep
) -> SpareAnswer:
    """The operator: hand `pod` (a Ready hot spare, just promoted) its slot."""
    if who.kind != "job":
        raise SyncError(Refusal.FORBIDDEN, f"only the operator assigns spares, not {who}")
    return book.put(pod, body)


@router.get("/spares/{pod}", response_model=None)
async def await_assignment(
    pod: PodName,
    request: Request,
    book: BookDep,
    who: PrincipalDep,
    wait_s: Annotated[float, Query(ge=0.0, le=MAX_WAIT_S)] = DEFAULT_WAIT_S,
) -> SpareGrant | Response:
    """The spare: its assignment as soon as there is one, else 204 after `wait_s`."""
    entry = book.entries.get(pod)
    slot = entry.assignment.learner_id if entry is not None and entry.assignment else ""
    # the slot's own credential reads the grant that names it (a promoted spare's file)
    if who.kind != "job" and who not in (Principal("spare", pod), Principal("learner", slot)):
        raise SyncError(Refusal.FORBIDDEN, f"{who} may read only its own assignment")
    if pod not in book.entries and len(book.entries) >= book.max_pods:
        raise SyncError(Refusal.CONFLICT, f"{book.max_pods} spares are waiting already")
    found = await book.wait(pod, wait_s)
    if found is None:
        return Response(status_code=204)
    tokens: Tokens = request.app.state.tokens
    key = tokens.current()  # the newest job key: the grant outlives a rotation's grace longest
    return SpareGrant(**found.model_dump(), token=learner_token(key, found.learner_id))
