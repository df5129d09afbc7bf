"""The synchronizer's metrics, scraped over real HTTP/2 from in-process synchronizers.

    pytest tests/unit/test_metrics.py

Two learners' rounds on a real server: each merge observes each per-fragment histogram
once, the accepted bytes are counted by wire encoding, per-learner merged tokens sum to the
tokens merged, and the merged-work ratio counts every incarnation's tokens. With
`metrics=False` (DDILOCO_METRICS=0) /metrics is a 404 and no instrument counts anything.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import pycurl
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.learner.sync_client import SyncClient, SyncRefused
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.metrics import NOOP, encoding_of
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

SyncServer = Any  # tests/conftest.py's
LAYOUT = Layout(
    fragments=[FragmentSpec(index=p, tensors=[TensorSpec(name=f"w{p}", shape=[8])]) for p in (0, 1)]
)
TOKENS = 100


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float:
    return samples(text)[(name, frozenset(labels.items()))]


def scrape(client: SyncClient) -> str:
    status, _, body = client.request("GET", "/metrics")
    assert status == 200
    return body.decode()


def start(client: SyncClient, learners: tuple[str, ...]) -> None:
    for lid in learners:
        client.join(JoinRequest(learner_id=lid))
    init = {f"w{p}": torch.zeros(8) for p in (0, 1)}
    client.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))


def update(lid: str, p: int, base: int, step: int, dtype: torch.dtype = torch.float32) -> bytes:
    meta = UpdateMeta(
        learner_id=lid,
        fragment=p,
        base_version=base,
        steps=10,
        tokens=TOKENS,
        learner_step=step,
        encoding="bfloat16" if dtype == torch.bfloat16 else "float32",
    )
    return codec.encode({f"w{p}": torch.full((8,), 0.1, dtype=dtype)}, meta.to_metadata())


def beat(client: SyncClient, lid: str, tokens: int) -> None:
    client.heartbeat(
        Heartbeat(
            learner_id=lid, step=1, steps=[0, 0], tokens=[0, 0], base_versions=[0, 0],
            step_seconds=0.1, tokens_total=tokens, wait_s=0.0,
        )
    )  # fmt: skip


def wait_versions(client: SyncClient, want: list[int]) -> None:
    deadline = time.time() + 10
    while client.status().fragments and [f.version for f in client.status().fragments] != want:
        assert time.time() < deadline, client.status()
        time.sleep(0.02)


@pytest.fixture
def server(make_sync_server: Callable[..., SyncServer]) -> SyncServer:
    return make_sync_server(quorum=2, grace=False, outer_lr=1.0, outer_momentum=0.0)


@pytest.mark.parametrize("lag", [0, 4])
def test_fragment_file_writes_say_who_wrote_them(
    make_sync_server: Callable[..., SyncServer], lag: int
) -> None:
    """snapshot_lag 0: each merge writes its file before serving it ("merge"); 4: the
    background writer does, after ("background")."""
    server = make_sync_server(quorum=1, grace=False, snapshot_lag=lag)
    c = server.client()
    start(c, ("a",))
    c.post_update(0, update("a", 0, 0, 10))
    wait_versions(c, [1, 0])
    c.post_update(0, update("a", 0, 1, 20))
    wait_versions(c, [2, 0])
    end = time.monotonic() + 10
    while True:
        text = scrape(c)
        by = {w: value(text, "ddiloco_fragment_file_write_seconds_count", by=w) for w in
              ("merge", "background")}  # fmt: skip
        if lag == 0 or by["background"] >= 1 or time.monotonic() > end:
            break
        time.sleep(0.05)
    if lag == 0:
        assert by == {"merge": 2, "background": 0}
    else:
        assert by["merge"] == 0 and 1 <= by["background"] <= 2


def test_each_merge_observes_every_fragment_histogram_once(server: SyncServer) -> None:
    c = server.client()
    start(c, ("a", "b"))
    for lid in ("a", "b"):
        beat(c, lid, 3 * TOKENS)
    # fragment 0: two rounds of two (b's second in bf16); fragment 1: one round of two
    c.post_update(0, update("a", 0, 0, 10))
    c.post_update(0, update("b", 0, 0, 10, torch.bfloat16))
    wait_versions(c, [1, 0])
    c.post_update(0, update("a", 0, 1, 20))
    c.post_update(0, update("b", 0, 1, 20, torch.bfloat16))
    c.post_update(1, update("a", 1, 0, 30))
    c.post_update(1, update("b", 1, 0, 30))
    wait_versions(c, [2, 1])
    text = scrape(c)
    for name in (
        "ddiloco_merge_duration_seconds",
        "ddiloco_round_quorum_seconds",
        "ddiloco_round_publish_seconds",
        "ddiloco_round_served_seconds",
        "ddiloco_round_close_served_seconds",
        "ddiloco_grace_window_seconds",
        "ddiloco_merge_contributors",
    ):
        assert value(text, f"{name}_count", fragment="0") == 2, name
        assert value(text, f"{name}_count", fragment="1") == 1, name
    assert value(text, "ddiloco_merge_contributors_sum", fragment="0") == 4
    # each part of each of the 3 merges observed once, and together they are the merge
    parts = 0.0
    for phase in ("compute", "durable", "encode", "install", "finish"):
        assert value(text, "ddiloco_merge_phase_seconds_count", phase=phase) == 3, phase
        parts += value(text, "ddiloco_merge_phase_seconds_sum", phase=phase)
    whole = sum(value(text, "ddiloco_merge_duration_seconds_sum", fragment=f) for f in "01")
    assert 0 < parts <= whole + 1e-9
    assert 'phase="ran"' not in text and 'phase="queued"' not in text  # the log line's only
    closes = merges = 0.0
    for f in "01":  # close -> served is inside quorum -> served
        close = value(text, "ddiloco_round_close_served_seconds_sum", fragment=f)
        served = value(text, "ddiloco_round_served_seconds_sum", fragment=f)
        assert close <= served + 1e-9
        closes += close
        merges += value(text, "ddiloco_merge_duration_seconds_sum", fragment=f)
    # and holds the merge up to its install (its `finish` lets go of the inputs after)
    finish = value(text, "ddiloco_merge_phase_seconds_sum", phase="finish")
    assert merges - finish <= closes + 1e-9
    assert value(text, "ddiloco_grace_window_seconds_sum", fragment="0") == 0  # grace off
    assert value(text, "ddiloco_update_staleness_count") == 6
    assert value(text, "ddiloco_update_staleness_sum") == 0
    assert value(text, "ddiloco_updates_accepted_total") == 6
    fp32, bf16 = len(update("a", 0, 0, 1)), len(update("a", 0, 0, 1, torch.bfloat16))
    assert fp32 > bf16
    assert value(text, "ddiloco_bytes_received_total", encoding="fp32") == 4 * fp32
    assert value(text, "ddiloco_bytes_received_total", encoding="bf16") == 2 * bf16
    assert value(text, "ddiloco_update_bytes_sum") == value(text, "ddiloco_bytes_up_total")
    # every fragment sees every token: each learner merged 300 tokens over 2 fragments
    for lid in ("a", "b"):
        assert value(text, "ddiloco_learner_tokens_merged_total", learner=lid) == 150
        assert value(text, "ddiloco_learner_tokens", learner=lid) == 3 * TOKENS
    assert value(text, "ddiloco_tokens_merged_total") == 300
    assert value(text, "ddiloco_merged_work_ratio") == pytest.approx(300 / 600)
    assert value(text, "ddiloco_contributions_pending", fragment="1") == 0
    c.fragment(0)
    c.fragment(1)
    text = scrape(c)
    served = value(text, "ddiloco_bytes_served_total", encoding="bf16")  # the default broadcast
    assert served == value(text, "ddiloco_bytes_down_total") > 0


def test_a_slots_tokens_count_over_its_incarnations(server: SyncServer) -> None:
    c = server.client()
    start(c, ("a", "b"))
    beat(c, "a", 500)
    c.join(JoinRequest(learner_id="a"))  # a replacement: its own count starts again at 0
    beat(c, "a", 200)
    text = scrape(c)
    assert value(text, "ddiloco_learner_tokens", learner="a") == 700
    assert c.status().learners[0].tokens_total == 200  # the current incarnation's
    assert c.status().learners[0].tokens_computed == 700
    c.post_update(0, update("a", 0, 0, 10))
    c.post_update(0, update("b", 0, 0, 10))
    wait_versions(c, [1, 0])
    # b reported no tokens, but its merged work counts as computed (its heartbeat lags):
    # 100 merged over a's 700 and b's 50 (its 100 tokens on one of two fragments), never > 1
    assert c.status().merged_work_ratio == pytest.approx(100 / 750)


def test_contributions_pending_while_a_round_waits_for_its_quorum(server: SyncServer) -> None:
    c = server.client()
    start(c, ("a", "b"))
    c.post_update(1, update("a", 1, 0, 10))
    text = scrape(c)
    assert value(text, "ddiloco_contributions_pending", fragment="1") == 1
    assert value(text, "ddiloco_tokens_pending", fragment="1") == TOKENS
    merged = ("ddiloco_merge_duration_seconds_count", frozenset({("fragment", "1")}))
    assert merged not in samples(text)  # no merge of fragment 1 yet, so no observation


def test_metrics_off_answers_404_and_counts_nothing(
    make_sync_server: Callable[..., SyncServer],
) -> None:
    server = make_sync_server(quorum=1, grace=False, metrics=False)
    c = server.client()
    with pytest.raises(SyncRefused) as err:
        c.request("GET", "/metrics")
    assert err.value.status == 404 and err.value.kind == "not_found"
    assert "DDILOCO_METRICS=0" in err.value.detail
    start(c, ("a",))
    c.post_update(0, update("a", 0, 0, 10))
    wait_versions(c, [1, 0])
    c.fragment(0)
    m = server.sync.metrics
    assert not m.enabled
    for instrument in (
        m.merge_duration,
        m.merge_phase,
        m.round_close,
        m.round_quorum,
        m.round_publish,
        m.grace_window,
        m.merge_contributors,
        m.update_staleness,
        m.update_bytes,
        m.updates_accepted,
        m.learner_tokens_merged,
        m.bytes_received,
        m.bytes_served,
    ):
        assert instrument is NOOP
    assert list(m.registry.collect()) == []  # nothing registered, nothing counted
    assert c.status().merges == 1  # the service itself is unchanged
    # what a Prometheus scrape gets: plain HTTP/1.1 without a token, 404
    curl = pycurl.Curl()
    curl.setopt(pycurl.URL, f"{server.url}/metrics")
    curl.setopt(pycurl.WRITEFUNCTION, lambda _: None)
    curl.perform()
    assert curl.getinfo(pycurl.RESPONSE_CODE) == 404
    curl.close()


def test_the_setting_reads_ddiloco_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    assert SyncSettings().metrics is True
    monkeypatch.setenv("DDILOCO_METRICS", "0")
    assert SyncSettings().metrics is False
    monkeypatch.setenv("DDILOCO_METRICS", "perhaps")
    with pytest.raises(ValueError, match="metrics"):
        SyncSettings()


def test_encoding_labels() -> None:
    assert encoding_of(["BF16", "BF16"]) == "bf16"
    assert encoding_of(["F32"]) == "fp32"
    assert encoding_of(["F32", "BF16"]) == "mixed"


def test_a_merge_is_served_from_its_install_not_after_it_lets_go_of_its_inputs(
    tmp_path, monkeypatch
) -> None:
    """A merge whose file is written before serving (snapshot_lag 0) deletes its inputs'
    segments after its install (`finish`): 5 s of it (a disk that stalls) count in the
    merge's duration, not in the time to its being served."""
    from tests.unit.test_contract import Clock, make, start
    from tests.unit.test_contract import update as contract_update

    clock = Clock()
    sync = make(tmp_path, clock, snapshot_lag=0)
    start(sync)
    real = sync.fragments[1].let_go

    def stalled(*args: Any, **kwargs: Any) -> None:
        clock.now += 5.0
        real(*args, **kwargs)

    monkeypatch.setattr(sync.fragments[1], "let_go", stalled)
    sync.submit(contract_update("a", 1, torch.tensor([0.1, 0.0]), step=1))
    assert sync.merge(1) == 1
    m = sync.metrics
    assert m.merge_duration.labels("1")._sum.get() >= 5.0
    for served in (m.round_close, m.round_served, m.round_publish):
        assert served.labels("1")._sum.get() < 1.0
