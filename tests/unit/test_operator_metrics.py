"""The operator's metrics (ddiloco.operator.metrics) and the status numbers it derives from a
synchronizer's answer (syncstatus.derived), driven by the real reconcile, pass after pass.

    .venv/bin/pytest tests/unit/test_operator_metrics.py

Each pass feeds the plan's status back into the job, as runtime.py does after writing it,
and hands (status before, status written, observation) to `after_pass`, as runtime.py does.
The endpoint test scrapes a real HTTP server on loopback.
"""

from __future__ import annotations

import urllib.request
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from ddiloco.operator import builders, sync_workload
from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.metrics import MAX_CAUSES, OperatorMetrics
from ddiloco.operator.plan import ClusterView, Observed, PodView, home
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.syncstatus import derived

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
LABELS = {"namespace": "ns", "job": "tiny"}


def make_job(limit: int = 3) -> DecoupledDiLoCoJob:
    return DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "tiny", "namespace": "ns", "uid": "job-1", "generation": 1},
            "spec": {
                "image": "ddiloco:dev",
                "training": {"model": "tiny"},
                "synchronizer": {"tls": {"enabled": False}},
                "learnerGroups": [{"name": "a", "replicas": 2}],
                "failurePolicy": {"maxReplacementsPerSlot": limit, "backoffSeconds": 0},
            },
        }
    )


def learner(job: DecoupledDiLoCoJob, index: int, attempt: int = 0, **kw: Any) -> PodView:
    return PodView(
        name=builders.learner_pod_name(job, "a", index),
        uid=f"a{index}-{attempt}",
        job_uid=job.uid,
        group="a",
        index=index,
        attempt=attempt,
        **{"phase": "Running", "ready": True, **kw},
    )


class Operator:
    """The runtime's bookkeeping around reconcile, without the clusters."""

    def __init__(self, job: DecoupledDiLoCoJob) -> None:
        self.job, self.metrics = job, OperatorMetrics()

    def tick(self, now: datetime, *pods: PodView) -> list[str]:
        sts = sync_workload.build_synchronizer_statefulset(self.job)
        sts["status"] = {"availableReplicas": 1}
        obs = Observed(
            now=now,
            clusters={home(self.job): ClusterView(pods=pods, token="tok")},
            statefulset=sts,
            service=True,
            shards_service=True,
            sync_status={"global_version": 0},
        )
        plan = reconcile(self.job, obs, fresh_token="fresh")
        self.metrics.after_pass(self.job, self.job.status, plan.status, obs, now.timestamp())
        if plan.status is not None:
            self.job = self.job.model_copy(update={"status": plan.status})
        return [e.reason for e in plan.events]

    def value(self, name: str, **labels: str) -> float | None:
        return self.metrics.registry.get_sample_value(name, {**LABELS, **labels})


def test_a_replacement_is_counted_by_cause_and_timed_to_running() -> None:
    op = Operator(make_job())
    op.tick(T0, learner(op.job, 0), learner(op.job, 1))
    op.tick(T0 + timedelta(seconds=1), learner(op.job, 0), learner(op.job, 1))
    failed = learner(op.job, 0, phase="Failed", ready=False, reason="OOMKilled")
    assert "LearnerFailed" in op.tick(T0 + timedelta(seconds=10), failed, learner(op.job, 1))
    assert op.value("ddiloco_operator_replacements_total", cause="OOMKilled") is None
    op.tick(T0 + timedelta(seconds=11), learner(op.job, 1))  # deleted; recreated
    pending = learner(op.job, 0, attempt=1, phase="Pending", ready=False)
    assert "LearnerReplaced" in op.tick(T0 + timedelta(seconds=12), pending, learner(op.job, 1))
    assert op.value("ddiloco_operator_replacements_total", cause="OOMKilled") == 1.0
    assert op.value("ddiloco_operator_replacement_seconds_count") is None  # not Running yet
    running = learner(op.job, 0, attempt=1)
    op.tick(T0 + timedelta(seconds=17), running, learner(op.job, 1))
    op.tick(T0 + timedelta(seconds=18), running, learner(op.job, 1))  # observed once only
    assert op.value("ddiloco_operator_replacement_seconds_count") == 1.0
    assert op.value("ddiloco_operator_replacement_seconds_sum") == pytest.approx(7.0)
    assert op.value("ddiloco_operator_replacements_total", cause="OOMKilled") == 1.0


def test_a_restarted_operator_times_from_the_failure_in_the_status() -> None:
    op = Operator(make_job())
    op.tick(T0, learner(op.job, 0), learner(op.job, 1))
    op.tick(T0 + timedelta(seconds=1), learner(op.job, 0), learner(op.job, 1))
    op.tick(T0 + timedelta(seconds=5), learner(op.job, 0, terminating=True), learner(op.job, 1))
    op.metrics = OperatorMetrics()  # a new process: the failure is only in the status
    op.tick(T0 + timedelta(seconds=20), learner(op.job, 0, attempt=1), learner(op.job, 1))
    assert op.value("ddiloco_operator_replacements_total", cause="Deleted") == 1.0
    assert op.value("ddiloco_operator_replacement_seconds_sum") == pytest.approx(15.0)


def test_a_slot_at_the_limit_starts_no_clock() -> None:
    op = Operator(make_job(limit=0))
    op.tick(T0, learner(op.job, 0), learner(op.job, 1))
    op.tick(T0 + timedelta(seconds=1), learner(op.job, 0), learner(op.job, 1))
    failed = learner(op.job, 0, phase="Failed", ready=False, reason="Evicted")
    op.tick(T0 + timedelta(seconds=2), failed, learner(op.job, 1))
    assert op.metrics._pending["job-1"] == {}
    assert op.value("ddiloco_operator_replacements_total", cause="Evicted") is None


