"""POST /v1/evaluations (synchronizer/evaluations.py) on a real in-process synchronizer: who
may post (the evaluator credential, auth.py), what is refused, and where the latest one shows
(GET /v1/status, /metrics), also after a restart.

    .venv/bin/pytest tests/unit/test_sync_evaluations.py
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from ddiloco.learner.sync_client import SyncRefused
from ddiloco.wire import codec
from ddiloco.wire.auth import (
    JOB,
    Principal,
    StaticTokens,
    authenticate,
    evaluator_token,
    learner_token,
    spare_token,
)
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    EvaluationReport,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LAYOUT = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w0", shape=[8])])])


def init(server: Any) -> None:
    admin = server.client()
    admin.init(codec.encode({"w0": torch.ones(8)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    admin.close()


def post_raw(server: Any, token: str, body: bytes) -> tuple[int, dict[str, Any]]:
    client = server.client(token)
    try:
        status, _, payload = client.request("POST", "/v1/evaluations", body, "application/json")
        return status, json.loads(payload)
    except SyncRefused as e:
        return e.status, {"error": e.kind, "detail": e.detail}
    finally:
        client.close()


def test_the_evaluator_credential_is_its_own_principal() -> None:
    tokens = StaticTokens("k")
    token = evaluator_token("k", "eval")
    assert token.startswith("evaluator:eval:")
    who = authenticate(f"Bearer {token}", tokens)
    assert who == Principal("evaluator", "eval")
    assert who.evaluates() and not who.trains() and not who.speaks_for("eval")
    assert authenticate(f"Bearer {evaluator_token('other-key', 'eval')}", tokens) is None
    learner = authenticate(f"Bearer {learner_token('k', 'a-0')}", tokens)
    assert learner is not None and learner.trains() and not learner.evaluates()
    assert JOB.evaluates() and JOB.trains()


def test_an_evaluation_shows_in_status_and_metrics(sync_server: Any) -> None:
    init(sync_server)
    ev = sync_server.client(evaluator_token(sync_server.token, "eval"))
    kept = ev.evaluation(EvaluationReport(loss=2.5, global_version=0, tokens=4096))
    assert kept.perplexity == pytest.approx(math.exp(2.5)) and kept.evaluator == "eval"
    status = ev.status()  # an evaluator reads the status
    assert status.evaluation == kept
    assert ev.fragment(0)[0] == 0  # and the global fragments
    body = ev.request("GET", "/metrics")[2].decode()
    assert "ddiloco_eval_loss 2.5" in body
    assert f"ddiloco_eval_perplexity {math.exp(2.5)!r}" in body
    assert "ddiloco_eval_global_version 0.0" in body
    assert "ddiloco_eval_timestamp_seconds" in body
    ev.close()


def test_learner_and_spare_credentials_may_not_post_and_evaluators_may_not_train(
    sync_server: Any,
) -> None:
    init(sync_server)
    good = EvaluationReport(loss=1.0, global_version=0).model_dump_json().encode()
    for token in (learner_token(sync_server.token, "a-0"), spare_token(sync_server.token, "p")):
        status, body = post_raw(sync_server, token, good)
        assert (status, body["error"]) == (403, "forbidden"), body
        assert "evaluator's credential" in body["detail"]
    ev = sync_server.client(evaluator_token(sync_server.token, "eval"))
    for call in (
        lambda: ev.join(JoinRequest(learner_id="eval")),
        lambda: ev.init(
            codec.encode({"w0": torch.ones(8)}, {LAYOUT_KEY: LAYOUT.model_dump_json()})
        ),
        lambda: ev.upload(
            UpdateMeta(
                learner_id="eval", fragment=0, base_version=0, steps=1, tokens=1, learner_step=1
            ),
            {"w0": torch.zeros(8)},
        ),
    ):
        with pytest.raises(SyncRefused) as e:
            call()
        assert e.value.status == 403
    ev.close()
    assert sync_server.client().status().evaluation is None  # nothing refused was kept


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        (b'{"loss": NaN, "global_version": 0}', 422, "loss"),
        (b'{"loss": Infinity, "global_version": 0}', 422, "loss"),
        (b'{"loss": -0.5, "global_version": 0}', 422, "loss"),
        (b'{"loss": 1e6, "global_version": 0}', 422, "loss"),
        (b'{"loss": 1.0, "global_version": -1}', 422, "global_version"),
        (b'{"loss": 1.0, "global_version": 99}', 422, "ahead of"),
        (b'{"loss": 1.0, "global_version": 0, "extra": 1}', 422, "extra"),
        (b'{"loss": 1.0', 422, ""),
        (b'["loss", 1.0]', 422, ""),
    ],
)
def test_bad_reports_get_a_clear_4xx(sync_server: Any, body: bytes, status: int, says: str) -> None:
    init(sync_server)
    got, answer = post_raw(sync_server, sync_server.token, body)
    assert (got, answer["error"]) == (status, "invalid"), answer
    assert says in answer["detail"]
    assert sync_server.client().status().evaluation is None


def test_before_init_there_is_nothing_to_evaluate(sync_server: Any) -> None:
    good = EvaluationReport(loss=1.0, global_version=0).model_dump_json().encode()
    status, body = post_raw(sync_server, evaluator_token(sync_server.token, "e"), good)
    assert (status, body["error"]) == (409, "not_initialized")


def test_the_latest_evaluation_survives_a_restart(tmp_path: Path) -> None:
    from tests.conftest import start_sync_server, stop_sync_server

    state = tmp_path / "state"
    first = start_sync_server(state, quorum=1, grace=False)
    try:
        init(first)
        ev = first.client(evaluator_token(first.token, "eval"))
        ev.evaluation(EvaluationReport(loss=3.0, global_version=0))
        kept = ev.evaluation(EvaluationReport(loss=2.0, global_version=0))
        ev.close()
    finally:
        stop_sync_server(first)
    saved = json.loads((state / "evaluation.json").read_text())
    assert saved["format"] == 1 and saved["evaluation"]["loss"] == 2.0
    second = start_sync_server(state, quorum=1, grace=False)
    try:
        assert second.client().status().evaluation == kept
        body = second.client().request("GET", "/metrics")[2].decode()
        assert "ddiloco_eval_loss 2.0" in body
    finally:
        stop_sync_server(second)


def test_an_evaluation_file_of_another_format_is_refused_by_name(tmp_path: Path) -> None:
    from ddiloco.synchronizer.storage.state import StateStore

    (tmp_path / "evaluation.json").write_text('{"format": 0, "evaluation": {}}')
    with pytest.raises(
        ValueError, match=r"evaluation\.json is state format 0; this synchronizer reads format 1"
    ):
        StateStore(tmp_path).load_evaluation()


def test_a_sharded_jobs_status_carries_the_latest_evaluation_of_any_shard(
    sync_server: Any,
) -> None:
    from ddiloco.wire.job_status import merge_statuses
    from ddiloco.wire.protocol import EvaluationStatus

    init(sync_server)
    base = sync_server.client().status()
    old = EvaluationStatus(loss=3.0, perplexity=math.exp(3.0), global_version=1, time=10.0)
    new = EvaluationStatus(loss=2.0, perplexity=math.exp(2.0), global_version=5, time=20.0)
    shards = [
        base.model_copy(update={"shard": 0, "shards": 2, "evaluation": new}),
        base.model_copy(update={"shard": 1, "shards": 2, "evaluation": old}),
    ]
    assert merge_statuses(shards).evaluation == new
    shards[0] = shards[0].model_copy(update={"evaluation": None})
    assert merge_statuses(shards).evaluation == old
