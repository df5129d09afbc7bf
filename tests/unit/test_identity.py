"""A learner speaks only for itself: two learners on a real synchronizer (both ports, real
sockets), the second holding a valid credential of its own, tries every impersonation, and
the first sees nothing change.

    .venv/bin/pytest tests/unit/test_identity.py
"""

from __future__ import annotations

import http.client
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient, SyncRefused
from ddiloco.wire import codec
from ddiloco.wire.auth import (
    JOB,
    Principal,
    authenticate,
    derived_lines,
    identify,
    learner_token,
    spare_token,
)
from ddiloco.wire.auth import StaticTokens as Static
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
)
from tests.conftest import TOKEN, SyncServer, start_sync_server, stop_sync_server

LAYOUT = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])])])
POD = "job-a-spare-0-abcde"


def test_a_derived_credential_names_its_holder_and_nothing_else() -> None:
    keys = ["new-key", "old-key"]
    assert identify(learner_token("old-key", "a-0"), keys) == Principal("learner", "a-0")
    assert identify(spare_token("new-key", POD), keys) == Principal("spare", POD)
    assert identify("new-key", keys) == JOB
    mac = learner_token("new-key", "a-0").rsplit(":", 1)[1]
    for forged in (
        f"learner:a-1:{mac}",  # another id with a-0's MAC
        f"spare:a-0:{mac}",  # another kind
        learner_token("guessed-key", "a-0"),
        f"learner:a-0:{mac[:-1]}",
        "",
    ):
        assert identify(forged, keys) is None
    assert authenticate(f"Bearer {learner_token('new-key', 'a-0')}", Static("new-key")) == (
        Principal("learner", "a-0")
    )
    assert authenticate(f"Basic {learner_token('new-key', 'a-0')}", Static("new-key")) is None
    # a credential file holds one line per key, newest first (rotation)
    assert derived_lines(keys, "learner", "a-0").splitlines() == [
        learner_token("new-key", "a-0"),
        learner_token("old-key", "a-0"),
    ]
    assert Principal("learner", "a-0").speaks_for("a-0")
    assert not Principal("learner", "a-0").speaks_for("a-1")
    assert not Principal("spare", "a-0").speaks_for("a-0")
    assert JOB.speaks_for("anyone")
    with pytest.raises(ValueError):
        learner_token("k", "a:0")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[SyncServer]:
    s = start_sync_server(tmp_path / "state", quorum=2, grace=False, upload_port=0)
    try:
        yield s
    finally:
        stop_sync_server(s)


def body(lid: str, value: float, *, incarnation: int = 1, step: int = 10) -> bytes:
    """An update's bytes; its metadata written as a hostile client would, unvalidated."""
    meta = {
        "learner_id": lid,
        "fragment": "0",
        "base_version": "0",
        "steps": "10",
        "tokens": "100",
        "learner_step": str(step),
        "incarnation": str(incarnation),
        "encoding": "float32",
    }
    return codec.encode({"w": torch.full((4,), value)}, meta)


def upload_port_post(server: SyncServer, token: str, payload: bytes) -> tuple[int, str]:
    """POST an update to the upload port (upload_port.py) as a learner's client does."""
    conn = http.client.HTTPConnection("127.0.0.1", server.sync.upload_port, timeout=10)
    try:
        conn.request(
            "POST",
            "/v1/fragments/0/updates",
            body=payload,
            headers={"Authorization": f"Bearer {token}", "Content-Type": "x"},
        )
        answer = conn.getresponse()
        return answer.status, json.loads(answer.read()).get("error", "")
    finally:
        conn.close()


def refused(call: Any, *args: Any) -> int:
    with pytest.raises(SyncRefused) as e:
        call(*args)
    return e.value.status


