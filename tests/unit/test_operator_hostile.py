"""What a namespace user's Secret or a broken synchronizer says never reaches further than it
should: a kubeconfig whose server is no Kubernetes apiserver, a synchronizer status with NaN
or wrong types, a status answer of any size (tests/integration/test_operator_hostile.py
plays the same on the real apiserver)."""

from __future__ import annotations

import base64
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, ClassVar

import kubernetes
import pydantic
import pytest
import yaml

from ddiloco.operator import conditions as c
from ddiloco.operator import syncstatus
from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.clusters import api_reason, describe_failure
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.kubeconfig import (
    NotKubernetesAPI,
    api_client_from_kubeconfig,
    kubernetes_answer,
)
from ddiloco.operator.plan import Target

BANNER = "internal-only-banner: db-password=hunter2"


class _Server(BaseHTTPRequestHandler):
    answer: ClassVar[tuple[int, str, bytes, str | None]] = (200, "text/plain", b"", None)

    def do_GET(self) -> None:
        status, ctype, body, reason = self.answer
        self.send_response(status, reason)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(name="server")
def server_fixture() -> Iterator[tuple[str, type[_Server]]]:
    handler = type("Handler", (_Server,), {})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()
    server.server_close()


def kubeconfig(server: str) -> dict[str, Any]:
    return {
        "clusters": [{"name": "x", "cluster": {"server": server}}],
        "users": [{"name": "u", "user": {"token": "t"}}],
        "contexts": [{"name": "c", "context": {"cluster": "x", "user": "u"}}],
        "current-context": "c",
    }


STATUS_404 = json.dumps(
    {"kind": "Status", "apiVersion": "v1", "status": "Failure", "reason": "NotFound", "code": 404}
).encode()


def test_only_the_kubernetes_apis_answers_are_answers() -> None:
    assert kubernetes_answer(200, "application/json", b'{"kind": "PodList", "items": []}')
    assert kubernetes_answer(200, "application/json; charset=utf-8", b'{"major": "1"}')
    assert kubernetes_answer(404, "application/json", STATUS_404)
    for status, ctype, body in (
        (200, "text/html", b"<html>hi</html>"),
        (200, "application/json", b"[1, 2]"),
        (200, "application/json", b"not json"),
        (200, "", b"{}"),
        (403, "text/plain", BANNER.encode()),
        (500, "application/json", json.dumps({"message": BANNER}).encode()),
    ):
        assert not kubernetes_answer(status, ctype, body), (status, ctype, body)


@pytest.mark.parametrize(
    "answer",
    [
        (200, "text/html", f"<p>{BANNER}</p>".encode(), None),
        (403, "text/plain", BANNER.encode(), None),
        (500, "application/json", json.dumps({"message": BANNER}).encode(), None),
        (400, "text/plain", b"x", BANNER),
    ],
)
def test_a_server_that_is_no_apiserver_is_an_error_that_quotes_nothing(
    server: tuple[str, type[_Server]], answer: tuple[int, str, bytes, str | None]
) -> None:
    base, handler = server
    handler.answer = answer
    client = api_client_from_kubeconfig(kubeconfig(base))
    with pytest.raises(NotKubernetesAPI) as raised:
        kubernetes.client.CoreV1Api(client).list_namespaced_pod("ns", _request_timeout=5)
    e = raised.value
    assert e.status == answer[0]
    problem = describe_failure(e, Target(None, "ns"), "ns")  # type: ignore[arg-type]
    for text in (str(e), repr(e), api_reason(e), problem.message):
        assert "hunter2" not in text and "banner" not in text, text
    assert problem.reason == c.KUBECONFIG_SECRET_INVALID
    assert "not as the Kubernetes API" in problem.message


def test_a_kubernetes_refusal_keeps_its_status_and_a_standard_reason_phrase(
    server: tuple[str, type[_Server]],
) -> None:
    base, handler = server
    handler.answer = (404, "application/json", STATUS_404, BANNER)
    client = api_client_from_kubeconfig(kubeconfig(base))
    with pytest.raises(kubernetes.client.exceptions.ApiException) as raised:
        kubernetes.client.CoreV1Api(client).read_namespaced_pod("p", "ns", _request_timeout=5)
    assert raised.value.status == 404 and raised.value.reason == "Not Found"


