"""The synchronizer's hot-spare routes (synchronizer/spares.py) on a real server and socket,
called by the operator's client (operator/spares.put_assignment) and the spare's long poll
(learner/spare.py), both as they run in production.

    .venv/bin/pytest tests/unit/test_sync_spares.py
"""

from __future__ import annotations

import threading
import time
import urllib.error
from typing import Any

import pytest

from ddiloco.learner import spare
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.sync_client import SyncRefused
from ddiloco.operator.plan import Assignment
from ddiloco.operator.spares import put_assignment
from ddiloco.wire.auth import learner_token, spare_token
from ddiloco.wire.protocol import JoinRequest

POD = "job-a-spare-0-abcde"
SLOT = {"learner_id": "a-1", "learner_index": 1, "num_learners": 2, "group": "a", "slot": 1}


def put(server: Any, body: dict[str, Any], pod: str = POD, token: str | None = None) -> bool:
    item = Assignment(pod, "uid-1", body)
    return put_assignment(server.url, token or server.token, None, item, timeout=5.0)


def get(server: Any, pod: str = POD, wait_s: float = 0.2) -> tuple[int, bytes]:
    client = server.client()
    try:
        status, _, body = client.request("GET", f"/v1/spares/{pod}?wait_s={wait_s:g}")
        return status, body
    finally:
        client.close()


def test_an_assignment_reaches_a_waiting_spare_at_once(sync_server: Any) -> None:
    got: dict[str, Any] = {}

    def wait() -> None:
        t0 = time.monotonic()
        got["answer"] = get(sync_server, wait_s=20)
        got["took"] = time.monotonic() - t0

    waiter = threading.Thread(target=wait)
    waiter.start()
    time.sleep(0.5)  # the long poll is waiting
    assert put(sync_server, {**SLOT, "attempt": 1}) is False  # not fetched yet
    waiter.join(10)
    status, body = got["answer"]
    assert status == 200 and b'"learner_id":"a-1"' in body
    print(f"long poll answered {got['took'] - 0.5:.3f}s after the PUT")
    assert got["took"] < 15  # woken by the PUT, not by its 20 s timeout
    # idempotent: the same PUT again says the spare has it
    assert put(sync_server, {**SLOT, "attempt": 1}) is True
    assert get(sync_server)[0] == 200  # and a spare asking again gets the same


def test_without_an_assignment_the_long_poll_ends_with_204(sync_server: Any) -> None:
    t0 = time.monotonic()
    status, body = get(sync_server, pod="nobody-spare-7-zzzzz", wait_s=0.3)
    assert (status, body) == (204, b"")
    assert time.monotonic() - t0 >= 0.3


def test_a_delivered_spare_is_not_given_another_slot(sync_server: Any) -> None:
    put(sync_server, SLOT)
    assert get(sync_server)[0] == 200
    with pytest.raises(urllib.error.HTTPError) as e:
        put(sync_server, {**SLOT, "learner_id": "a-0", "learner_index": 0, "slot": 0})
    assert e.value.code == 409
    assert b"already took over a-1" in e.value.read()


@pytest.mark.parametrize(
    ("body", "pod", "why"),
    [
        ({**SLOT, "learner_index": 2}, POD, b"must be below num_learners"),
        ({**SLOT, "extra": 1}, POD, b"extra"),
        ({"learner_id": "a-1"}, POD, b"learner_index"),
        ({**SLOT, "learner_id": "a 1"}, POD, b"learner_id"),
        (SLOT, "Not_A_Pod", b"pod"),
    ],
)
def test_bad_assignments_are_refused_with_422(
    sync_server: Any, body: dict[str, Any], pod: str, why: bytes
) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        put(sync_server, body, pod=pod)
    assert e.value.code == 422
    text = e.value.read()
    assert b'"error":"invalid"' in text and why in text


def test_both_routes_need_the_job_token(sync_server: Any) -> None:
    with pytest.raises(urllib.error.HTTPError) as e:
        put(sync_server, SLOT, token="wrong")
    assert e.value.code == 401
    client = sync_server.client(token="wrong")
    with pytest.raises(SyncRefused) as refused:
        client.request("GET", f"/v1/spares/{POD}?wait_s=0")
    assert refused.value.status == 401
    client.close()
    with pytest.raises(SyncRefused) as refused:
        sync_server.client().request("GET", f"/v1/spares/{POD}?wait_s=31")
    assert refused.value.status == 422  # the wait is bounded


def test_the_spare_side_poll_returns_its_assignment_and_the_slots_credential(
    sync_server: Any,
) -> None:
    cfg = LearnerConfig(sync_url=sync_server.url, token=spare_token(sync_server.token, POD))
    threading.Timer(0.3, lambda: put(sync_server, {**SLOT, "attempt": 2})).start()
    found = spare.poll(cfg, POD, wait_s=5.0)
    assert (found["learner_id"], found["learner_index"], found["attempt"]) == ("a-1", 1, 2)
    assert found["token"] == learner_token(sync_server.token, "a-1")
    # the credential it was handed speaks for its slot and for nothing else
    slot = sync_server.client(token=found["token"])
    try:
        assert slot.join(JoinRequest(learner_id="a-1")).incarnation == 1
        with pytest.raises(SyncRefused) as refused:
            slot.join(JoinRequest(learner_id="a-0"))
        assert refused.value.status == 403
    finally:
        slot.close()


def test_a_spare_reads_only_its_own_assignment(sync_server: Any) -> None:
    put(sync_server, SLOT)
    other = sync_server.client(token=spare_token(sync_server.token, "job-a-spare-1-fghij"))
    mine = sync_server.client(token=spare_token(sync_server.token, POD))
    learner = sync_server.client(token=learner_token(sync_server.token, "a-0"))
    try:
        for client in (other, learner):
            with pytest.raises(SyncRefused) as refused:
                client.request("GET", f"/v1/spares/{POD}?wait_s=0")
            assert refused.value.status == 403
        # nothing was taken by those: not delivered yet, and the spare itself still finds it
        assert put(sync_server, SLOT) is False
        status, _, body = mine.request("GET", f"/v1/spares/{POD}?wait_s=0")
        assert status == 200 and b'"learner_id":"a-1"' in body
        # once promoted, its file holds the slot's credential: that reads this grant alone
        slot = sync_server.client(token=learner_token(sync_server.token, "a-1"))
        assert slot.request("GET", f"/v1/spares/{POD}?wait_s=0")[0] == 200
        slot.close()
    finally:
        for client in (other, mine, learner):
            client.close()


def test_only_the_operator_assigns_spares(sync_server: Any) -> None:
    for token in (
        spare_token(sync_server.token, POD),
        learner_token(sync_server.token, "a-0"),
    ):
        with pytest.raises(urllib.error.HTTPError) as e:
            put(sync_server, SLOT, token=token)
        assert e.value.code == 403
    assert get(sync_server, wait_s=0)[0] == 204  # nothing was assigned


def test_a_spare_cannot_join(sync_server: Any) -> None:
    client = sync_server.client(token=spare_token(sync_server.token, POD))
    try:
        with pytest.raises(SyncRefused) as refused:
            client.join(JoinRequest(learner_id=POD))
        assert refused.value.status == 403
    finally:
        client.close()
