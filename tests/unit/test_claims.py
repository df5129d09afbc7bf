"""What a learner may claim, and what it can make the synchronizer keep, is bounded.

    pytest tests/unit/test_claims.py

Every guard here holds on a fresh synchronizer and on one restarted on the same state dir:
tokens per step bounded by what the learner declared at join (kept in the ledger) and by
`max_tokens_per_step`; one implausible step time cannot stretch the grace window; every
number a client sends is finite and in range, and a ledger holding out-of-range numbers
still renders status and metrics; at most `max_learners` records, per-fragment lists no
longer than the layout, retired learners out of status and metrics; the ledger written a
record at a time, in a versioned format; an update's tensors of the dtype its encoding names.
"""

from __future__ import annotations

import json
import math
import random
import sqlite3
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.sync_client import SyncRefused
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.rounds import Rounds, _median_without
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.synchronizer.storage import ledgerdb
from ddiloco.synchronizer.storage.ledgerdb import LedgerDB, LedgerFormatError
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire import codec
from ddiloco.wire.errors import SyncError
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    MAX_COUNT,
    MAX_FRAGMENTS,
    FragmentSpec,
    Heartbeat,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

SyncServer = Any  # tests/conftest.py's, served over h2c on loopback
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[4])]),
        FragmentSpec(index=1, tensors=[TensorSpec(name="v", shape=[4])]),
    ]
)


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


def make(tmp_path: Path, clock: Clock | None = None, **kw: object) -> Synchronizer:
    base: dict[str, object] = {
        "token": "t",
        "state_dir": tmp_path,
        "quorum": 2,
        "grace": False,
        "outer_lr": 1.0,
        "outer_momentum": 0.0,
        "merge_scale": "contributors",
    }
    return Synchronizer(SyncSettings(**(base | kw)), clock=clock or Clock())  # type: ignore[arg-type]


