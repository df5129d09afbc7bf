"""TLS of a job, without a cluster: the spec rules, the builders, certs.py and tokens.py.

    .venv/bin/pytest tests/unit/test_operator_tls.py

`World` plays the apiservers: it applies a plan's Secret actions to per-target Secret maps and
hands them back as the next observation, so a test can run reconcile pass after pass and
parse the certificates it issued.
"""

from __future__ import annotations

import base64
import http.server
import json
import ssl
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest
from cryptography import x509

from ddiloco.operator import api, builders, certs, crd, sync_workload, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.config import OperatorSettings
from ddiloco.operator.plan import (
    Action,
    ClusterView,
    Observed,
    Plan,
    SecretView,
    Target,
    home,
)
from ddiloco.operator.reconcile import reconcile
from ddiloco.operator.syncstatus import StatusReader
from ddiloco.wire import auth
from ddiloco.wire import tls as x

# The issuing functions (wire/tls.py) date certificates by the wall clock; the
# observations start there and move forward.
T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)


@pytest.fixture(autouse=True)
def _fresh_t0() -> None:
    """Each test's clock starts at the real time: certificates are issued by the real clock
    (backdated 5 minutes), and in the whole suite this module is imported long before its
    tests run, so a T0 taken at import would be before what they issue."""
    global T0
    T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(seconds=1)


REMOTE = Target(api.SecretKeyRef(name="region-a-kubeconfig"), "ns")
REMOTE_URL = "https://sync.example.com:8470"


def make_job(tls: dict[str, Any] | None = None, **spec: Any) -> api.DecoupledDiLoCoJob:
    sync: dict[str, Any] = {"externalNames": ["lb.example.net", "203.0.113.7"]}
    if tls is not None:
        sync["tls"] = tls
    body: dict[str, Any] = {
        "metadata": {"name": "tj", "namespace": "ns", "uid": "uid-1", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "synchronizer": sync,
            "learnerGroups": [
                {"name": "home", "replicas": 2},
                {
                    "name": "ra",
                    "replicas": 1,
                    "cluster": {"kubeconfigSecret": {"name": "region-a-kubeconfig"}},
                    "syncUrl": REMOTE_URL,
                },
            ],
        },
    }
    body["spec"].update(spec)
    job = api.DecoupledDiLoCoJob.from_body(body)
    assert api.validate(job.spec) == []
    return job


def secret_view(body: dict[str, Any], uid: str = "uid-1") -> SecretView:
    return SecretView(
        data={k: base64.b64decode(v) for k, v in body["data"].items()},
        job_uid=uid,
        annotations=dict(body["metadata"].get("annotations") or {}),
    )


class World:
    """The Secrets, StatefulSet and Certificate of one job in two targets, as plans leave them."""

    def __init__(self, job: api.DecoupledDiLoCoJob) -> None:
        self.job = job
        self.secrets: dict[Target, dict[str, SecretView]] = {home(job): {}, REMOTE: {}}
        self.sts: dict[str, Any] | None = None
        self.certificate: dict[str, Any] | None = None
        self.cert_manager = False
        self.now = T0

    def observe(self) -> Observed:
        name = builders.token_secret_name(self.job)
        views = {}
        for tgt, secrets in self.secrets.items():
            token = secrets.get(name)
            views[tgt] = ClusterView(
                token=token.data[builders.TOKEN_KEY].decode() if token else None,
                secrets=dict(secrets),
            )
        return Observed(
            now=self.now,
            clusters=views,
            statefulset=self.sts,
            service=True,
            shards_service=True,
            cert_manager=self.cert_manager,
            certificate=self.certificate,
        )

    def apply(self, plan: Plan) -> None:
        for a in plan.actions:
            if a.kind == "Secret":
                there = self.secrets[a.target]
                if a.verb == "delete":
                    there.pop(a.name, None)
                else:
                    assert (a.verb == "create") == (a.name not in there), a.describe()
                    assert a.body is not None
                    there[a.name] = secret_view(a.body)
            elif a.kind == "StatefulSet":
                self.sts = a.body
            elif a.kind == "Certificate":
                self.certificate = a.body

    def step(self, fresh: str = "fresh-token") -> Plan:
        plan = reconcile(self.job, self.observe(), fresh_token=fresh)
        self.apply(plan)
        if plan.status is not None:
            self.job = self.job.model_copy(update={"status": plan.status})
        return plan

    def home_secret(self, name: str) -> SecretView:
        return self.secrets[home(self.job)][name]

    def pair(self, tgt: Target, name: str) -> x.KeyPair:
        s = self.secrets[tgt][name]
        return x.KeyPair.from_pem(s.data["tls.crt"], s.data["tls.key"])


def creds(job: api.DecoupledDiLoCoJob, group: str) -> str:
    """The name of a group's learner credentials Secret."""
    return builders.learner_tokens_secret_name(job, group)


