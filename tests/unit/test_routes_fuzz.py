"""Hostile control calls against a real synchronizer on loopback: the heartbeat, join and spares
routes, with each kind of credential (the job key, a learner's own, another learner's, a
spare's, a forged one).

    .venv/bin/pytest tests/unit/test_routes_fuzz.py

Bodies are valid calls mutated: a field replaced by any JSON value (integers past 2**64 and
floats at the edge of double included: JSON carries 10**400 and 1e308), fields added or
dropped, lists thousands long, junk bytes. After every call: no 5xx, an answer within
`BOUND_S`, the global fragments byte-identical (nothing here may change them), and
`/v1/status` and `/metrics` still answer 200 (a number kept from a heartbeat must never break
them, for anyone). Bounded: a few hundred calls, seconds on two cores.
"""

from __future__ import annotations

import http.client
import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.wire import codec
from ddiloco.wire.auth import learner_token, spare_token
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
)
from tests.conftest import TOKEN, SyncServer, start_sync_server, stop_sync_server

BOUND_S = 10.0
"""The longest answer allowed: a heartbeat long poll waits at most 5 s by design."""
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])]),
        FragmentSpec(index=1, tensors=[TensorSpec(name="b", shape=[2])]),
    ]
)
POD = "job-a-spare-0-abcde"
FUZZ = settings(
    max_examples=120,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
CREDENTIALS = {
    "job": TOKEN,
    "own": learner_token(TOKEN, "a"),
    "other": learner_token(TOKEN, "b"),
    "spare": spare_token(TOKEN, POD),
    "forged": "learner:a:" + "A" * 43,
}
HEARTBEAT: dict[str, Any] = {
    "learner_id": "a",
    "step": 10,
    "steps": [10, 10],
    "tokens": [100, 100],
    "base_versions": [0, 0],
    "step_seconds": 0.5,
    "compute_seconds": 4.0,
    "uptime_seconds": 5.0,
    "tokens_total": 1000,
    "loss": 2.5,
    "wait_s": 0.0,
    "data_position": 3,
}
JOIN: dict[str, Any] = {"learner_id": "a", "host": "h", "pid": 1, "data_reserve": 1}
SPARE: dict[str, Any] = {"learner_id": "a", "learner_index": 0, "num_learners": 2, "attempt": 1}

EDGE_NUMBERS = st.sampled_from(
    [0, -1, 2**31, 2**53, 2**63, 2**64 + 1, 10**400, 1e308, -1e308, 1.7976931348623157e308, 3599.9]
)
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | EDGE_NUMBERS
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)  # fmt: skip


@st.composite
def mutated(draw: st.DrawFn, valid: dict[str, Any]) -> bytes:
    body = dict(valid)
    for _ in range(draw(st.integers(1, 3))):
        how = draw(st.sampled_from(["replace", "drop", "add", "long_list"]))
        key = draw(st.sampled_from(sorted(valid)))
        if how == "replace":
            body[key] = draw(ANY_JSON)
        elif how == "drop":
            body.pop(key, None)
        elif how == "add":
            body[draw(st.text(min_size=1, max_size=10))] = draw(ANY_JSON)
        else:
            body[key] = [draw(EDGE_NUMBERS)] * draw(st.sampled_from([3, 100, 5000]))
    text = json.dumps(body, allow_nan=False)
    if draw(st.booleans()) and draw(st.booleans()):  # now and then, broken JSON
        cut = draw(st.integers(0, len(text)))
        text = text[:cut] + draw(st.text(max_size=5))
    return text.encode("utf-8", "surrogatepass")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SyncServer]:
    s = start_sync_server(tmp_path_factory.mktemp("fuzz") / "state", quorum=2, grace=False)
    try:
        admin = s.client()
        for lid in ("a", "b"):
            admin.join(JoinRequest(learner_id=lid))
        tensors = {"w": torch.arange(4.0), "b": torch.ones(2)}
        admin.init(codec.encode(tensors, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        admin.close()
        yield s
    finally:
        stop_sync_server(s)


def call(server: SyncServer, method: str, path: str, body: bytes | None, token: str) -> int:
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=BOUND_S)
    t0 = time.monotonic()
    try:
        headers = {"Authorization": f"Bearer {token}", "Content-Type": "application/json"}
        conn.request(method, path, body=body, headers=headers)
        answer = conn.getresponse()
        answer.read()
    finally:
        conn.close()
    assert time.monotonic() - t0 < BOUND_S
    return answer.status


def fragments(server: SyncServer) -> list[bytes]:
    return [bytes(server.sync.fragment(p)[1]) for p in range(len(LAYOUT.fragments))]


def still_whole(server: SyncServer, before: list[bytes]) -> None:
    assert fragments(server) == before
    assert call(server, "GET", "/v1/status", None, TOKEN) == 200
    assert call(server, "GET", "/metrics", None, TOKEN) == 200


def learner_call(server: SyncServer, path: str, body: bytes, who: str) -> None:
    """POST a learner's JSON call as `who`: never a 5xx, refused for a credential that does
    not speak for learner a, and nothing the synchronizer serves changed by it."""
    before = fragments(server)
    status = call(server, "POST", path, body, CREDENTIALS[who])
    assert status < 500
    if who in ("other", "spare", "forged"):
        assert status in (401, 403, 422)
    still_whole(server, before)


@FUZZ
@given(body=mutated(HEARTBEAT), who=st.sampled_from(sorted(CREDENTIALS)))
def test_heartbeats(server: SyncServer, body: bytes, who: str) -> None:
    learner_call(server, "/v1/heartbeat", body, who)


@FUZZ
@given(body=mutated(JOIN), who=st.sampled_from(sorted(CREDENTIALS)))
def test_joins(server: SyncServer, body: bytes, who: str) -> None:
    learner_call(server, "/v1/join", body, who)


@FUZZ
@given(
    body=mutated(SPARE),
    pod=st.sampled_from([POD, "job-a-spare-1-xxxxx", "Not_A_Pod", "a" * 300]),
    method=st.sampled_from(["PUT", "GET"]),
    who=st.sampled_from(sorted(CREDENTIALS)),
)
def test_spares(server: SyncServer, body: bytes, pod: str, method: str, who: str) -> None:
    before = fragments(server)
    entry = server.server.config.app.state.spares.entries.get(pod)  # type: ignore[union-attr]
    slot = entry.assignment.learner_id if entry is not None and entry.assignment else None
    path = f"/v1/spares/{pod}" + ("?wait_s=0" if method == "GET" else "")
    status = call(server, method, path, body if method == "PUT" else None, CREDENTIALS[who])
    assert status < 500
    if method == "PUT" and who != "job":
        assert status in (401, 403, 422)
    # a spare reads its own grant; a learner only the grant that names it (a promoted spare)
    refused = {"other": slot != "b", "own": slot != "a", "forged": True, "spare": pod != POD}
    if method == "GET" and refused.get(who, False):
        assert status in (401, 403, 422)
    still_whole(server, before)


def test_the_status_answers_after_the_fuzz(server: SyncServer, tmp_path: Path) -> None:
    """The learners' books are still whole: a's record answers with finite numbers."""
    status = server.client().status()
    a = next(r for r in status.learners if r.learner_id == "a")
    assert a.incarnation >= 1 and a.step_seconds <= 3600