# --------------------------------------------------------------------------- the synchronizer


def test_a_synchronizer_status_is_checked_field_by_field() -> None:
    clean, bad = syncstatus.checked(
        {
            "global_version": 3,
            "merges": "lots",
            "tokens_merged": -1,
            "goodput": math.nan,
            "learners": [{"alive": True, "tokens_total": math.inf}, "x"],
            "other": object(),
        }
    )
    assert clean == {"global_version": 3, "learners": [{"alive": True, "tokens_total": math.inf}]}
    assert bad == ["merges", "tokens_merged", "goodput"]
    assert syncstatus.derived(clean) == {"live_learners": 1}  # inf tokens: no ratio
    assert syncstatus.checked(None) == (None, [])
    assert syncstatus.checked({"global_version": True, "goodput": 1})[1] == ["global_version"]
    assert syncstatus.checked({"goodput": 0.5, "learners": 3}) == ({"goodput": 0.5}, ["learners"])


def test_a_status_answer_is_read_up_to_its_bound(server: tuple[str, type[_Server]]) -> None:
    base, handler = server
    settings = OperatorSettings(status_url_template=base + "/{name}", status_poll_seconds=0.001)  # type: ignore[call-arg]
    reader = syncstatus.StatusReader(settings)
    job = DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "big", "namespace": "ns", "uid": "u-big", "generation": 1},
            "spec": {
                "image": "ddiloco:dev",
                "training": {"model": "tiny"},
                "synchronizer": {"tls": {"enabled": False}},
                "learnerGroups": [{"name": "a", "replicas": 1}],
            },
        }
    )
    handler.answer = (200, "application/json", b'{"global_version": 1}', None)
    assert reader.read(job, "tok") == {"global_version": 1}
    pad = b" " * syncstatus.MAX_STATUS_BYTES
    handler.answer = (200, "application/json", b'{"global_version": 2}' + pad, None)
    reader.forget(job.uid)
    assert reader.read(job, "tok") is None  # refused, as no answer


# --------------------------------------------------------------------------- kubeconfig Secrets


