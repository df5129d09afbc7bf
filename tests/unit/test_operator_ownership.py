"""Names, ownership, dead clusters and redaction in the operator, without a cluster.

    .venv/bin/pytest tests/unit/test_operator_ownership.py

Slot pod names must not collide across jobs, nothing the job did not make
is changed or deleted (§1.4), a cluster that does not answer is skipped rather than waited
for on every call (§2), and no log line carries a credential (§1.5). The integration tests
(tests/integration/test_operator_ownership.py, test_operator_regions.py) check the same on
real apiservers.
"""

from __future__ import annotations

import io
import json
import logging
import re
import time
from types import SimpleNamespace

import pytest
import urllib3
from kubernetes.client import ApiClient, Configuration, V1ObjectMeta, V1OwnerReference
from kubernetes.client.exceptions import ApiException

from ddiloco.operator import builders, redact
from ddiloco.operator import conditions as c
from ddiloco.operator.api import SecretKeyRef
from ddiloco.operator.clusters import (
    ClusterProblem,
    Clusters,
    _Cached,
    api_message,
    api_reason,
    describe_failure,
    request_timeout,
    unreachable,
)
from ddiloco.operator.plan import Target

DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
REMOTE = Target(SecretKeyRef(name="region-a-kubeconfig"), "ns")


def job(name: str, uid: str) -> SimpleNamespace:
    return SimpleNamespace(name=name, uid=uid)


# -- names --------------------------------------------------------------------------------


def test_slot_pod_names_of_different_jobs_do_not_collide() -> None:
    # the pair: p-col (group a-b) and p-col-a (group b) both wanted p-col-a-b-0
    one = builders.learner_pod_name(job("p-col", "uid-1"), "a-b", 0)  # type: ignore[arg-type]
    two = builders.learner_pod_name(job("p-col-a", "uid-2"), "b", 0)  # type: ignore[arg-type]
    assert one != two
    assert one.startswith("p-col-a-b-0-") and two.startswith("p-col-a-b-0-")
    # even were the uids equal, the group is hashed too
    same = builders.learner_pod_name(job("p-col-a", "uid-1"), "b", 0)  # type: ignore[arg-type]
    assert same != one


def test_a_slot_keeps_its_name_and_a_new_job_of_the_same_name_gets_others() -> None:
    a = builders.learner_pod_name(job("train", "u-1"), "east", 3)  # type: ignore[arg-type]
    assert a == builders.learner_pod_name(job("train", "u-1"), "east", 3)  # type: ignore[arg-type]
    assert a != builders.learner_pod_name(job("train", "u-2"), "east", 3)  # type: ignore[arg-type]


def test_longest_names_stay_dns_labels_and_distinct() -> None:
    owner = job("j" * 40, "8d3c6f6e-1d2b-4a8e-9c1f-0a5b6c7d8e9f")  # the CRD's longest name
    names = {
        builders.learner_pod_name(owner, g, i)  # type: ignore[arg-type]
        for g in ("g" * 16, "g" * 15 + "h")
        for i in (0, 9, 511)
    }
    assert len(names) == 6
    for name in names:
        assert len(name) <= 63 and DNS_LABEL.match(name), name


def test_made_by_needs_the_job_uid() -> None:
    j = job("x", "u-1")
    assert builders.made_by(j, {"labels": {builders.LABEL_JOB_UID: "u-1"}})  # type: ignore[arg-type]
    assert not builders.made_by(j, {"labels": {builders.LABEL_JOB: "x"}})  # type: ignore[arg-type]
    assert not builders.made_by(j, {})  # type: ignore[arg-type]
    assert not builders.made_by(j, None)  # type: ignore[arg-type]
    ref = V1OwnerReference(api_version="v1", kind="K", name="x", uid="u-1")
    assert builders.made_by(j, V1ObjectMeta(owner_references=[ref]))  # type: ignore[arg-type]
    assert not builders.made_by(j, V1ObjectMeta(labels={builders.LABEL_JOB_UID: "u-2"}))  # type: ignore[arg-type]
    assert not builders.made_by(job("x", ""), {"labels": {builders.LABEL_JOB_UID: ""}})  # type: ignore[arg-type]


def test_learner_selector_selects_by_uid() -> None:
    assert builders.learner_selector(job("x", "u-1")) == (  # type: ignore[arg-type]
        f"{builders.LABEL_JOB_UID}=u-1,app.kubernetes.io/component=learner"
    )


def test_learner_selector_of_a_targets_groups() -> None:
    """Two targets may be one namespace: each selects the pods of its own groups only."""
    assert builders.learner_selector(job("x", "u-1"), {"b", "a"}) == (  # type: ignore[arg-type]
        f"{builders.LABEL_JOB_UID}=u-1,app.kubernetes.io/component=learner,"
        f"{builders.LABEL_GROUP} in (a,b)"
    )