def test_the_degraded_condition_is_one_series_per_job_with_its_reason() -> None:
    op = Operator(make_job(limit=0))
    op.tick(T0, learner(op.job, 0), learner(op.job, 1))
    assert op.value("ddiloco_operator_job_degraded", reason="") == 0.0
    failed = learner(op.job, 0, phase="Failed", ready=False, reason="Evicted")
    op.tick(T0 + timedelta(seconds=2), failed, learner(op.job, 1))  # no replacement left
    assert op.value("ddiloco_operator_job_degraded", reason="ReplacementLimitReached") == 1.0
    assert op.value("ddiloco_operator_job_degraded", reason="") is None  # the old series went
    op.metrics.forget(op.job)
    assert "ddiloco_operator_job_degraded{" not in _scrape_text(op.metrics)


def test_reconciles_are_counted_by_result_and_timed() -> None:
    m = OperatorMetrics()
    with m.reconciling("ns", "tiny"):
        pass
    with pytest.raises(RuntimeError), m.reconciling("ns", "tiny"):
        raise RuntimeError("apiserver down")
    get = m.registry.get_sample_value
    assert get("ddiloco_operator_reconciles_total", {**LABELS, "result": "ok"}) == 1.0
    assert get("ddiloco_operator_reconciles_total", {**LABELS, "result": "error"}) == 1.0
    assert get("ddiloco_operator_reconcile_duration_seconds_count", LABELS) == 2.0


def test_causes_stay_bounded() -> None:
    m = OperatorMetrics()
    assert m.cause("Evicted") == "Evicted"
    assert m.cause(None) == "Unknown"
    assert m.cause("no spaces; allowed") == "Other"
    assert m.cause("X" * 40) == "Other"
    for i in range(MAX_CAUSES * 2):
        m.cause(f"Reason{i}")
    assert m.cause("BrandNew") == "Other"
    assert m.cause("Evicted") == "Evicted"  # the ones seen stay


def test_forget_drops_a_jobs_series() -> None:
    m = OperatorMetrics()
    with m.reconciling("ns", "tiny"):
        pass
    with m.reconciling("ns", "other"):
        pass
    m.replacements.labels("ns", "tiny", "Evicted").inc()
    m.forget(make_job())
    text = _scrape_text(m)
    assert 'job="tiny"' not in text and 'job="other"' in text


def test_the_endpoint_serves_the_operator_series_only() -> None:
    m = OperatorMetrics()
    port = m.serve(0, "127.0.0.1")
    assert port
    try:
        with m.reconciling("ns", "tiny"):
            pass
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
        families = text_string_to_metric_families(text)
        names = {f.name for f in families if not f.name.endswith("_created")}
        assert names == {
            "ddiloco_operator_reconciles",
            "ddiloco_operator_reconcile_duration_seconds",
            "ddiloco_operator_replacements",
            "ddiloco_operator_replacement_seconds",
            "ddiloco_operator_job_degraded",
            "ddiloco_operator_job_eval_loss",
        }
        assert (
            'ddiloco_operator_reconciles_total{job="tiny",namespace="ns",result="ok"} 1.0' in text
        )
        assert m.serve(0) == port  # once per process
    finally:
        m.close()


def test_a_taken_port_leaves_the_operator_running_without_metrics() -> None:
    first = OperatorMetrics()
    port = first.serve(0, "127.0.0.1")
    try:
        assert port is not None
        assert OperatorMetrics().serve(port, "127.0.0.1") is None
    finally:
        first.close()


def _scrape_text(m: OperatorMetrics) -> str:
    from prometheus_client import generate_latest

    return generate_latest(m.registry).decode()


# --------------------------------------------------------------------------- status numbers


def test_merged_work_and_live_learners_from_the_synchronizer_status() -> None:
    answer = {
        "tokens_merged": 300,
        "learners": [
            {"learner_id": "a-0", "alive": True, "tokens_total": 400},
            {"learner_id": "a-1", "alive": False, "tokens_total": 200},
        ],
    }
    assert derived(answer) == {"merged_work_ratio": 0.5, "live_learners": 1}
    assert derived({"tokens_merged": 10, "learners": []}) == {"live_learners": 0}
    assert derived({"tokens_merged": 900, "learners": [{"alive": True, "tokens_total": 300}]}) == {
        "merged_work_ratio": 1.0,
        "live_learners": 1,
    }
    assert derived(None) == {} and derived({"learners": "junk"}) == {}
    assert derived({"tokens_merged": 1, "learners": [{"alive": True, "tokens_total": 3}]})[
        "merged_work_ratio"
    ] == pytest.approx(0.333)


def test_the_job_status_carries_them() -> None:
    job = make_job()
    sts = sync_workload.build_synchronizer_statefulset(job)
    sts["status"] = {"availableReplicas": 1}
    answer = {
        "global_version": 4,
        "tokens_merged": 100,
        "learners": [{"alive": True, "tokens_total": 400}, {"alive": True, "tokens_total": 0}],
    }
    obs = Observed(
        now=T0,
        clusters={home(job): ClusterView(pods=(), token="tok")},
        statefulset=sts,
        service=True,
        shards_service=True,
        sync_status=answer,
    )
    status = reconcile(job, obs, fresh_token="fresh").status
    assert status is not None
    dumped = status.model_dump(by_alias=True, exclude_none=True)
    assert dumped["mergedWorkRatio"] == 0.25 and dumped["liveLearners"] == 2
