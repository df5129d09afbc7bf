"""`ddiloco evaluate` against a real job: a synchronizer process, a learner process training, and
the evaluator process measuring the global model as it merges.

    .venv/bin/pytest tests/e2e/test_evaluate.py

The evaluator's results must reach the synchronizer's GET /v1/status and /metrics and its own
TensorBoard files, with the very loss it logged; a learner's credential is refused (403) and
ends the command with one line, exit 2.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.learner.sync_client import SyncClient, SyncRefused
from ddiloco.local.processes import Child, ddiloco_command, env_with, terminate_all
from ddiloco.wire.auth import evaluator_token, learner_token
from ddiloco.wire.protocol import EvaluationReport

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(300)]

LOGGED = re.compile(r"Evaluated global version (\d+): loss ([0-9.]+) ")


def evaluator(tmp: Path, sync: Any, token: str, name: str, *flags: str) -> Child:
    argv = ddiloco_command("evaluate", "--sync-url", sync.url, "--threads", "1", *flags)
    env = env_with(DDILOCO_TOKEN=token, OMP_NUM_THREADS="1")
    return Child(name, argv, env, tmp / f"{name}.log")


def wait_for(what: Callable[[], Any], timeout_s: float, why: Callable[[], str]) -> Any:
    deadline = time.time() + timeout_s
    while (got := what()) is None:
        assert time.time() < deadline, why()
        time.sleep(0.2)
    return got


def test_evaluations_reach_status_metrics_and_tensorboard(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    from tests.e2e.test_tensorboard import read_scalars

    sync = synchronizer_process(tmp_path, "job-key", "--no-grace")
    learner = learner_process(tmp_path, sync, 0, 1, "--max-steps", "400")
    tb = tmp_path / "tb"
    ev = evaluator(
        tmp_path,
        sync,
        evaluator_token(sync.token, "eval"),
        "eval",
        "--every-versions",
        "4",
        "--every-seconds",
        "1",
        "--poll-seconds",
        "0.2",
        "--eval-batches",
        "2",
        "--tensorboard",
        str(tb),
    )
    intruder = evaluator(
        tmp_path, sync, learner_token(sync.token, "l0"), "intruder", "--once", "--eval-batches", "1"
    )
    try:
        sync.start()
        learner.start()
        ev.start()
        client = sync.client()

        def merged_evaluation() -> Any:
            status = client.status()
            e = status.evaluation
            return status if e is not None and e.global_version > 0 else None

        def logs() -> str:
            return ev.log_path.read_text()[-3000:] + learner.log_path.read_text()[-2000:]

        status = wait_for(merged_evaluation, 200, logs)
        e = status.evaluation
        assert e.evaluator == "eval" and e.tokens > 0
        assert e.global_version <= status.global_version
        assert e.perplexity == pytest.approx(2.718281828459045**e.loss, rel=1e-9)
        # the log says the same loss, at the same version
        logged = {int(v): float(loss) for v, loss in LOGGED.findall(ev.log_path.read_text())}
        assert logged[e.global_version] == pytest.approx(e.loss, abs=1e-4)
        # the gauges
        metrics = client.request("GET", "/metrics")[2].decode()
        gauges = dict(
            line.split(" ", 1) for line in metrics.splitlines() if line.startswith("ddiloco_eval_")
        )
        assert float(gauges["ddiloco_eval_global_version"]) >= e.global_version
        assert 0 < float(gauges["ddiloco_eval_loss"]) < 10
        # a learner's credential reads, but may not post: refused, one line, exit 2
        intruder.start()
        wait_for(lambda: None if intruder.alive() else True, 120, intruder.log_path.read_text)
        text = intruder.log_path.read_text()
        assert intruder.exit_code() == 2, text[-3000:]
        errors = [x for x in text.splitlines() if "error:" in x]
        assert len(errors) == 1 and errors[0].startswith("ddiloco evaluate: error: "), text
        assert "HTTP 403 forbidden" in errors[0] and "Traceback" not in text
        as_learner = SyncClient(sync.url, learner_token(sync.token, "l0"), timeout=10)
        with pytest.raises(SyncRefused) as refused:
            as_learner.evaluation(EvaluationReport(loss=0.1, global_version=0))
        as_learner.close()
        assert refused.value.status == 403
        assert client.status().evaluation.evaluator == "eval"  # still the evaluator's
        ev.proc.terminate()  # SIGTERM: it finishes the measurement in hand, exits 0
        wait_for(lambda: None if ev.alive() else True, 60, logs)
        assert ev.exit_code() == 0, logs()
        client.close()
    finally:
        terminate_all([ev, intruder, learner, sync.child])
    # TensorBoard: every logged evaluation, by version, with its loss
    scalars = read_scalars(tb)
    by_version = {step: value for step, value, _ in scalars["eval/loss"]}
    assert set(logged) <= set(by_version)
    assert all(by_version[v] == pytest.approx(loss, abs=1e-4) for v, loss in logged.items())
    assert e.global_version in by_version
    perplexity = {step: value for step, value, _ in scalars["eval/perplexity"]}
    assert perplexity[e.global_version] == pytest.approx(e.perplexity, rel=1e-5)
