"""A learner's own metrics, scraped over HTTP while it trains against a real synchronizer.

    pytest tests/unit/test_metrics_learner.py

The wrapper hooks a real optimizer (SGD, a gradient of -1: every weight moves by +1 per
step), serves ddiloco_learner_* on `metrics_port` while in its `with` block and stops
serving on exit. Without a port, or on a rank other than 0, nothing is served and every
instrument is a no-op.
"""

from __future__ import annotations

import time
import urllib.error
import urllib.request
from collections.abc import Callable
from typing import Any

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.group import Group
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.local.processes import free_port

SyncServer = Any  # tests/conftest.py's
TOKENS = 10


@pytest.fixture
def server(make_sync_server: Callable[..., SyncServer]) -> SyncServer:
    return make_sync_server(
        quorum=1, grace=False, outer_lr=1.0, outer_momentum=0.0, max_update_ratio=10.0
    )


def wrapped(server: SyncServer, group: Group | None = None, **kw: Any) -> tuple[Any, ...]:
    model = nn.Linear(4, 4, bias=False)
    with torch.no_grad():
        model.weight.zero_()
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        h=4,
        num_fragments=1,
        update_encoding="float32",
        poll_s=0.2,
        metrics_host="127.0.0.1",
        **kw,
    )
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    return model, opt, DecoupledDiLoCo(model, opt, cfg, tokens_per_step=TOKENS, group=group)


def step(model: nn.Module, opt: torch.optim.Optimizer, diloco: DecoupledDiLoCo) -> None:
    model.weight.grad = torch.full_like(model.weight, -1.0)
    diloco.report_loss(2.5)
    opt.step()


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def get(samples: dict, name: str, **labels: str) -> float:
    return samples[(name, frozenset({"learner": "l0", **labels}.items()))]


def test_a_training_learner_serves_its_metrics(server: SyncServer) -> None:
    port = free_port()
    model, opt, diloco = wrapped(server, metrics_port=port)
    with diloco:
        for _ in range(4):  # the hand-over at step H = 4
            step(model, opt, diloco)
        deadline = time.time() + 10
        while diloco.streamer is not None and diloco.streamer.arrived.empty():
            assert time.time() < deadline, "the merged fragment never arrived"
            time.sleep(0.01)
        step(model, opt, diloco)  # folds the merged copy in
        m = scrape(port)
        assert get(m, "ddiloco_learner_step_duration_seconds_count") == 5
        assert get(m, "ddiloco_learner_step_duration_seconds_sum") > 0
        assert get(m, "ddiloco_learner_tokens_total") == 5 * TOKENS
        assert get(m, "ddiloco_learner_tokens_per_second") > 0
        assert get(m, "ddiloco_learner_loss") == 2.5
        assert get(m, "ddiloco_learner_handovers_total") == 1
        assert get(m, "ddiloco_learner_uploads_total", result="accepted") == 1
        assert get(m, "ddiloco_learner_uploads_total", result="refused") == 0
        assert get(m, "ddiloco_learner_upload_queue_depth") == 0
        assert get(m, "ddiloco_learner_adoption_lag_steps_count") == 1
        assert get(m, "ddiloco_learner_adoption_lag_steps_sum") == 0  # the step it arrived in
        wait = get(m, "ddiloco_learner_sync_wait_seconds_total")
        assert 0 < wait < 1.0  # five hooks on a 4x4 weight: the network is never waited for
        assert diloco.stats()["steps"] == 5
    with pytest.raises(urllib.error.URLError):  # stopped serving on exit
        scrape(port)


def test_no_port_no_server_and_no_op_instruments(server: SyncServer) -> None:
    model, opt, diloco = wrapped(server)
    assert not diloco.metrics.enabled
    with diloco:
        step(model, opt, diloco)
    assert list(diloco.metrics.registry.collect()) == []
    assert diloco.metrics.server is None and diloco.stats()["steps"] == 1


def test_only_rank_0_of_a_group_serves(server: SyncServer) -> None:
    _, _, diloco = wrapped(server, group=Group(rank=1, world=2), metrics_port=free_port())
    assert not diloco.metrics.enabled and diloco.streamer is None


def test_a_port_in_use_is_logged_not_fatal(caplog: pytest.LogCaptureFixture) -> None:
    first, second = LearnerMetrics("a"), LearnerMetrics("b")
    port = free_port()
    first.serve(port, "127.0.0.1")
    try:
        second.serve(port, "127.0.0.1")
        assert second.server is None and "cannot bind" in caplog.text
        assert first.port == port
        m = scrape(port)
        assert (
            "ddiloco_learner_uploads_total",
            frozenset({("learner", "a"), ("result", "error")}),
        ) in m
    finally:
        first.close()


@pytest.mark.parametrize("bad", ["0", "70000", "9400.0", "x"])
def test_a_bad_metrics_port_is_refused_by_name(bad: str) -> None:
    with pytest.raises(ValueError, match="DDILOCO_METRICS_PORT"):
        LearnerConfig.from_env({"DDILOCO_METRICS_PORT": bad})
    assert LearnerConfig.from_env({"DDILOCO_METRICS_PORT": "9400"}).metrics_port == 9400