def init(sync: Synchronizer) -> None:
    zeros = {"w": torch.zeros(4), "v": torch.zeros(4)}
    sync.init(codec.encode(zeros, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def update(
    lid: str, value: torch.Tensor, *, steps: int = 10, tokens: int = 100, step: int = 10, **kw: Any
) -> bytes:
    meta = UpdateMeta(
        learner_id=lid, fragment=0, base_version=0, steps=steps, tokens=tokens, learner_step=step
    )
    return codec.encode({"w": value}, meta.to_metadata() | kw)


def beat(lid: str, step_s: float = 1.0, **kw: Any) -> Heartbeat:
    fields: dict[str, Any] = {
        "learner_id": lid,
        "step": 10,
        "steps": [10, 10],
        "tokens": [100, 100],
        "base_versions": [0, 0],
        "step_seconds": step_s,
    }
    return Heartbeat(**(fields | kw))


# ---- tokens per step ---------------------------------------------------------------------


def test_an_inflated_token_claim_is_refused_and_cannot_take_over_a_merge(tmp_path: Path) -> None:
    sync = make(tmp_path)
    for lid in ("a", "b"):
        sync.join(JoinRequest(learner_id=lid))
    init(sync)
    a, b = torch.tensor([0.5, 0.0, 0.0, 0.0]), torch.tensor([0.0, 0.5, 0.0, 0.0])  # orthogonal
    with pytest.raises(SyncError) as e:  # tokens^2 / steps would make b's weight nothing
        sync.submit(update("a", a, steps=10, tokens=10**12))
    assert e.value.status == 422 and "tokens" in str(e.value)
    assert "max_tokens_per_step" in str(e.value)  # a declared nothing: the job-wide bound
    assert sync.submit(update("a", a, step=11)).status == "accepted"
    assert sync.submit(update("b", b)).status == "accepted"
    assert sync.due() == [0]
    sync.merge(0)
    w = sync.fragments[0].state.params["w"]
    assert w[0] > 0.1 and torch.isclose(w[0], w[1])  # both merged, equally weighted


def test_the_declared_tokens_per_step_bound_updates_after_a_restart(tmp_path: Path) -> None:
    sync = make(tmp_path, quorum=1)
    assert sync.join(JoinRequest(learner_id="a", tokens_per_step=10)).incarnation == 1
    init(sync)
    small = torch.full((4,), 0.1)
    with pytest.raises(SyncError) as e:
        sync.submit(update("a", small, steps=10, tokens=101))  # 10.1 per step
    assert e.value.status == 422 and "declared" in str(e.value) and "tokens" in str(e.value)
    assert sync.submit(update("a", small, steps=10, tokens=100)).status == "accepted"
    again = make(tmp_path, quorum=1)  # restarted: the declaration is in the durable ledger
    with pytest.raises(SyncError, match="declared at join"):
        again.submit(update("a", small, steps=10, tokens=101, step=20))
    with pytest.raises(SyncError) as e:  # more than the synchronizer allows: refused at join
        again.join(JoinRequest(learner_id="b", tokens_per_step=(1 << 24) + 1))
    assert e.value.status == 422 and "tokens_per_step" in str(e.value)
    assert "b" not in again.learners
    lower = make(tmp_path, quorum=1, max_tokens_per_step=5)  # the job-wide bound wins
    with pytest.raises(SyncError, match="max_tokens_per_step"):
        lower.submit(update("a", small, steps=10, tokens=60, step=30))


def test_the_learner_declares_its_tokens_per_step_at_join(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(quorum=1, grace=False)
    model = torch.nn.Linear(4, 4, bias=False)
    cfg = LearnerConfig(
        sync_url=server.url, token=server.token, learner_id="l0", h=4, num_fragments=1
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with DecoupledDiLoCo(model, opt, cfg, tokens_per_step=96):
        assert server.sync.learners["l0"].tokens_per_step == 96
        meta = UpdateMeta(
            learner_id="l0", fragment=0, base_version=0, steps=4, tokens=4 * 97, learner_step=9
        )
        with pytest.raises(SyncRefused) as e:
            server.client().upload(meta, {"weight": torch.full((4, 4), 1e-3)})
        assert e.value.status == 422 and "tokens" in e.value.detail


# ---- the grace window --------------------------------------------------------------------


def test_one_implausible_step_time_does_not_stretch_the_grace_window(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, quorum=1, grace=True)
    for lid in ("a", "b", "c"):
        sync.join(JoinRequest(learner_id=lid))
    init(sync)
    sync.heartbeat(beat("a", 1.0))
    sync.heartbeat(beat("b", 1.2))
    sync.heartbeat(beat("c", 3599.0))  # within the protocol's hour, implausible beside a, b
    assert sync.submit(update("a", torch.full((4,), 0.1))).status == "accepted"
    window = sync.rounds.rounds[0].grace
    assert 0.0 < window <= 4.5  # at most one step of a plausible slowest learner
    assert sync.status().xi["step"] <= 4.5
    restarted = make(tmp_path, clock, quorum=1, grace=True)  # history-free: same on a restart
    for lid, s in (("a", 1.0), ("b", 1.2), ("c", 3599.0)):
        restarted.heartbeat(beat(lid, s))
    assert restarted.rounds.xi_step() <= 4.5


@pytest.mark.parametrize("ratio", [2.0, 8.0])
def test_the_grace_step_ratio_setting_bounds_the_step_time(tmp_path: Path, ratio: float) -> None:
    sync = make(tmp_path, Clock(), quorum=1, grace=True, grace_step_ratio=ratio)
    for lid, s in (("a", 1.0), ("b", 1.0), ("c", 3599.0)):
        sync.join(JoinRequest(learner_id=lid))
        sync.heartbeat(beat(lid, s))
    assert sync.rounds.xi_step() == pytest.approx(ratio)  # c counts as `ratio` x the others'


def test_xi_step_bounds_each_learner_by_the_median_of_the_others() -> None:
    clock = Clock()
    rounds: Rounds[str] = Rounds(1, quorum=1, step_ratio=4.0, clock=clock)
    rounds.heard("only", 3000.0)
    assert rounds.xi_step() == 3000.0  # nobody to compare with
    for i in range(5):
        rounds.heard(f"n{i}", 0.5 + 0.1 * i)
    assert rounds.xi_step() == pytest.approx(4.0 * 0.7)  # the others' median: n2's 0.7
    rounds.heard("slow", 1.8)  # a real straggler, 2.4x the others' median: counted as it is
    assert rounds.xi_step() == pytest.approx(4.0 * 0.75)  # "only" still bounded, now by 0.75
    rounds.forget("only")  # gone
    assert rounds.xi_step() == pytest.approx(1.8)
    rng = random.Random(0)
    for _ in range(200):
        values = sorted(rng.uniform(0, 10) for _ in range(rng.randint(2, 9)))
        for i in range(len(values)):
            others = values[:i] + values[i + 1 :]
            assert math.isclose(_median_without(values, i), _statistics_median(others))


def _statistics_median(values: list[float]) -> float:
    s, n = sorted(values), len(values)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# ---- numbers in range --------------------------------------------------------------------


def test_out_of_range_numbers_are_refused_naming_the_field(sync_server: SyncServer) -> None:
    client = sync_server.client()
    client.join(JoinRequest(learner_id="l0"))
    client.init(
        codec.encode(
            {"w": torch.zeros(4), "v": torch.zeros(4)}, {LAYOUT_KEY: LAYOUT.model_dump_json()}
        )
    )
    good = beat("l0").model_dump()
    cases = {
        "compute_seconds": json.dumps(good | {"compute_seconds": 1e308}),
        "uptime_seconds": json.dumps(good | {"uptime_seconds": 1e300}),
        "tokens_total": json.dumps(good | {"tokens_total": 0}).replace(
            '"tokens_total": 0', '"tokens_total": 1' + "0" * 400
        ),
        "step": json.dumps(good | {"step": MAX_COUNT + 1}),
        "steps": json.dumps(good | {"steps": [1] * (MAX_FRAGMENTS + 1)}),
        "tokens": json.dumps(good | {"tokens": [1, 1, 1]}),  # longer than the layout
        "known_requested": json.dumps(good | {"known_requested": [0, 1, 0]}),
    }
    for field, body in cases.items():
        with pytest.raises(SyncRefused) as e:
            client.request("POST", "/v1/heartbeat", body.encode())
        assert e.value.status == 422 and field in e.value.detail, (field, e.value)
    for field, value in (("pid", -1), ("tokens_per_step", MAX_COUNT + 1), ("host", "h" * 300)):
        body = json.dumps({"learner_id": "l0", field: value}).encode()
        with pytest.raises(SyncRefused) as e:
            client.request("POST", "/v1/join", body)
        assert e.value.status == 422 and field in e.value.detail, (field, e.value)
    client.heartbeat(beat("l0", tokens_total=10**15, compute_seconds=5.0, uptime_seconds=9.0))
    status = client.status()
    assert status.learners[0].tokens_total == 10**15 and status.goodput == pytest.approx(5 / 9)
    code, _, _ = client.request("GET", "/metrics")
    assert code == 200


def test_update_counts_are_bounded() -> None:
    base = {"learner_id": "l0", "fragment": "0", "base_version": "0", "steps": "1"}
    base |= {"tokens": "1", "learner_step": "1"}
    for field in ("learner_step", "base_version", "steps", "tokens", "incarnation"):
        with pytest.raises(ValueError, match=field):
            UpdateMeta.from_metadata(base | {field: str(MAX_COUNT + 1)})
    assert UpdateMeta.from_metadata(base | {"learner_step": str(MAX_COUNT)}).learner_step > 0
    with pytest.raises(ValidationError):
        Layout(fragments=[FragmentSpec(index=i, tensors=[]) for i in range(MAX_FRAGMENTS + 1)])


def test_a_ledger_holding_out_of_range_numbers_still_renders(tmp_path: Path) -> None:
    huge = {"compute_seconds": 1e308, "past_compute_seconds": 1e308, "uptime_seconds": 1e308}
    huge |= {"tokens_total": 10**400, "past_tokens_total": 10**400, "step": -5, "loss": None}
    db = LedgerDB(tmp_path / "ledger.db")
    db.save(
        {
            "l0": {"learner_id": "l0", "incarnation": 3, "data_position": 64, **huge},
            "l1": {"learner_id": "l1", "incarnation": "x", "step_seconds": float("nan"), **huge},
        },
        {"bytes_up": 10**400, "merge_scale_sum": float("inf"), "refusals": {"invalid": 10**400}},
    )
    db.close()
    sync = make(tmp_path)
    status = sync.status()  # validates: every number finite and in range
    json.loads(status.model_dump_json())
    assert status.goodput is not None and math.isfinite(status.goodput)
    assert {ls.learner_id for ls in status.learners} == {"l0", "l1"}
    text = sync.metrics.render().decode()
    assert "ddiloco_learner_tokens" in text
    again = sync.join(JoinRequest(learner_id="l0"))
    assert again.incarnation == 4 and again.data_position == 64  # what must survive did
    json.loads(make(tmp_path).status().model_dump_json())  # and after a restart


# ---- per-learner state -------------------------------------------------------------------


def test_learner_records_are_capped_and_only_empty_retired_ones_make_room(tmp_path: Path) -> None:
    clock = Clock()
    settings = {"max_learners": 3, "retire_after_s": 100.0}
    sync = make(tmp_path, clock, **settings)
    sync.join(JoinRequest(learner_id="a"))
    sync.join(JoinRequest(learner_id="b"))
    sync.join(JoinRequest(learner_id="c", data_reserve=8))  # holds a data position
    with pytest.raises(SyncError) as e:
        sync.join(JoinRequest(learner_id="d"))
    assert e.value.status == 409 and "max_learners" in str(e.value)
    clock.now += 10
    assert sync.join(JoinRequest(learner_id="a")).incarnation == 2  # a known id rejoins
    clock.now += 101  # a, b, c retired
    # b, empty and unheard the longest, makes room; d starts above its incarnation (1)
    assert sync.join(JoinRequest(learner_id="d")).incarnation == 2
    assert sorted(sync.learners) == ["a", "c", "d"]
    # then a (empty too): its count lives on as the floor ...
    assert sync.join(JoinRequest(learner_id="e")).incarnation == 3
    with pytest.raises(SyncError):  # c holds a data position, d and e are live: no room
        sync.join(JoinRequest(learner_id="a"))
    clock.now += 101
    # ... so a coming back is never handed an incarnation it had before
    assert sync.join(JoinRequest(learner_id="a")).incarnation > 2
    rows, _ = sync.store.ledger.load()
    assert sorted(r["learner_id"] for r in rows) == sorted(sync.learners)  # dropped: deleted
    restarted = make(tmp_path, clock, **settings)  # the cap and the floor hold after a restart
    with pytest.raises(SyncError, match="max_learners"):
        restarted.join(JoinRequest(learner_id="f"))
    assert restarted.join(JoinRequest(learner_id="c")).data_position == 8  # c survived
    assert restarted.learners.totals["dropped_incarnation"] == 2


def test_retired_learners_leave_status_and_metrics(tmp_path: Path) -> None:
    clock = Clock()
    sync = make(tmp_path, clock, retire_after_s=100.0)
    for i in range(5):
        sync.join(JoinRequest(learner_id=f"x{i}", data_reserve=4))
    init(sync)
    assert len(sync.status().learners) == 5
    clock.now += 101
    sync.heartbeat(beat("x0"))
    assert [ls.learner_id for ls in sync.status().learners] == ["x0"]
    text = sync.metrics.render().decode()
    assert 'learner="x0"' in text and 'learner="x1"' not in text
    assert len(sync.learners) == 5  # their records stay (data positions, incarnations)
    restarted = make(tmp_path, clock, retire_after_s=100.0)
    assert len(restarted.status().learners) == 5  # listed for a while after a restart ...
    clock.now += 101
    assert restarted.status().learners == []  # ... then retired again
    joined = restarted.join(JoinRequest(learner_id="x3"))
    assert joined.data_position == 4 and joined.incarnation == 2


def test_heartbeat_lists_are_no_longer_than_the_layout(tmp_path: Path) -> None:
    sync = make(tmp_path)
    sync.join(JoinRequest(learner_id="a"))
    init(sync)
    for field in ("steps", "tokens", "base_versions", "known_versions", "known_requested"):
        with pytest.raises(SyncError) as e:
            sync.heartbeat(beat("a", **{field: [0, 0, 0]}))
        assert e.value.status == 422 and field in str(e.value)
    sync.heartbeat(beat("a"))
    assert sync.learners["a"].steps == [10, 10]
    with pytest.raises(ValidationError, match="steps"):  # 1.9M entries never reach it
        beat("a", steps=[1] * 1_900_000)


def test_a_join_writes_its_record_not_the_whole_ledger(tmp_path: Path) -> None:
    sync = make(tmp_path, max_learners=2000)
    for i in range(300):
        sync.join(JoinRequest(learner_id=f"x{i}"))
    before = sync.store.ledger.rows_written()
    sync.join(JoinRequest(learner_id="new"))
    sync.join(JoinRequest(learner_id="x7"))
    assert sync.store.ledger.rows_written() - before == 4  # each: its record and the totals
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        assert db.execute("PRAGMA user_version").fetchone()[0] == ledgerdb.FORMAT
        assert db.execute("SELECT count(*) FROM learners").fetchone()[0] == 301
    assert len(StateStore(tmp_path).load_ledger()["learners"]) == 301


def test_a_ledger_of_another_format_is_refused(tmp_path: Path) -> None:
    with sqlite3.connect(tmp_path / "ledger.db") as db:
        db.execute(f"PRAGMA user_version = {ledgerdb.FORMAT + 1}")
    with pytest.raises(LedgerFormatError, match="format"):
        make(tmp_path)


# ---- encodings ---------------------------------------------------------------------------


@pytest.mark.parametrize("accepted", [["float32"], ["float32", "bfloat16"]])
def test_tensors_must_be_of_the_dtype_their_encoding_names(
    tmp_path: Path, accepted: list[str]
) -> None:
    sync = make(tmp_path, quorum=1, update_encodings=accepted)
    sync.join(JoinRequest(learner_id="a"))
    init(sync)
    bf16 = torch.full((4,), 0.1).to(torch.bfloat16)
    with pytest.raises(SyncError) as e:  # bf16 labelled float32
        sync.submit(update("a", bf16, encoding="float32"))
    assert e.value.status == 422 and "BF16" in str(e.value) and "float32" in str(e.value)
    if "bfloat16" in accepted:
        assert sync.submit(update("a", bf16, encoding="bfloat16")).status == "accepted"
        # float32 under a bfloat16 label is wider, not narrower: an outbox's float32 sum of
        # updates queued behind an outage (learner/outbox.py)
        wide = update("a", torch.full((4,), 0.1), encoding="bfloat16", step=15)
        assert sync.submit(wide).status == "accepted"
    else:  # bf16 under its own name: refused as an encoding not accepted
        with pytest.raises(SyncError) as e:
            sync.submit(update("a", bf16, encoding="bfloat16"))
        assert e.value.status == 415
    assert sync.submit(update("a", torch.full((4,), 0.1), step=20)).status == "accepted"