def tls_actions(plan: Plan) -> list[tuple[str, str, str]]:
    return [
        (a.verb, a.name, a.target.label)
        for a in plan.actions
        if a.kind in ("Secret", "Certificate") and a.name != "tj-token" and "-tokens-" not in a.name
    ]


def container(obj: dict[str, Any]) -> dict[str, Any]:
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"]
    (ctr,) = spec["containers"]
    return ctr


def env(obj: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(obj)["env"]}


def mounts(obj: dict[str, Any]) -> dict[str, str]:
    """mount path -> Secret name, for the Secret volumes of a pod or StatefulSet."""
    spec = obj["spec"]["template"]["spec"] if obj["kind"] == "StatefulSet" else obj["spec"]
    secrets = {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v}
    out = {}
    for m in container(obj)["volumeMounts"]:
        assert "subPath" not in m, "a subPath mount never sees a rotated Secret"
        if m["name"] in secrets:
            assert m.get("readOnly") is True
            out[m["mountPath"]] = secrets[m["name"]]
    return out


# --------------------------------------------------------------------------- the spec


def test_tls_is_on_by_default_and_the_service_url_is_https() -> None:
    job = make_job()
    tls = job.spec.synchronizer.tls
    assert (tls.enabled, tls.issuer, tls.mutual) == (True, "operator", False)
    assert builders.synchronizer_service_url(job) == "https://tj-synchronizer.ns.svc:8470"
    off = make_job(tls={"enabled": False})
    assert builders.synchronizer_service_url(off).startswith("http://")
    # the main port speaks h2c without TLS; the upload port HTTP/1.1 only, never h2c
    for build in (sync_workload.build_synchronizer_service, sync_workload.build_shards_service):
        protocols = {p["name"]: p["appProtocol"] for p in build(job)["spec"]["ports"]}
        assert protocols == {"http": "https", "upload": "https"}
        protocols = {p["name"]: p["appProtocol"] for p in build(off)["spec"]["ports"]}
        assert protocols == {"http": "kubernetes.io/h2c", "upload": "http"}


def remote_group(url: str, **extra: Any) -> dict[str, Any]:
    return {
        "name": "ra",
        "replicas": 1,
        "cluster": {"kubeconfigSecret": {"name": "k"}},
        "syncUrl": url,
        **extra,
    }


def test_a_remote_http_sync_url_is_refused_unless_insecure() -> None:
    def problems(group: dict[str, Any]) -> list[str]:
        body = {
            "metadata": {"name": "tj", "namespace": "ns"},
            "spec": {"image": "i", "training": {"model": "tiny"}, "learnerGroups": [group]},
        }
        return api.validate(api.DecoupledDiLoCoJob.from_body(body).spec)

    (msg,) = problems(remote_group("http://sync.example.com:8470"))
    assert "needs an https:// syncUrl" in msg and "insecure: true" in msg
    assert problems(remote_group("http://sync.example.com:8470", insecure=True)) == []
    assert problems(remote_group("https://sync.example.com:8470")) == []
    # in the synchronizer's own cluster an explicit http:// URL stays allowed (h2c)
    local = {"name": "a", "replicas": 1, "syncUrl": "http://tj-synchronizer:8470"}
    assert problems(local) == []


def test_the_crd_carries_the_same_rules() -> None:
    spec = crd.openapi_schema()["properties"]["spec"]["properties"]
    group = spec["learnerGroups"]["items"]
    rules = {r["message"]: r["rule"] for r in group["x-kubernetes-validations"]}
    assert "self.syncUrl.split(',').all(u, u.startsWith('https://'))" in rules[api.INSECURE_MESSAGE]
    assert group["properties"]["insecure"]["default"] is False
    sync = spec["synchronizer"]["properties"]
    tls = sync["tls"]
    assert tls["properties"]["enabled"]["default"] is True
    assert tls["properties"]["issuer"]["enum"] == ["operator", "cert-manager"]
    assert any("issuerRef" in r["rule"] for r in tls["x-kubernetes-validations"])
    assert sync["externalNames"]["maxItems"] == 32
    assert "tokenRotationGraceSeconds" in sync


def test_cert_manager_needs_an_issuer_ref() -> None:
    job = make_job(tls={"issuer": "cert-manager", "issuerRef": {"name": "ca"}})
    assert job.spec.synchronizer.tls.issuer_ref == api.IssuerRef(name="ca")
    bad = api.DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "tj"},
            "spec": {
                "image": "i",
                "training": {"model": "tiny"},
                "synchronizer": {"tls": {"issuer": "cert-manager"}},
                "learnerGroups": [{"name": "a"}],
            },
        }
    )
    assert any("issuerRef" in p for p in api.validate(bad.spec))


