"""A namespace user's job and Secrets never make the operator act beyond the user's rights.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_hostile.py

The operator runs with rights across the cluster; what a namespace user writes (a job, a
kubeconfig Secret) must not turn it into a reader of the cluster's internal services, nor
into a writer of objects it did not make. Each test plays one hostile or careless input on
the real apiserver with the operator running, and checks what the operator reports and what
it leaves alone.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import k8senv
import operator_helpers as h
import pytest
import yaml
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

pytestmark = pytest.mark.integration

BANNER = "internal-only-banner: db-password=hunter2-5f1c"


class _Banner(BaseHTTPRequestHandler):
    """An internal HTTP service that is not a Kubernetes apiserver: it answers every request
    with its banner, each time in another shape (HTML, a plain-text refusal, a JSON object
    that is no Status, the banner as the HTTP reason phrase)."""

    answers: ClassVar[list[tuple[int, str, str, str | None]]] = [
        (200, "text/html", f"<html><body>{BANNER}</body></html>", None),
        (403, "text/plain", BANNER, None),
        (500, "application/json", json.dumps({"message": BANNER, "code": 500}), None),
        (400, "text/plain", "no", BANNER),
        (200, "application/json", json.dumps([BANNER]), None),
    ]
    served: ClassVar[list[int]] = []

    def _answer(self) -> None:
        k = len(self.served)
        self.served.append(k)
        status, ctype, body, reason = self.answers[k % len(self.answers)]
        data = body.encode()
        if reason is None:
            self.send_response(status)
        else:
            self.send_response(status, reason)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(name="banner_server")
def banner_server_fixture() -> Iterator[str]:
    _Banner.served = []
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Banner)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def banner_kubeconfig(server: str) -> str:
    return yaml.safe_dump(
        {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "internal", "cluster": {"server": server}}],
            "users": [{"name": "u", "user": {"token": "not-a-real-token"}}],
            "contexts": [{"name": "c", "context": {"cluster": "internal", "user": "u"}}],
            "current-context": "c",
        }
    )


def job_events(cl: h.Clusters, job: str) -> list[Any]:
    return cl.core().list_namespaced_event(cl.ns, field_selector=f"involvedObject.name={job}").items


def test_an_internal_service_as_a_kubeconfigs_server_is_never_quoted(
    cl: h.Clusters, operator: h.Operator, banner_server: str
) -> None:
    """A kubeconfig Secret whose server is an internal HTTP service: the group is held back
    with a condition naming the Secret, and the service's answer appears nowhere: not in the
    job's status, not in its events, not in the operator's log."""
    h.kubeconfig_secret(cl, "internal-kubeconfig", None, text=banner_kubeconfig(banner_server))
    group = {**h.remote("inside", 1, secret="internal-kubeconfig")}
    job = h.create_job(cl, h.job_manifest("proxy", [{"name": "home", "replicas": 1}, group]))

    def flagged() -> dict[str, Any] | None:
        got = cl.job(job)
        deg = h.condition(got, "Degraded")
        msg = deg.get("message") or ""
        return got if "not as the Kubernetes API" in msg and "internal-kubeconfig" in msg else None

    k8senv.wait_until("the Secret flagged as not a Kubernetes API", flagged, timeout=30)
    # every shape of answer was served at least once (the operator probes a cluster that
    # failed so at a bounded rate, so give it the time for a few)
    k8senv.wait_until(
        "every kind of answer served",
        lambda: len(_Banner.served) >= len(_Banner.answers),
        timeout=60,
    )
    got = cl.job(job)
    for text, where in (
        (json.dumps(got.get("status")), "the job's status"),
        (" ".join(f"{e.reason} {e.message}" for e in job_events(cl, job)), "its events"),
        (operator.log.read_text(errors="replace"), "the operator's log"),
    ):
        assert "hunter2" not in text and "internal-only-banner" not in text, where
    assert h.condition(got, "Degraded")["reason"] == "KubeconfigSecretInvalid"
    home = h.pods_by_slot(cl, ["home"], job)
    assert list(home) == ["home-0"]  # the rest of the job goes on


def test_a_synchronizer_status_with_nan_or_of_any_size_never_stops_the_job(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """A synchronizer whose status carries NaN and wrong types: those fields are left out and
    the job says so (Degraded, SynchronizerStatusInvalid), its status is written and its
    learners are made. One whose answer is larger than the operator reads: not an answer
    (SynchronizerNotAnswering), the rest goes on."""
    h.STATUS_OVERRIDES[f"/{cl.ns}/nan/"] = (
        b'{"global_version": NaN, "merges": "lots", "tokens_merged": 7, "goodput": Infinity}'
    )
    h.STATUS_OVERRIDES[f"/{cl.ns}/huge/"] = (
        b'{"global_version": 1, "pad": "' + (b"x" * (5 << 20)) + b'"}'
    )
    try:
        nan = h.create_job(cl, h.job_manifest("nan", [{"name": "a", "replicas": 2}]))
        huge = h.create_job(cl, h.job_manifest("huge", [{"name": "a", "replicas": 1}]))
        got = h.wait_condition(cl, nan, "Degraded", reason="SynchronizerStatusInvalid", timeout=60)
        message = h.condition(got, "Degraded")["message"]
        assert "global_version" in message and "merges" in message and "goodput" in message
        assert h.condition(got, "Ready")["status"] == "False"
        k8senv.wait_until(
            "the learners of the job with the NaN status",
            lambda: len(h.running_uids(cl, ["home"], nan)) == 2,
            30,
        )
        status = cl.job(nan)["status"]
        assert status["tokensMerged"] == 7 and "globalVersion" not in status
        assert status["observedGeneration"] == cl.job(nan)["metadata"]["generation"]
        h.wait_condition(
            cl, huge, "SynchronizerReady", status="False", reason="SynchronizerNotAnswering"
        )
        k8senv.wait_until(
            "the learner of the job with the huge status",
            lambda: len(h.running_uids(cl, ["home"], huge)) == 1,
            30,
        )
        assert "StatusTooLarge" in operator.log.read_text(errors="replace")
    finally:
        h.STATUS_OVERRIDES.clear()


def test_an_oversized_kubeconfig_secret_is_refused_and_holds_back_no_other_job(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """An 800 KB kubeconfig Secret: refused unparsed (a condition naming the Secret and the
    bound), while another job's status comes as fast as ever."""
    h.kubeconfig_secret(cl, "huge-kubeconfig", None, text="x: " + "y" * 800_000)
    group = h.remote("far", 1, secret="huge-kubeconfig")
    big = h.create_job(cl, h.job_manifest("bigkc", [{"name": "a", "replicas": 1}, group]))
    got = h.wait_condition(cl, big, "Degraded", reason="KubeconfigSecretInvalid", timeout=30)
    message = h.condition(got, "Degraded")["message"]
    assert "huge-kubeconfig" in message and "larger than 64 KiB" in message
    assert "yyyy" not in json.dumps(got["status"])
    start = time.monotonic()
    other = h.create_job(cl, h.job_manifest("other", [{"name": "a", "replicas": 1}]))
    h.wait_condition(cl, other, "Ready", timeout=30)
    assert time.monotonic() - start < 15