def test_a_learner_with_its_own_credential_cannot_act_for_another(server: SyncServer) -> None:
    victim_token, mallory_token = learner_token(TOKEN, "a"), learner_token(TOKEN, "b")
    victim, mallory = SyncClient(server.url, victim_token), SyncClient(server.url, mallory_token)
    try:
        assert victim.join(JoinRequest(learner_id="a", data_reserve=5)).incarnation == 1
        assert mallory.join(JoinRequest(learner_id="b")).incarnation == 1
        victim.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        sync = server.sync
        version, served = sync.fragment(0)
        before = (version, bytes(served))

        # 1. act as the victim: join, heartbeat, updates (both ports), a far future order
        assert refused(mallory.join, JoinRequest(learner_id="a")) == 403
        beat = Heartbeat(
            learner_id="a", step=1, steps=[1], tokens=[1], base_versions=[0], step_seconds=3599.0
        )
        assert refused(mallory.heartbeat, beat) == 403
        for forged, code in (
            (body("a", 1.0, incarnation=1_000_001), 403),
            (body("a", 1.0, step=2**62), 422),  # past any count a client may send
            (body("a", 1.0), 403),
        ):
            assert refused(mallory.post_update, 0, forged) == code
            assert upload_port_post(server, mallory_token, forged)[0] == code
        # its own id, with an incarnation the synchronizer never issued
        assert refused(mallory.post_update, 0, body("b", 1.0, incarnation=1_000_001)) == 403
        assert upload_port_post(server, mallory_token, body("b", 1.0, incarnation=7)) == (
            403,
            "forbidden",
        )
        # 2. the operator's spares routes
        put = json.dumps(
            {"learner_id": "a", "learner_index": 0, "num_learners": 2, "attempt": 1}
        ).encode()
        assert refused(mallory.request, "PUT", f"/v1/spares/{POD}", put, "application/json") == 403
        assert refused(mallory.request, "GET", f"/v1/spares/{POD}?wait_s=0") == 403

        # nothing changed for the victim: its books, the fragment, and its next update counts
        version, served = sync.fragment(0)
        assert (version, bytes(served)) == before
        record = sync.learners["a"]
        assert (record.incarnation, record.data_position, record.step_seconds) == (1, 5, 0.0)
        assert victim.post_update(0, body("a", 1.0)).status == "accepted"
        assert mallory.post_update(0, body("b", -1.0)).status == "accepted"
        # a re-join is answered the next incarnation, and its updates are not duplicates
        assert victim.join(JoinRequest(learner_id="a")).incarnation == 2
        assert victim.post_update(0, body("a", 1.0, incarnation=2, step=5)).status == "accepted"
    finally:
        victim.close()
        mallory.close()


def test_the_job_key_speaks_for_every_learner(server: SyncServer) -> None:
    admin = server.client()
    try:
        assert admin.join(JoinRequest(learner_id="a")).incarnation == 1
        admin.init(codec.encode({"w": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        assert upload_port_post(server, TOKEN, body("a", 1.0)) == (200, "")
    finally:
        admin.close()


def test_ddiloco_credential_mints_what_the_synchronizer_accepts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ddiloco.cli.main import main

    monkeypatch.delenv("DDILOCO_TOKEN_FILE", raising=False)
    monkeypatch.setenv("DDILOCO_TOKEN", "the-key")
    assert main(["credential", "l0"]) == 0
    assert identify(capsys.readouterr().out.strip(), ["the-key"]) == Principal("learner", "l0")
    keys = tmp_path / "key"
    keys.write_text("new\nold\n")
    assert main(["credential", "--token-file", str(keys), "--spare", POD]) == 0
    lines = capsys.readouterr().out.split()
    assert [identify(x, ["old"]) for x in lines] == [None, Principal("spare", POD)]
    monkeypatch.delenv("DDILOCO_TOKEN")
    with pytest.raises(SystemExit) as e:
        main(["credential", "l0"])
    assert e.value.code == 2 and "no job key" in capsys.readouterr().err


def test_a_granted_credential_gives_way_to_the_file_once_refused(tmp_path: Path) -> None:
    from ddiloco.learner.config import LearnerConfig

    path = tmp_path / "token"
    path.write_text(spare_token("k", POD) + "\n")
    source = LearnerConfig(token=learner_token("k", "a-1"), token_file=str(path)).token_source()
    assert source.current() == learner_token("k", "a-1")  # the grant, while it is accepted
    path.write_text(learner_token("new", "a-1") + "\n" + learner_token("k", "a-1") + "\n")
    assert source.refresh()  # a 401: the file from now on, re-read as it changes
    assert source.current() == learner_token("new", "a-1")
    path.write_text(learner_token("new", "a-1") + "\n")  # the rotation's end
    source.refresh()
    assert source.current() == learner_token("new", "a-1")