@pytest.mark.parametrize("name", ["", "has space.example", "a/b", "-lead.example"])
def test_external_names_must_be_names_or_addresses(name: str) -> None:
    with pytest.raises(pydantic.ValidationError):
        make_job(synchronizer={"externalNames": [name]})


# --------------------------------------------------------------------------- the builders


def test_the_synchronizer_reads_its_certificate_and_token_from_mounted_files() -> None:
    dep = sync_workload.build_synchronizer_statefulset(make_job(), tls_revision="abc")
    e = env(dep)
    assert "DDILOCO_TOKEN" not in e, "the token travels as a file, so it can rotate"
    assert e["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
    assert e["DDILOCO_TLS_CERT_FILE"] == "/var/run/ddiloco/tls/tls.crt"
    assert e["DDILOCO_TLS_KEY_FILE"] == "/var/run/ddiloco/tls/tls.key"
    assert "DDILOCO_TLS_CLIENT_CA_FILE" not in e
    assert mounts(dep) == {"/var/run/ddiloco/token": "tj-token", "/var/run/ddiloco/tls": "tj-tls"}
    probe = container(dep)["readinessProbe"]
    assert probe["httpGet"]["scheme"] == "HTTPS"
    template = dep["spec"]["template"]
    assert template["metadata"]["annotations"] == {builders.ANNOTATION_TLS_REVISION: "abc"}
    # a new certificate changes the StatefulSet's hash: the synchronizer loads it at startup
    other = sync_workload.build_synchronizer_statefulset(make_job(), tls_revision="def")
    assert (
        other["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
        != dep["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]
    )


def test_mutual_tls_adds_the_client_ca_and_a_tcp_probe() -> None:
    dep = sync_workload.build_synchronizer_statefulset(make_job(tls={"mutual": True}))
    assert env(dep)["DDILOCO_TLS_CLIENT_CA_FILE"] == "/var/run/ddiloco/trust/client-ca.crt"
    assert mounts(dep)["/var/run/ddiloco/trust"] == "tj-trust"
    # the kubelet has no client certificate: an HTTPS probe would fail the handshake
    assert "tcpSocket" in container(dep)["livenessProbe"]
    assert "tcpSocket" in container(dep)["startupProbe"]


def test_liveness_waits_for_a_slow_start() -> None:
    """A synchronizer that takes minutes to load its state is not killed before it answers:
    the startup probe allows 10 minutes, liveness counts only after it."""
    c = container(sync_workload.build_synchronizer_statefulset(make_job()))
    start = c["startupProbe"]
    assert start["httpGet"]["path"] == "/healthz"
    assert start["periodSeconds"] * start["failureThreshold"] >= 600
    live = c["livenessProbe"]
    assert live["periodSeconds"] * live["failureThreshold"] < 600


def test_without_tls_the_synchronizer_gets_only_the_token_file() -> None:
    dep = sync_workload.build_synchronizer_statefulset(make_job(tls={"enabled": False}))
    assert not [n for n in env(dep) if n.startswith("DDILOCO_TLS")]
    assert mounts(dep) == {"/var/run/ddiloco/token": "tj-token"}
    assert "scheme" not in container(dep)["readinessProbe"]["httpGet"]


@pytest.mark.parametrize("mutual", [False, True])
def test_learners_mount_the_trust_and_their_own_client_certificate(mutual: bool) -> None:
    job = make_job(tls={"mutual": mutual})
    for group in job.spec.learner_groups:
        pod = builders.build_learner_pod(job, group, 0)
        e, m = env(pod), mounts(pod)
        assert "DDILOCO_TOKEN" not in e
        assert e["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
        # its own credential, one item of its group's Secret: never the job key
        token = next(v for v in pod["spec"]["volumes"] if v["name"] == "token")
        assert (
            token["secret"]["secretName"] == creds(job, group.name) == m["/var/run/ddiloco/token"]
        )
        assert token["secret"]["items"] == [{"key": f"{group.name}-0", "path": "token"}]
        assert "tj-token" not in m.values()
        assert e["DDILOCO_CA_FILE"] == "/var/run/ddiloco/trust/ca.crt"
        assert m["/var/run/ddiloco/trust"] == "tj-trust"
        assert e["DDILOCO_SYNC_URL"].startswith("https://")
        assert pod["spec"]["securityContext"]["fsGroup"] == builders.IMAGE_UID
        if mutual:
            assert e["DDILOCO_CLIENT_CERT_FILE"] == "/var/run/ddiloco/client/tls.crt"
            assert e["DDILOCO_CLIENT_KEY_FILE"] == "/var/run/ddiloco/client/tls.key"
            name = builders.client_secret_name(job, group.name, 0)
            assert m["/var/run/ddiloco/client"] == name
        else:
            assert "DDILOCO_CLIENT_CERT_FILE" not in e and "/var/run/ddiloco/client" not in m


def test_an_insecure_group_gets_no_tls_files() -> None:
    job = make_job(
        tls={"mutual": True},
        learnerGroups=[remote_group("http://sync.example.com:8470", insecure=True)],
    )
    pod = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)
    assert mounts(pod) == {"/var/run/ddiloco/token": creds(job, "ra")}
    assert env(pod)["DDILOCO_SYNC_URL"] == "http://sync.example.com:8470"


def test_server_names_cover_the_service_external_names_and_sync_url_hosts() -> None:
    dns, ips = certs.server_names(make_job())
    assert dns == [
        "tj-synchronizer",
        "tj-synchronizer.ns",
        "tj-synchronizer.ns.svc",
        "tj-synchronizer.ns.svc.cluster.local",
        "lb.example.net",
        "sync.example.com",  # the remote group's https syncUrl
    ]
    assert ips == ["203.0.113.7"]


# --------------------------------------------------------------------------- certs.py


def test_the_first_pass_issues_everything_and_the_second_changes_nothing() -> None:
    w = World(make_job(tls={"mutual": True}))
    plan = w.step()
    lid = {n: builders.client_secret_name(w.job, *n) for n in [("home", 0), ("home", 1), ("ra", 0)]}
    assert sorted(tls_actions(plan)) == sorted(
        [
            ("create", "tj-ca", "local"),
            ("create", "tj-tls", "local"),
            ("create", "tj-trust", "local"),
            ("create", "tj-trust", "region-a-kubeconfig"),
            ("create", lid["home", 0], "local"),
            ("create", lid["home", 1], "local"),
            ("create", lid["ra", 0], "region-a-kubeconfig"),
        ]
    )
    assert tls_actions(w.step()) == []
    h = home(w.job)
    ca = w.pair(h, "tj-ca")
    assert ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    server = w.pair(h, "tj-tls")
    assert certs.issued_by(server.certificate, ca.certificate)
    dns, ips = certs.server_names(w.job)
    assert sorted(server.dns_names) == sorted(dns) and server.ip_addresses == ips
    lifetime = server.not_after - server.not_before
    assert timedelta(days=89) < lifetime <= timedelta(days=90, minutes=5)
    assert w.home_secret("tj-tls").data["ca.crt"] == ca.cert_pem
    # the regions get the CA certificates and their own clients' keys, never the CA's key
    remote = w.secrets[REMOTE]
    assert set(remote) == {"tj-trust", lid["ra", 0], creds(w.job, "ra")}  # and not the key
    assert set(remote["tj-trust"].data) == {"ca.crt", "client-ca.crt"}
    assert remote["tj-trust"].data["ca.crt"] == ca.cert_pem
    client = w.pair(REMOTE, lid["ra", 0])
    assert client.common_name == "ra-0" and certs.issued_by(client.certificate, ca.certificate)
    assert all(ca.key_pem not in v for s in remote.values() for v in s.data.values())
    # the Secret types: the server's is kubernetes.io/tls
    made = {a.name: a.body for a in plan.actions if a.kind == "Secret"}
    assert made["tj-tls"]["type"] == "kubernetes.io/tls"
    assert made["tj-trust"]["type"] == "Opaque"
    assert (
        "ownerReferences"
        not in next(a.body for a in plan.actions if a.target == REMOTE and a.name == "tj-trust")[
            "metadata"
        ]
    )


def test_long_names_still_make_valid_certificates() -> None:
    # X.509 limits a CN to 64 characters; a namespace may have 63, a job name 40
    body = make_job().model_dump(by_alias=True, mode="json")
    body["metadata"].update(name="j" * api.MAX_JOB_NAME, namespace="n" * 63)
    w = World(api.DecoupledDiLoCoJob.from_body(body))
    w.secrets = {home(w.job): {}, Target(REMOTE.secret, "n" * 63): {}}
    w.step()
    names = set(w.secrets[home(w.job)])
    ca = w.pair(home(w.job), builders.ca_secret_name(w.job))
    assert ca.common_name == f"ddiloco {w.job.name} CA"
    server = w.pair(home(w.job), builders.tls_secret_name(w.job))
    assert f"{w.job.name}-synchronizer.{'n' * 63}.svc.cluster.local" in server.dns_names
    assert builders.trust_secret_name(w.job) in names


def test_a_server_certificate_near_expiry_is_renewed_and_rolls_the_synchronizer() -> None:
    w = World(make_job())
    w.step()
    w.step()
    before = w.pair(home(w.job), "tj-tls")
    revision = w.sts["spec"]["template"]["metadata"]["annotations"]
    w.now = T0 + timedelta(days=59)  # 31 of 90 days left: more than a third
    assert tls_actions(w.step()) == []
    w.now = T0 + timedelta(days=61)  # 29 left: renew
    plan = w.step()
    assert tls_actions(plan) == [("replace", "tj-tls", "local")]
    after = w.pair(home(w.job), "tj-tls")
    assert after.cert_pem != before.cert_pem and after.key_pem != before.key_pem
    assert any(a.kind == "StatefulSet" and a.verb == "replace" for a in plan.actions)
    assert w.sts["spec"]["template"]["metadata"]["annotations"] != revision


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> list[datetime]:
    """Date the certificates wire/tls.py issues by clock[0], not the wall clock."""
    now = [T0]

    def validity(days: int) -> tuple[datetime, datetime]:
        return now[0] - timedelta(minutes=5), now[0] + timedelta(days=days)

    monkeypatch.setattr(x, "_validity", validity)
    return now


def test_a_ca_near_expiry_is_renewed_and_both_are_trusted_meanwhile(clock: list[datetime]) -> None:
    w = World(make_job(tls={"mutual": True, "certificateDays": 30}))
    w.step()
    old_ca = w.pair(home(w.job), "tj-ca")
    w.now = clock[0] = T0 + timedelta(days=201)  # the CA lives 300 days: < a third left
    w.step()
    assert tls_actions(w.step()) == []  # renewed once, then stable
    new_ca = w.pair(home(w.job), "tj-ca")
    assert new_ca.cert_pem != old_ca.cert_pem
    bundle = x509.load_pem_x509_certificates(w.home_secret("tj-ca").data["ca.crt"])
    assert bundle == [new_ca.certificate, old_ca.certificate]
    for tgt in (home(w.job), REMOTE):
        trust = w.secrets[tgt]["tj-trust"].data
        assert x509.load_pem_x509_certificates(trust["ca.crt"]) == bundle
    server = w.pair(home(w.job), "tj-tls")
    assert certs.issued_by(server.certificate, new_ca.certificate)
    lid = builders.client_secret_name(w.job, "ra", 0)
    assert certs.issued_by(w.pair(REMOTE, lid).certificate, new_ca.certificate)
    w.now = clock[0] = T0 + timedelta(days=301)  # the old CA expired: dropped from the bundle
    w.step()
    assert x509.load_pem_x509_certificates(w.home_secret("tj-ca").data["ca.crt"]) == [
        new_ca.certificate
    ]


def test_a_short_certificate_put_there_by_hand_is_renewed() -> None:
    w = World(make_job())
    w.step()
    h = home(w.job)
    ca = w.pair(h, "tj-ca")
    old = w.secrets[h]["tj-tls"]
    dns, ips = certs.server_names(w.job)
    short = x.issue_server(ca, dns, ips, days=1)  # valid, but 1 of the spec's 90 days left
    w.secrets[h]["tj-tls"] = SecretView(
        data={**old.data, "tls.crt": short.cert_pem, "tls.key": short.key_pem}, job_uid="uid-1"
    )
    assert tls_actions(w.step()) == [("replace", "tj-tls", "local")]
    assert w.pair(h, "tj-tls").not_after - T0 > timedelta(days=89)


def test_a_certificate_of_another_ca_with_the_same_name_is_not_issued_by_it() -> None:
    # Same subject, so the issuer names match and only the signature tells them apart.
    ours, theirs = x.issue_ca("ddiloco ns/tj CA"), x.issue_ca("ddiloco ns/tj CA")
    leaf = x.issue_server(theirs, ["tj-synchronizer"])
    assert not certs.issued_by(leaf.certificate, ours.certificate)
    assert certs.issued_by(leaf.certificate, theirs.certificate)
    other_name = x.issue_server(x.issue_ca("someone else"), ["tj-synchronizer"])
    assert not certs.issued_by(other_name.certificate, ours.certificate)


def test_a_server_certificate_of_a_recreated_ca_is_reissued() -> None:
    """The CA Secret replaced by one with the same name (deleted live, or renewed): the server
    and client certificates it did not sign are reissued, and reconcile keeps going."""
    w = World(make_job(tls={"mutual": True}))
    w.step()
    h = home(w.job)
    old_ca = w.pair(h, "tj-ca")
    new_ca = x.issue_ca(old_ca.common_name)
    w.secrets[h]["tj-ca"] = SecretView(
        data={"tls.crt": new_ca.cert_pem, "tls.key": new_ca.key_pem, "ca.crt": new_ca.cert_pem},
        job_uid="uid-1",
    )
    acts = tls_actions(w.step())
    assert ("replace", "tj-tls", "local") in acts
    lid = builders.client_secret_name(w.job, "ra", 0)
    assert ("replace", lid, "region-a-kubeconfig") in acts
    assert certs.issued_by(w.pair(h, "tj-tls").certificate, new_ca.certificate)
    assert certs.issued_by(w.pair(REMOTE, lid).certificate, new_ca.certificate)


def test_new_external_names_reissue_the_server_certificate() -> None:
    w = World(make_job())
    w.step()
    w.job = make_job(synchronizer={"externalNames": ["new.example.org"]}).model_copy(
        update={"status": w.job.status}
    )
    plan = w.step()
    assert ("replace", "tj-tls", "local") in tls_actions(plan)
    assert "new.example.org" in w.pair(home(w.job), "tj-tls").dns_names


def test_a_secret_of_another_job_is_left_alone_and_reported() -> None:
    w = World(make_job())
    w.secrets[REMOTE]["tj-trust"] = SecretView(data={"ca.crt": b"theirs"}, job_uid="other")
    plan = w.step()
    assert ("create", "tj-trust", "region-a-kubeconfig") not in tls_actions(plan)
    assert not [a for a in plan.actions if a.target == REMOTE and a.name == "tj-trust"]
    assert w.secrets[REMOTE]["tj-trust"].data == {"ca.crt": b"theirs"}
    deg = c.get(w.job.status.conditions, c.DEGRADED)
    assert deg is not None and deg.reason == c.NAME_CONFLICT and "tj-trust" in deg.message


def test_turning_mutual_tls_off_prunes_the_client_certificates() -> None:
    w = World(make_job(tls={"mutual": True}))
    w.step()
    w.job = make_job().model_copy(update={"status": w.job.status})
    plan = w.step()
    deleted = sorted(n for v, n, _ in tls_actions(plan) if v == "delete")
    assert deleted == sorted(
        builders.client_secret_name(w.job, g, i) for g, i in [("home", 0), ("home", 1), ("ra", 0)]
    )
    assert set(w.secrets[REMOTE]["tj-trust"].data) == {"ca.crt"}  # no client-ca.crt
    w.job = make_job(tls={"enabled": False}).model_copy(update={"status": w.job.status})
    w.step()
    assert set(w.secrets[home(w.job)]) == {"tj-token", creds(w.job, "home")}
    assert set(w.secrets[REMOTE]) == {creds(w.job, "ra")}


# --------------------------------------------------------------------------- cert-manager


def cm_job(**tls: Any) -> api.DecoupledDiLoCoJob:
    ref = {"name": "team-ca", "kind": "ClusterIssuer"}
    return make_job(tls={"issuer": "cert-manager", "issuerRef": ref, **tls})


def test_without_cert_manager_installed_the_job_says_so() -> None:
    w = World(cm_job())
    plan = w.step()
    assert not [a for a in plan.actions if a.kind == "Certificate"]
    assert not [a for a in plan.actions if a.kind == "Secret" and a.name == "tj-tls"]
    deg = c.get(w.job.status.conditions, c.DEGRADED)
    assert deg is not None and deg.reason == certs.CERT_MANAGER_MISSING
    assert "certificates.cert-manager.io" in deg.message


def test_cert_manager_gets_a_certificate_and_its_secret_feeds_the_trust() -> None:
    w = World(cm_job())
    w.cert_manager = True
    plan = w.step()
    (action,) = [a for a in plan.actions if a.kind == "Certificate"]
    assert action.verb == "create" and action.name == "tj-tls"
    spec = action.body["spec"]
    dns, ips = certs.server_names(w.job)
    assert spec["secretName"] == "tj-tls" and spec["dnsNames"] == dns
    assert spec["ipAddresses"] == ips
    assert spec["issuerRef"] == {
        "name": "team-ca",
        "kind": "ClusterIssuer",
        "group": "cert-manager.io",
    }
    assert spec["secretTemplate"]["labels"][builders.LABEL_JOB_UID] == "uid-1"
    assert "server auth" in spec["usages"]
    # the operator makes no CA of its own without mutual TLS, and writes no tj-tls itself
    assert {n for _, n, _ in tls_actions(plan)} == {"tj-tls"}
    assert mounts(w.sts)["/var/run/ddiloco/tls"] == "tj-tls"
    deg = c.get(w.job.status.conditions, c.DEGRADED)
    assert deg is not None and deg.reason == certs.CERT_PENDING
    # cert-manager issues (here: the test, from a CA of its own)
    ca = x.issue_ca("cert-manager CA")
    server = x.issue_server(ca, dns, ips)
    w.secrets[home(w.job)]["tj-tls"] = SecretView(
        data={"tls.crt": server.cert_pem, "tls.key": server.key_pem, "ca.crt": ca.cert_pem},
        job_uid="uid-1",
    )
    plan = w.step()
    assert sorted(tls_actions(plan)) == [
        ("create", "tj-trust", "local"),
        ("create", "tj-trust", "region-a-kubeconfig"),
    ]
    assert w.secrets[REMOTE]["tj-trust"].data == {"ca.crt": ca.cert_pem}
    assert w.sts["spec"]["template"]["metadata"]["annotations"]
    assert c.get(w.job.status.conditions, c.DEGRADED).status == "False"
    # a new external name changes the Certificate
    w.job = cm_job().model_copy(update={"status": w.job.status})
    w.job = w.job.model_copy(
        update={
            "spec": w.job.spec.model_copy(
                update={
                    "synchronizer": w.job.spec.synchronizer.model_copy(
                        update={"external_names": ["other.example"]}
                    )
                }
            )
        }
    )
    plan = w.step()
    (action,) = [a for a in plan.actions if a.kind == "Certificate"]
    assert action.verb == "replace" and "other.example" in action.body["spec"]["dnsNames"]


# --------------------------------------------------------------------------- token rotation


def rotate(w: World, value: str) -> None:
    meta = {**w.job.metadata, "annotations": {tokens.ANNOTATION_ROTATE: value}}
    w.job = w.job.model_copy(update={"metadata": meta})


def token_of(w: World, tgt: Target) -> str:
    """The job key, as the home Secret holds it."""
    return w.secrets[tgt]["tj-token"].data["token"].decode()


def cred_of(w: World, tgt: Target, group: str, item: str) -> str:
    """One item of a group's learner credentials Secret (what one pod's token file holds)."""
    return w.secrets[tgt][creds(w.job, group)].data[item].decode()


def learners(*keys: str) -> dict[str, str]:
    """What each learner's file holds under `keys`, by learner id (make_job: home-0, home-1
    at home, ra-0 in the region)."""
    return {lid: auth.derived_lines(keys, "learner", lid) for lid in ("home-0", "home-1", "ra-0")}


def creds_of(w: World) -> dict[str, str]:
    return {
        lid: cred_of(w, home(w.job) if lid.startswith("home") else REMOTE, lid[:-2], lid)
        for lid in ("home-0", "home-1", "ra-0")
    }


def test_a_token_rotation_keeps_the_old_token_for_the_grace_period() -> None:
    w = World(make_job(synchronizer={"tokenRotationGraceSeconds": 60}))
    w.step(fresh="old")
    assert token_of(w, home(w.job)) == "old" and "tj-token" not in w.secrets[REMOTE]
    assert creds_of(w) == learners("old")
    rotate(w, "2026-12-01")
    plan = w.step(fresh="new")
    assert [e.reason for e in plan.events] == ["TokenRotating"]
    # the key, and every credential derived from it, in the same pass
    assert token_of(w, home(w.job)) == "new\nold"
    assert creds_of(w) == learners("new", "old")
    assert creds_of(w)["ra-0"].splitlines()[0] == auth.learner_token("new", "ra-0")
    # nothing restarts: no pod deleted, the synchronizer's StatefulSet left as it is
    assert not [a for a in plan.actions if a.kind == "StatefulSet" or a.verb == "delete"]
    notes = w.home_secret("tj-token").annotations
    assert notes[tokens.ANNOTATION_ROTATION] == "2026-12-01"
    w.now = T0 + timedelta(seconds=59)
    w.step(fresh="newer")  # the same request is not acted on twice
    assert token_of(w, home(w.job)) == "new\nold"
    w.now = T0 + timedelta(seconds=61)
    plan = w.step(fresh="newer")
    assert [e.reason for e in plan.events] == ["TokenRotated"]
    assert token_of(w, home(w.job)) == "new"
    assert creds_of(w) == learners("new")
    assert tokens.current("new\nold") == "new"


def test_the_old_token_stays_while_a_region_has_not_caught_up() -> None:
    w = World(make_job(synchronizer={"tokenRotationGraceSeconds": 0}))
    w.step(fresh="old")
    rotate(w, "1")
    plan = reconcile(w.job, w.observe(), fresh_token="new")
    # the region's credentials were not written (say the region did not answer)
    plan.actions = [a for a in plan.actions if a.target != REMOTE]
    w.apply(plan)
    w.now = T0 + timedelta(seconds=5)
    obs = w.observe()
    clusters = dict(obs.clusters)
    clusters[REMOTE] = ClusterView(problem=(c.CLUSTER_UNREACHABLE, "down"))
    stuck = reconcile(w.job, Observed(now=w.now, clusters=clusters), fresh_token="x")
    assert not [a for a in stuck.actions if a.name == "tj-token"]
    plan = w.step()  # the region is back: its credentials get both lines first
    assert not [a for a in plan.actions if a.name == "tj-token"]
    assert token_of(w, home(w.job)) == "new\nold"
    assert creds_of(w) == learners("new", "old")
    w.step()
    assert token_of(w, home(w.job)) == "new"
    assert creds_of(w) == learners("new")


def test_a_rotation_asked_for_before_the_first_token_is_already_done() -> None:
    w = World(make_job())
    rotate(w, "early")
    w.step(fresh="first")
    w.step(fresh="second")
    assert token_of(w, home(w.job)) == "first"


# --------------------------------------------------------------------------- the operator's client


class _Status(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:
        body = json.dumps({"globalVersion": 7, "peer": self.connection.getpeercert()}).encode()
        self.send_response(200 if self.headers["Authorization"] == "Bearer new" else 401)
        self.send_header("Content-Type", "application/json")
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def https_server(tmp_path: Path) -> Iterator[tuple[World, int]]:
    """The job's synchronizer as far as TLS goes: its server Secret, mutual TLS on."""
    w = World(make_job(synchronizer={"externalNames": ["127.0.0.1"], "tls": {"mutual": True}}))
    w.step(fresh="new")
    tls_secret, trust = w.home_secret("tj-tls"), w.home_secret("tj-trust")
    for name, data in [
        ("tls.crt", tls_secret.data["tls.crt"]),
        ("tls.key", tls_secret.data["tls.key"]),
        ("client-ca.crt", trust.data["client-ca.crt"]),
    ]:
        (tmp_path / name).write_bytes(data)
    ctx = x.server_context(
        tmp_path / "tls.crt", tmp_path / "tls.key", client_ca_file=tmp_path / "client-ca.crt"
    )
    ctx.set_alpn_protocols(["http/1.1"])
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Status)
    server.socket = ctx.wrap_socket(server.socket, server_side=True)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield w, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


def test_the_operator_reads_the_status_over_mutual_tls(https_server: tuple[World, int]) -> None:
    w, port = https_server
    settings = OperatorSettings(
        status_url_template=f"{{scheme}}://127.0.0.1:{port}", status_poll_seconds=0.001
    )
    reader = StatusReader(settings)
    home_view = w.observe().clusters[home(w.job)]
    ctx = certs.StatusTLS().context(w.job, home_view, T0)
    assert ctx is not None and ctx.verify_mode == ssl.CERT_REQUIRED
    answer = reader.read(w.job, "new", ctx)
    assert answer is not None and answer["globalVersion"] == 7
    subject = dict(kv for rdn in answer["peer"]["subject"] for kv in rdn)
    assert subject["commonName"] == "ddiloco-operator"
    # without the client certificate the synchronizer refuses the handshake
    plain = ssl.create_default_context(cadata=home_view.secrets["tj-trust"].data["ca.crt"].decode())
    w2 = StatusReader(settings)
    assert w2.read(w.job, "new", plain) is None
    # and a context not trusting the job's CA refuses the synchronizer
    assert StatusReader(settings).read(w.job, "new", ssl.create_default_context()) is None


def test_status_tls_is_cached_and_none_without_a_trust_secret() -> None:
    w = World(make_job())
    st = certs.StatusTLS()
    assert st.context(w.job, w.observe().clusters[home(w.job)], T0) is None
    w.step()
    view = w.observe().clusters[home(w.job)]
    first = st.context(w.job, view, T0)
    assert first is not None and st.context(w.job, view, T0) is first
    assert st.context(make_job(tls={"enabled": False}), view, T0) is None


def test_actions_never_put_a_secret_in_their_repr() -> None:
    w = World(make_job(tls={"mutual": True}))
    plan = w.step()
    text = repr(plan.actions)
    ca = w.pair(home(w.job), "tj-ca")
    assert ca.key_pem.decode().splitlines()[1] not in text
    assert all(isinstance(a, Action) for a in plan.actions)


def test_the_job_s_tls_secrets_are_named_ahead_so_none_is_listed() -> None:
    """RBAC grants no `list` on Secrets: every TLS Secret the job may hold is read by a name
    known from the spec and the last status, including slots that scaling removed."""
    home = Target(None, "ns")
    plain, mutual = make_job(), make_job(tls={"mutual": True})
    trust, ca, srv = (
        builders.trust_secret_name(plain),
        builders.ca_secret_name(plain),
        builders.tls_secret_name(plain),
    )
    assert certs.secret_names(plain, home) == [ca, srv, trust]
    assert certs.secret_names(plain, REMOTE) == [trust]
    clients = [builders.client_secret_name(mutual, "home", i) for i in range(2)]
    assert certs.secret_names(mutual, home) == [ca, srv, trust, *clients]
    assert certs.secret_names(mutual, REMOTE) == [
        trust,
        builders.client_secret_name(mutual, "ra", 0),
    ]
    # a slot the last status still had (scaled down since) is read too, to be pruned
    scaled = mutual.model_copy(
        update={
            "status": api.JobStatus.model_validate(
                {"groups": [{"name": "home", "cluster": "local", "parts": [0, 1, 2]}]}
            )
        }
    )
    assert certs.secret_names(scaled, home)[-1] == builders.client_secret_name(mutual, "home", 2)
    # the cleanup reads every slot's client name, also after mutual TLS was turned off
    assert certs.secret_names(plain, home, all_clients=True)[3:] == [
        builders.client_secret_name(plain, "home", i) for i in range(2)
    ]
