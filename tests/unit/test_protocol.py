"""The wire protocol over a real h2c socket: round trips, and every refusal
the protocol defines (wire/errors.py).

    pytest tests/unit/test_protocol.py

A refused update gets a 4xx that says why, is counted, and is never merged.
"""

from __future__ import annotations

import time

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient, SyncRefused
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

PARAMS = {"emb": torch.arange(12.0).reshape(3, 4), "w": torch.ones(4, 4), "b": torch.zeros(4)}
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, embedding=True, tensors=[TensorSpec(name="emb", shape=[3, 4])]),
        FragmentSpec(
            index=1,
            tensors=[TensorSpec(name="b", shape=[4]), TensorSpec(name="w", shape=[4, 4])],
        ),
    ]
)


def test_safetensors_round_trip_keeps_values_dtypes_and_metadata() -> None:
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16)}
    meta = UpdateMeta(
        learner_id="l0", fragment=2, base_version=5, steps=24, tokens=3072, learner_step=99
    )
    payload = codec.encode(tensors, meta.to_metadata())
    assert UpdateMeta.from_metadata(codec.read_metadata(payload)) == meta
    back = codec.decode(payload)
    assert back["b"].dtype == torch.bfloat16
    assert torch.equal(back["a"], tensors["a"]) and torch.equal(back["b"], tensors["b"])


def test_malformed_bytes_are_refused_by_the_codec() -> None:
    with pytest.raises(codec.PayloadError, match="not safetensors"):
        codec.read_metadata(b"\x05\x00\x00\x00\x00\x00\x00\x00{bad}")
    with pytest.raises(codec.PayloadError):
        codec.decode(b"garbage bytes that are not safetensors")