def test_kubeconfigs_are_bounded_and_parsed_once_per_version_even_when_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An 800 KB kubeconfig Secret is refused unparsed; a refused one is not parsed again
    until the Secret changes (uid or resourceVersion), a good one is cached the same way."""
    from kubernetes.client import ApiClient, Configuration, V1ObjectMeta, V1Secret

    from ddiloco.operator import clusters as clusters_mod
    from ddiloco.operator.api import SecretKeyRef

    secret = {"uid": "s1", "rv": "1", "text": "x: " + "y" * 800_000}

    def read(self: Any, name: str, namespace: str, **_: Any) -> V1Secret:
        data = base64.b64encode(secret["text"].encode()).decode()
        meta = V1ObjectMeta(name=name, uid=secret["uid"], resource_version=secret["rv"])
        return V1Secret(metadata=meta, data={"kubeconfig": data})

    parsed: list[int] = []
    real = clusters_mod._client_from_secret

    def counting(data: dict[str, str], key: str, where: str) -> ApiClient:
        parsed.append(1)
        return real(data, key, where)

    monkeypatch.setattr(kubernetes.client.CoreV1Api, "read_namespaced_secret", read)
    monkeypatch.setattr(clusters_mod, "_client_from_secret", counting)
    clusters = clusters_mod.Clusters(ApiClient(Configuration(host="http://127.0.0.1:9")))
    tgt = Target(SecretKeyRef(name="big"), "ns")
    for _ in range(3):
        with pytest.raises(clusters_mod.ClusterProblem) as raised:
            clusters.client(tgt, "ns")
        assert "larger than 64 KiB" in raised.value.message
        assert raised.value.reason == c.KUBECONFIG_SECRET_INVALID
    secret.update(rv="2", text="not: [a kubeconfig")
    for _ in range(3):
        with pytest.raises(clusters_mod.ClusterProblem):
            clusters.client(tgt, "ns")
    assert len(parsed) == 2  # once per version
    secret.update(uid="s2", text=yaml.safe_dump(kubeconfig("https://10.0.0.1:6443")))
    first = clusters.client(tgt, "ns")
    assert clusters.client(tgt, "ns") is first and len(parsed) == 3


# --------------------------------------------------------------------------- careless specs


def job_body(**spec: Any) -> dict[str, Any]:
    body: dict[str, Any] = {
        "metadata": {"name": "j", "namespace": "ns", "uid": "u-j", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "learnerGroups": [{"name": "a", "replicas": 1}],
        },
    }
    body["spec"].update(spec)
    return body


REMOTE = {"kubeconfigSecret": {"name": "r-kubeconfig"}}
CARELESS: list[tuple[str, dict[str, Any]]] = [
    ("managedBy", {"managedBy": ""}),
    ("managedBy", {"managedBy": "ddiloco.dev/operater"}),
    ("managedBy", {"managedBy": "someone"}),
    ("shards", {"synchronizer": {"shards": 8}}),  # 4 fragments
    ("syncUrl", {"learnerGroups": [{"name": "a", "syncUrl": "http://a:1, http://b:1"}]}),
    ("syncUrl", {"learnerGroups": [{"name": "a", "syncUrl": "http://a:1,"}]}),
    ("syncUrl", {"learnerGroups": [{"name": "a", "syncUrl": " http://a:1"}]}),
    (
        "tls",
        {
            "synchronizer": {"tls": {"enabled": False}},
            "learnerGroups": [{"name": "a", "syncUrl": "https://sync.example.com:8470"}],
        },
    ),
    (
        "kubeconfigSecret",
        {
            "learnerGroups": [
                {
                    "name": "a",
                    "cluster": {"kubeconfigSecret": {"name": "other-ns/secret"}},
                    "syncUrl": "https://s.example.com:8470",
                }
            ]
        },
    ),
    ("externalNames", {"synchronizer": {"externalNames": ["a..b"]}}),
    ("externalNames", {"synchronizer": {"externalNames": ["::::"]}}),
    ("externalNames", {"synchronizer": {"externalNames": ["evil/name"]}}),
    ("model", {"training": {"model": "gpt5"}}),
    ("image", {"image": "not an image"}),
    ("image", {"image": "Registry/UPPER"}),
]


@pytest.mark.parametrize(("field", "spec"), CARELESS)
def test_careless_specs_are_refused(field: str, spec: dict[str, Any]) -> None:
    """Each is refused by the models (which the CRD's schema is rendered from) or by
    `validate` (the CRD's CEL rules again): never accepted silently."""
    from ddiloco.operator.api import validate

    try:
        job = DecoupledDiLoCoJob.from_body(job_body(**spec))
    except pydantic.ValidationError as e:
        assert any(field in ".".join(map(str, x["loc"])) for x in e.errors()), e
        return
    problems = validate(job.spec)
    assert problems and any(field.lower() in p.lower() for p in problems), problems


def test_what_careful_specs_say_is_accepted() -> None:
    from ddiloco.operator.api import validate

    for spec in (
        {"managedBy": "kueue.x-k8s.io/multikueue"},
        {"managedBy": "ddiloco.dev/operator"},
        {"synchronizer": {"shards": 4, "externalNames": ["sync.example.com", "203.0.113.7"]}},
        {"synchronizer": {"externalNames": ["2001:db8::1", "*.example.com"]}},
        {"training": {"model": "hf:/models/llama"}},
        {"image": "ghcr.io/org/ddiloco:1.2@sha256:" + "a" * 64},
        {
            "synchronizer": {"tls": {"enabled": False}},
            "learnerGroups": [
                {"name": "a", "cluster": REMOTE, "syncUrl": "https://lb.example.com:443"}
            ],
        },
    ):
        assert validate(DecoupledDiLoCoJob.from_body(job_body(**spec)).spec) == [], spec


def test_the_model_presets_are_the_learners() -> None:
    from ddiloco.learner.model import PRESETS
    from ddiloco.operator.api import MODEL_PRESETS

    assert tuple(PRESETS) == MODEL_PRESETS


def test_a_group_of_zero_replicas_keeps_no_hot_spares() -> None:
    from ddiloco.operator import spares

    job = DecoupledDiLoCoJob.from_body(
        job_body(
            learnerGroups=[{"name": "a", "replicas": 0}, {"name": "b", "replicas": 1}],
            failurePolicy={"hotSpares": 2},
        )
    )
    a, b = job.spec.learner_groups
    assert (spares.wanted(job, a), spares.wanted(job, b)) == (0, 2)
    assert spares.serials_wanted(job, a, ()) == set()
