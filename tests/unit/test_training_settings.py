"""The training settings a job sets reach the loop and change what it does.

`train()` in this process against a real synchronizer on a loopback port (tests/conftest.py),
a tiny GPT on the default corpus. Each setting is checked by what it changes: gradient
accumulation draws `grad_accum` micro-batches per step from the slot's stream and counts their
tokens, `seq_len` shortens the windows, `precision` bf16 changes the loss the fp32 run
computes (slightly), and the LR a step logs follows the schedule.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.train import train
from tests.conftest import SyncServer

DRAW = re.compile(r"data positions=(\d+):(\d+) rank=0 windows=([\d,]+)")


def run(server: SyncServer, tmp_path: Path, name: str, **kw: Any) -> list[dict[str, Any]]:
    cfg = LearnerConfig(
        sync_url=server.url, token=server.token, learner_id=name, model="tiny", h=4,
        num_fragments=1, batch_size=2, poll_s=0.2, drain_s=2.0, log_every=0,
        log_path=str(tmp_path / f"{name}.jsonl"), seed=3, **kw,
    )  # fmt: skip
    train(cfg)
    return [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]


def steps(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in records if "dt" in r]


def test_accumulation_and_sequence_length_set_what_a_step_trains(
    make_sync_server: Callable[..., SyncServer], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_sync_server(quorum=1, grace=False)
    with caplog.at_level(logging.DEBUG, logger="ddiloco.learner.data"):
        records = run(server, tmp_path, "acc", grad_accum=3, seq_len=16, max_steps=5)
    draws = [(int(m[1]), int(m[2]), m[3]) for m in DRAW.finditer(caplog.text)]
    assert len(draws) == 3 * 5  # three micro-batches per step
    assert [lo for lo, _, _ in draws] == list(range(0, 30, 2))  # each a draw of the stream
    stop = records[-1]
    assert stop["event"] == "stop" and stop["steps"] == 5
    assert stop["tokens"] == 5 * 3 * 2 * 16  # steps x micro-batches x batch x seq_len
    (row,) = server.client().status().learners
    assert row.step > 0 and row.tokens_total == row.step * 3 * 2 * 16  # as the join declared


def test_a_sequence_longer_than_the_model_takes_is_refused(
    make_sync_server: Callable[..., SyncServer], tmp_path: Path
) -> None:
    server = make_sync_server(quorum=1, grace=False)
    with pytest.raises(ValueError, match=r"seq_len 65 must be in \[1, 64\]"):
        run(server, tmp_path, "long", seq_len=65, max_steps=1)


def test_bf16_autocast_changes_the_loss_a_little(
    make_sync_server: Callable[..., SyncServer], tmp_path: Path
) -> None:
    losses = {}
    for precision in ("fp32", "bf16"):
        server = make_sync_server(quorum=1, grace=False)
        records = run(server, tmp_path / precision, "p", precision=precision, max_steps=1)
        losses[precision] = steps(records)[0]["loss"]
    assert losses["fp32"] != losses["bf16"]
    assert losses["bf16"] == pytest.approx(losses["fp32"], rel=0.02)


def test_the_logged_lr_follows_warm_up_then_the_cosine_over_max_steps(
    make_sync_server: Callable[..., SyncServer], tmp_path: Path
) -> None:
    server = make_sync_server(quorum=1, grace=False)
    records = run(
        server, tmp_path, "lr", inner_lr=1e-3, warmup_steps=2, lr_schedule="cosine",
        min_lr_ratio=0.0, max_steps=10,
    )  # fmt: skip
    lrs = [r["lr"] for r in steps(records)]
    # the step k (from 0) ran at warm-up min(1, (k+1)/2) times the cosine of k/10
    want = [
        1e-3 * min(1.0, (k + 1) / 2) * 0.5 * (1 + math.cos(math.pi * k / 10)) for k in range(10)
    ]
    assert lrs == pytest.approx(want)


def test_the_inner_optimizers_settings_reach_adamw(
    make_sync_server: Callable[..., SyncServer], tmp_path: Path
) -> None:
    losses = {}
    for name, kw in {
        "default": {},
        "set": {"beta1": 0.5, "beta2": 0.6, "weight_decay": 0.9},
    }.items():
        server = make_sync_server(quorum=1, grace=False)
        records = run(server, tmp_path / name, "o", inner_lr=1e-2, warmup_steps=1, max_steps=3,
                      **kw)  # fmt: skip
        losses[name] = [r["loss"] for r in steps(records)]
    assert losses["default"][0] == losses["set"][0]  # the same start, the same first batch
    assert losses["default"][2] != losses["set"][2]  # then AdamW's betas and decay differ