def join_and_init(client: SyncClient, learner_id: str = "l0") -> None:
    resp = client.join(JoinRequest(learner_id=learner_id, layout_digest=LAYOUT.digest()))
    if not resp.initialized:
        client.init(codec.encode(PARAMS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def update(learner_id: str = "l0", fragment: int = 1, base: int = 0, step: int = 24) -> UpdateMeta:
    return UpdateMeta(
        learner_id=learner_id,
        fragment=fragment,
        base_version=base,
        steps=24,
        tokens=240,
        learner_step=step,
    )


def good_delta(scale: float = 0.1) -> dict[str, torch.Tensor]:
    return {"b": torch.full((4,), scale), "w": torch.full((4, 4), scale)}


def wait_version(client: SyncClient, p: int, version: int, timeout: float = 10.0) -> None:
    deadline = time.time() + timeout
    while client.fragment(p)[0] < version:
        assert time.time() < deadline, f"fragment {p} never reached version {version}"
        time.sleep(0.01)


def test_join_init_fetch_upload_merge(sync_server) -> None:
    c = sync_server.client()
    join_and_init(c)
    version, tensors = c.fragment(0)
    assert version == 0 and torch.equal(tensors["emb"], PARAMS["emb"])
    assert c.upload(update(), good_delta()).status == "accepted"
    wait_version(c, 1, 1)
    _, merged = c.fragment(1)
    # one learner, K=1: outer Nesterov on Delta = -0.1: theta + 0.7*(0.1 + 0.9*0.1)
    want = torch.full((4, 4), 1 + 0.7 * 0.19).to(merged["w"].dtype)  # as the broadcast rounds it
    assert torch.allclose(merged["w"].float(), want.float(), atol=1e-3)
    st = c.status()
    assert st.merges == 1 and st.global_version == 1 and st.tokens_merged == 240 // 2


def test_resending_an_update_is_a_no_op(sync_server) -> None:
    c = sync_server.client()
    join_and_init(c)
    assert c.upload(update(), good_delta()).status == "accepted"
    wait_version(c, 1, 1)
    again = c.upload(update(), good_delta())  # the same update, re-sent after its merge
    assert again.status == "duplicate"
    time.sleep(0.1)
    assert c.status().merges == 1


@pytest.mark.parametrize(
    ("case", "status", "reason"),
    [
        ("nan", 422, "NaN or Inf"),
        ("inf", 422, "NaN or Inf"),
        ("shape", 422, "shape"),
        ("dtype", 422, "dtype"),
        ("missing", 422, "do not match the layout"),
        ("stale", 409, "already merged"),
        ("unknown_base", 409, "unknown base"),
        ("unknown_learner", 404, "has not joined"),
        ("no_metadata", 422, "metadata"),
        ("wrong_fragment", 422, "was sent to"),
        ("not_safetensors", 422, "not safetensors"),
    ],
)
def test_bad_updates_are_refused_with_a_reason_and_never_merged(
    sync_server, case, status, reason
) -> None:
    c = sync_server.client()
    join_and_init(c)
    if case == "stale":
        sync_server.sync.settings.max_staleness = 0  # the strict rule: current base only
    if case in ("stale", "unknown_base"):
        c.upload(update(step=24), good_delta())
        wait_version(c, 1, 1)
    before = c.status()
    meta, delta = update(base=0, step=48), good_delta()  # base 0: current, except after the merge
    if case == "nan":
        delta["w"][0, 0] = float("nan")
    elif case == "inf":
        delta["b"][1] = float("inf")
    elif case == "shape":
        delta["w"] = torch.zeros(4, 5)
    elif case == "dtype":
        delta["w"] = torch.zeros(4, 4, dtype=torch.int32)
    elif case == "missing":
        del delta["b"]
    elif case == "unknown_base":
        meta = update(base=7, step=48)
    elif case == "unknown_learner":
        meta = update(learner_id="stranger", base=0)
    body = codec.encode(delta, meta.to_metadata())
    path = f"/v1/fragments/{meta.fragment}/updates"
    if case == "no_metadata":
        body = codec.encode(delta)
    elif case == "wrong_fragment":
        path = "/v1/fragments/0/updates"
    elif case == "not_safetensors":
        body = b"\x00" * 64
    with pytest.raises(SyncRefused) as err:
        c.request("POST", path, body, "application/vnd.safetensors")
    assert err.value.status == status
    assert reason in err.value.detail
    time.sleep(0.05)
    after = c.status()
    assert after.merges == before.merges  # nothing merged
    assert after.contributions_rejected == before.contributions_rejected + 1
    assert all(f.contributors_pending == 0 for f in after.fragments)


def test_wrong_token_is_refused_everywhere(sync_server) -> None:
    bad = sync_server.client(token="nope")
    for call in (bad.status, lambda: bad.join(JoinRequest(learner_id="x"))):
        with pytest.raises(SyncRefused) as err:
            call()
        assert err.value.status == 401
        assert err.value.kind == "unauthorized"  # the JSON refusal body, parsed
    assert bad.healthy()  # /healthz needs no token (probes)


def test_layout_mismatch_is_refused_at_join(sync_server) -> None:
    c = sync_server.client()
    join_and_init(c)
    with pytest.raises(SyncRefused, match="layout digest"):
        c.join(JoinRequest(learner_id="l1", layout_digest="0" * 16))


def test_heartbeat_long_poll_answers_when_a_round_opens(sync_server) -> None:
    a, b = sync_server.client(), sync_server.client()
    join_and_init(a, "a")
    join_and_init(b, "b")
    hb = Heartbeat(
        learner_id="b",
        step=5,
        steps=[5, 5],
        tokens=[50, 50],
        base_versions=[0, 0],
        step_seconds=0.01,
        known_versions=[0, 0],
        wait_s=0.0,
    )
    assert b.heartbeat(hb).requested == []
    sync_server.sync.settings.grace = True  # keep the round open while b is asked
    import threading

    t0 = time.perf_counter()
    timer = threading.Timer(0.3, lambda: a.upload(update("a"), good_delta()))
    timer.start()
    resp = b.heartbeat(hb.model_copy(update={"wait_s": 3.0}))
    waited = time.perf_counter() - t0
    timer.join()
    assert resp.requested == [1] or resp.versions[1] == 1  # woke on the round or its merge
    assert waited < 2.5


def test_long_poll_never_blocks_the_event_loop(sync_server) -> None:
    """A waiting heartbeat re-polls in a worker thread: while the synchronizer's lock is
    held (as it is around a merge's bookkeeping), the server still answers everyone else."""
    import threading

    join_and_init(sync_server.client(), "a")
    hb = Heartbeat(
        learner_id="a",
        step=1,
        steps=[0, 0],
        tokens=[0, 0],
        base_versions=[0, 0],
        step_seconds=0.01,
        known_versions=[0, 0],
        wait_s=3.0,
    )
    waiting = threading.Thread(target=lambda: sync_server.client().heartbeat(hb))
    waiting.start()
    time.sleep(0.3)  # the long poll now waits for news
    probe = SyncClient(sync_server.url, sync_server.token, timeout=2)
    with sync_server.sync.lock:
        sync_server.sync.on_change()  # wakes it: it polls again, and waits for the lock
        time.sleep(0.2)
        t0 = time.perf_counter()
        answered = probe.healthy()
        elapsed = time.perf_counter() - t0
    waiting.join(timeout=10)
    assert answered and elapsed < 1.0, elapsed


def test_openapi_is_published(sync_server) -> None:
    _, _, body = sync_server.client().request("GET", "/openapi.json")
    import json

    paths = json.loads(body)["paths"]
    for path in (
        "/v1/join",
        "/v1/init",
        "/v1/fragments/{p}",
        "/v1/fragments/{p}/float32",
        "/v1/fragments/{p}/updates",
        "/v1/heartbeat",
        "/v1/status",
        "/healthz",
        "/metrics",
    ):
        assert path in paths, path
