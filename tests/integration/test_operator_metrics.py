"""The operator's /metrics, `kubectl get ddj` columns and replacement events on a real control
plane: a job, one learner pod failed as a kubelet fails it, then a scrape of the real operator.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_metrics.py

Pods never run (kwok fakes them). The synchronizer's status endpoint is a stub here that
answers as a synchronizer with two live learners and half their tokens merged, so the Merged
and Live columns have something to show.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import chart_helpers as charts
import k8senv
import operator_helpers as h
import pytest
from operator_helpers import cl_fixture, crd_fixture  # noqa: F401  (fixtures)
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.integration
SYNC_STATUS = {
    "global_version": 7,
    "merges": 7,
    "tokens_merged": 3000,
    "goodput": 0.45,
    "learners": [
        {"learner_id": "a-0", "alive": True, "tokens_total": 4000},
        {"learner_id": "a-1", "alive": True, "tokens_total": 2000},
    ],
}


class _Status(BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        ok = self.path.endswith("/v1/status") and self.headers.get("Authorization", "").startswith(
            "Bearer "
        )
        body = json.dumps(SYNC_STATUS).encode() if ok else b""
        self.send_response(200 if ok else 401)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(name="operator")
def operator_fixture(k8s: Any, cl: h.Clusters, tmp_path: Path) -> Iterator[h.Operator]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}/{{namespace}}/{{name}}"
    op = h.Operator(
        k8s.home.kubeconfig, cl.ns, tmp_path, env={"DDILOCO_OPERATOR_STATUS_URL_TEMPLATE": url}
    )
    op.start()
    try:
        yield op
        h.delete_jobs(cl, op)
    finally:
        op.stop()
        server.shutdown()
        server.server_close()


def samples(text: str, name: str, **labels: str) -> list[float]:
    """Values of the samples called `name` whose labels include `labels`."""
    return [
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == name and labels.items() <= s.labels.items()
    ]


def test_replacement_is_counted_timed_and_described(cl: h.Clusters, operator: h.Operator) -> None:
    job = h.create_job(cl, h.job_manifest("mx", [{"name": "a", "replicas": 2}]))
    ours = {"namespace": cl.ns, "job": job}
    h.wait_condition(cl, job, "Ready", timeout=60)

    # kubectl get ddj: the merged-work ratio and the live learners, from the synchronizer
    k8senv.wait_until("liveLearners", lambda: cl.job(job)["status"].get("liveLearners"), 20)
    table = cl.kubectl("get", "ddj", job).stdout.splitlines()
    header = table[0].replace("EVAL LOSS", "EVAL_LOSS")  # one column, of the same width
    names = header.split()
    assert names[-6:] == ["MERGED", "LIVE", "PROGRESS", "REMAINING", "EVAL_LOSS", "AGE"], table
    # columns by their header's offsets: a job without a token budget leaves two empty, one
    # without an evaluator a third
    starts = [header.index(f"{n} ") if n != "AGE" else header.rindex(n) for n in names]
    cell = {
        n: table[1][a:b].strip() for n, a, b in zip(names, starts, [*starts[1:], None], strict=True)
    }
    assert cell["MERGED"] == "0.5" and cell["LIVE"] == "2", table
    assert cell["PROGRESS"] == "" and cell["REMAINING"] == "" and cell["EVAL_LOSS"] == "", table

    before = operator.scrape()
    ok_before = sum(samples(before, "ddiloco_operator_reconciles_total", result="ok", **ours))
    assert ok_before > 0, before
    assert samples(before, "ddiloco_operator_replacements_total", **ours) == []

    uids = h.running_uids(cl, ["home"], job)
    pod = h.slot_pod(cl, "home", job, "a-0")
    cl.core().patch_namespaced_pod_status(  # what a kubelet writes when it evicts a pod
        pod,
        cl.ns,
        {
            "status": {
                "phase": "Failed",
                "reason": "Evicted",
                "message": "The node had memory pressure",
            }
        },
    )
    k8senv.wait_until(
        "a-0 replaced and Running",
        lambda: (
            (u := h.running_uids(cl, ["home"], job)).get("a-0", uids["a-0"]) != uids["a-0"]
            and len(u) == 2
        ),
        20,
    )

    def replaced() -> str | None:
        text = operator.scrape()
        done = samples(text, "ddiloco_operator_replacement_seconds_count", **ours) == [1.0]
        return text if done else None

    text = k8senv.wait_until("the replacement's time observed", replaced, 20)
    assert samples(text, "ddiloco_operator_replacements_total", cause="Evicted", **ours) == [1.0]
    assert len(samples(text, "ddiloco_operator_replacements_total", **ours)) == 1  # one cause
    took = samples(text, "ddiloco_operator_replacement_seconds_sum", **ours)[0]
    assert 0.0 < took < 20.0, took
    assert sum(samples(text, "ddiloco_operator_reconciles_total", result="ok", **ours)) > ok_before
    assert samples(text, "ddiloco_operator_reconcile_duration_seconds_count", **ours)[0] > 0
    print(f"replacement Running {took:.2f}s after its failure was seen")

    # every operator series the chart's dashboard asks for, this real operator exports
    wanted = {n for n in charts.dashboard_metric_names() if n.startswith("ddiloco_operator_")}
    assert wanted and wanted <= charts.exported_names(text), wanted - charts.exported_names(text)

    # kubectl describe shows the replacement with its cause, and the failure with its reason
    def described() -> str | None:
        out = cl.kubectl("describe", "ddj", job).stdout
        return out if "LearnerReplaced" in out else None

    out = k8senv.wait_until("the LearnerReplaced event in kubectl describe", described, 15)
    line = next(x for x in out.splitlines() if "LearnerReplaced" in x)
    assert "slot a-0 after Evicted" in line, line
    assert any("LearnerFailed" in x and "Evicted" in x for x in out.splitlines()), out

    # a deleted job's series go with it
    h.delete_jobs(cl, operator)
    gone = k8senv.wait_until(
        "the job's series gone",
        lambda: (t := operator.scrape()) and f'job="{job}"' not in t and t,
        15,
    )
    assert "# TYPE ddiloco_operator_reconciles_total counter" in gone  # the families stay