def _careless() -> list[tuple[str, dict[str, Any]]]:
    url = "https://sync.example.com:8470"
    return [
        ("managedBy", {"managedBy": ""}),
        ("managedBy", {"managedBy": "ddiloco.dev/operater"}),
        ("shards", {"synchronizer": {"shards": 64}, "training": {"model": "tiny"}}),
        ("syncUrl", {"learnerGroups": [{"name": "a", "syncUrl": "http://a:1, http://b:1"}]}),
        ("syncUrl", {"learnerGroups": [{"name": "a", "syncUrl": "http://a:1,"}]}),
        (
            "tls.enabled is false",
            {
                "synchronizer": {"tls": {"enabled": False}},
                "learnerGroups": [{"name": "a", "syncUrl": url}],
            },
        ),
        (
            "name",
            {
                "learnerGroups": [
                    {
                        "name": "a",
                        "cluster": {"kubeconfigSecret": {"name": "ns/secret"}},
                        "syncUrl": url,
                    }
                ]
            },
        ),
        ("externalNames", {"synchronizer": {"externalNames": ["a..b"]}}),
        ("model", {"training": {"model": "gpt5"}}),
        ("image", {"image": "not an image"}),
    ]


def test_careless_specs_are_refused_by_the_apiserver(cl: h.Clusters) -> None:
    """Each is refused at `kubectl apply`, with the field or the rule's message."""
    from kubernetes.client.exceptions import ApiException

    for k, (needle, spec) in enumerate(_careless()):
        body = h.job_manifest(f"careless-{k}", [{"name": "a", "replicas": 1}])
        for key, value in spec.items():
            body["spec"][key] = value
        with pytest.raises(ApiException) as raised:
            cl.custom().create_namespaced_custom_object(h.GROUP, h.VERSION, cl.ns, h.PLURAL, body)
        assert raised.value.status == 422, (spec, raised.value.status)
        assert needle in (raised.value.body or ""), (spec, raised.value.body)


def test_a_group_of_zero_replicas_gets_no_hot_spares(cl: h.Clusters, operator: h.Operator) -> None:
    groups = [{"name": "zero", "replicas": 0}, {"name": "one", "replicas": 1}]
    job = h.create_job(cl, h.job_manifest("zero", groups, failurePolicy={"hotSpares": 1}))

    def spares() -> dict[str, int] | None:
        found: dict[str, int] = {}
        for p in cl.pods("home", job):
            if p.metadata.labels.get("ddiloco.dev/role") == "spare":
                group = p.metadata.labels["ddiloco.dev/group"]
                found[group] = found.get(group, 0) + 1
        return found if found.get("one") == 1 else None

    k8senv.wait_until("the spare of group one", spares, 30)
    time.sleep(4 * float(h.RESYNC_S))
    assert spares() == {"one": 1}