def test_a_place_a_group_left_is_reached_with_the_client_last_used_there(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A kubeconfig Secret edited to point at another apiserver: the old server's client is
    kept (in memory only) for the cleanup there; a server no client reaches is a problem."""
    home = ApiClient(Configuration(host="https://home:6443"))
    clusters = Clusters(home, timeout=0.5)
    version = ["1"]

    def read(self, name, namespace, **kw):  # type: ignore[no-untyped-def]
        meta = SimpleNamespace(uid="s", resource_version=version[0])
        return SimpleNamespace(metadata=meta, data={})

    made = iter(["https://a:6443", "https://b:6443"])
    monkeypatch.setattr("kubernetes.client.CoreV1Api.read_namespaced_secret", read)
    monkeypatch.setattr(
        "ddiloco.operator.clusters._client_from_secret",
        lambda data, key, where: ApiClient(Configuration(host=next(made))),
    )
    a = clusters.client(REMOTE, "ns")
    version[0] = "2"
    b = clusters.client(REMOTE, "ns")
    assert (clusters.server(a), clusters.server(b)) == ("https://a:6443", "https://b:6443")
    assert clusters.client(Target(None, "ns", server="https://a:6443"), "ns") is a
    assert clusters.client(Target(None, "ns", server="https://home:6443"), "ns") is home
    with pytest.raises(ClusterProblem, match="holds no credentials") as e:
        clusters.client(Target(None, "ns", server="https://c:6443"), "ns")
    assert e.value.reason == c.CLUSTER_UNREACHABLE


# -- dead clusters ------------------------------------------------------------------------


def refused() -> urllib3.exceptions.MaxRetryError:
    inner = urllib3.exceptions.NewConnectionError(None, "Failed: [Errno 111] refused")  # type: ignore[arg-type]
    return urllib3.exceptions.MaxRetryError(None, "/api/v1/pods", inner)  # type: ignore[arg-type]


def test_urllib3_errors_count_as_unreachable_and_say_nothing_more() -> None:
    err = refused()
    assert unreachable(err) and unreachable(ConnectionRefusedError())
    assert unreachable(urllib3.exceptions.ReadTimeoutError(None, "/x", "read timed out"))  # type: ignore[arg-type]
    assert unreachable(ApiException(status=0, reason="SSLError"))
    assert not unreachable(ApiException(status=403, reason="Forbidden"))
    assert api_reason(err) == "could not connect"
    problem = describe_failure(err, REMOTE, "team")
    assert problem.reason == c.CLUSTER_UNREACHABLE
    assert problem.message == (
        "the cluster of Secret team/region-a-kubeconfig did not answer (could not connect)"
    )
    assert request_timeout(10) == (5.0, 10) and request_timeout(2) == (2, 2)


def test_a_cluster_that_did_not_answer_is_skipped_then_probed() -> None:
    home = ApiClient(Configuration(host="http://127.0.0.1:9"))
    clusters = Clusters(home, timeout=0.5)
    dead = ApiClient(Configuration(host="http://127.0.0.1:9"))  # discard port: refused
    key = ("team", "region-a-kubeconfig", "kubeconfig")
    clusters._cache[key] = _Cached("v1", dead)
    clusters.failed(REMOTE, "team", refused())
    assert clusters.down() == ["team/region-a-kubeconfig"]
    t0 = time.monotonic()
    with pytest.raises(ClusterProblem, match="did not answer"):
        clusters._refuse_if_down(key, "v1")  # no call: at once
    assert time.monotonic() - t0 < 0.1
    down = clusters._down[key]
    down.until = 0  # the backoff has passed: the next use starts a probe, still refusing
    with pytest.raises(ClusterProblem):
        clusters._refuse_if_down(key, "v1")
    deadline = time.monotonic() + 5
    while down.probing and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not down.probing and down.delay == 4.0  # the probe failed: twice the pause
    clusters._refuse_if_down(key, "v2")  # an edited Secret is tried at once
    assert clusters.down() == []


def test_an_answer_of_any_status_is_not_a_dead_cluster() -> None:
    clusters = Clusters(ApiClient(Configuration(host="http://127.0.0.1:9")), timeout=0.5)
    clusters._cache[("team", "region-a-kubeconfig", "kubeconfig")] = _Cached("v1", ApiClient())
    clusters.failed(REMOTE, "team", ApiException(status=500, reason="Internal Server Error"))
    clusters.failed(Target(None, "team"), "team", refused())  # home is never skipped
    assert clusters.down() == []


def test_api_message_quotes_the_apiserver_without_secrets() -> None:
    redact.register("s3cr3t-value-123")
    body = {
        "kind": "Status",
        "message": 'pods "x" is forbidden: exceeded quota: q, requested: pods=1, s3cr3t-value-123',
        "reason": "Forbidden",
        "code": 403,
    }
    e = ApiException(status=403, reason="Forbidden")
    e.body = json.dumps(body)
    assert api_message(e) == (
        'pods "x" is forbidden: exceeded quota: q, requested: pods=1, <redacted>'
    )
    bare = ApiException(status=422, reason="Unprocessable Entity")
    assert api_message(bare) == "HTTP 422 Unprocessable Entity"
    long = ApiException(status=400, reason="Bad Request")
    long.body = json.dumps({"message": "x" * 1000})
    assert len(api_message(long)) == 300


# -- redaction ----------------------------------------------------------------------------


def test_no_log_record_carries_a_registered_secret_or_a_bearer_header() -> None:
    redact.install()
    token = "tok-NEWLINE-abcdef0123456789"
    redact.register(token + "\n")  # as a kubeconfig Secret may hold it
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    log = logging.getLogger("test-redact")
    log.addHandler(handler)
    log.propagate = False
    try:
        try:
            raise ValueError(f"Invalid header value b'Bearer {token}\\n'")
        except ValueError:
            log.exception("request failed for %s", f"Bearer {token}")
        log.warning("other header: Authorization: Bearer some-unregistered-value, ok")
        log.warning("a raw copy %r", token + "\x07")
    finally:
        log.removeHandler(handler)
    text = out.getvalue()
    assert token not in text and "some-unregistered-value" not in text
    assert "Invalid header value" in text and "<redacted>" in text
    assert "ValueError" in text  # the traceback is still there, scrubbed


def test_register_ignores_short_and_non_string_values() -> None:
    redact.register("abc")
    redact.register(None)
    assert redact.scrub("abc def") == "abc def"
