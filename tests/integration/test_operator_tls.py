"""TLS on the control plane: the operator's certificates, Secrets and mounts on real apiservers.

    python tests/integration/k8senv.py build          # once per machine
    .venv/bin/pytest tests/integration/test_operator_tls.py

Three clusters (home, region-a, region-b). The operator issues a CA and a server certificate
per job, copies the CA (never its key) into every region its learners run in, gives every
learner slot a client certificate with mutual TLS, renews what nears expiry, asks cert-manager
instead when told to (its CRD installed here, no controller: the test plays cert-manager), and
rotates the job key, and the learners' credentials derived from it, without restarting a pod. Pods never run containers (kwok), so the checks
are on the objects: the Secrets' keys and parsed certificates, the env and volumes of the pods.
"""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta
from typing import Any

import k8senv
import operator_helpers as h
import pytest
import yaml
from cryptography import x509
from kubernetes.client.exceptions import ApiException
from operator_helpers import cl_fixture, crd_fixture, operator_fixture  # noqa: F401  (fixtures)

from ddiloco.wire import auth
from ddiloco.wire import tls as x

pytestmark = pytest.mark.integration
SYNC_HOST = "sync.tls-test.example.com"
CERT_MANAGER_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1",
    "kind": "CustomResourceDefinition",
    "metadata": {"name": "certificates.cert-manager.io"},
    "spec": {
        "group": "cert-manager.io",
        "scope": "Namespaced",
        "names": {
            "kind": "Certificate",
            "listKind": "CertificateList",
            "plural": "certificates",
            "singular": "certificate",
        },
        "versions": [
            {
                "name": "v1",
                "served": True,
                "storage": True,
                "schema": {
                    "openAPIV3Schema": {
                        "type": "object",
                        "x-kubernetes-preserve-unknown-fields": True,
                    }
                },
            }
        ],
    },
}


def tls_job(name: str, tls: dict[str, Any] | None = None, **sync: Any) -> dict[str, Any]:
    group = h.remote("region-a", 1)
    group["syncUrl"] = f"https://{SYNC_HOST}:8470"
    body = h.job_manifest(name, [{"name": "a", "replicas": 1}, group])
    body["spec"]["synchronizer"].update(
        {"externalNames": ["lb.tls-test.example.net", "198.51.100.9"], **sync}
    )
    if tls is not None:
        body["spec"]["synchronizer"]["tls"] = tls
    return body


def data(secret: Any) -> dict[str, bytes]:
    return {k: base64.b64decode(v) for k, v in (secret.data or {}).items()}


def secret(cl: h.Clusters, cluster: str, name: str) -> Any:
    return cl.core(cluster).read_namespaced_secret(name, cl.ns)


def wait_secret(cl: h.Clusters, cluster: str, name: str, timeout: float = 30) -> Any:
    return k8senv.wait_until(
        f"Secret {name} in {cluster}", lambda: secret(cl, cluster, name), timeout
    )


def ready(cl: h.Clusters, operator: h.Operator, job: str) -> dict[str, Any]:
    try:
        return h.wait_condition(cl, job, "Ready", timeout=60)
    except TimeoutError as e:
        raise TimeoutError(f"{e}\noperator log:\n{operator.tail(80)}") from None


def learner(cl: h.Clusters, cluster: str, job: str) -> Any:
    (pod,) = cl.pods(cluster, job)
    return pod


def env_of(container: Any) -> dict[str, str | None]:
    return {e.name: e.value for e in container.env}


def secret_mounts(pod_spec: Any) -> dict[str, str]:
    """mount path -> Secret name of a pod spec's (single) container."""
    secrets = {v.name: v.secret.secret_name for v in pod_spec.volumes if v.secret is not None}
    (ctr,) = pod_spec.containers
    out = {}
    for m in ctr.volume_mounts or []:
        if m.name in secrets:
            assert m.read_only and not m.sub_path, m  # a subPath mount never sees an update
            out[m.mount_path] = secrets[m.name]
    return out


def test_the_job_gets_its_ca_certificates_and_mounts_everywhere(
    cl: h.Clusters, operator: h.Operator
) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(cl, tls_job("tls", {"mutual": True}))
    ready(cl, operator, job)

    # home: the CA (with its key), the server certificate, the trust bundle
    ca_secret = secret(cl, "home", f"{job}-ca")
    ca = x.KeyPair.from_pem(data(ca_secret)["tls.crt"], data(ca_secret)["tls.key"])
    assert ca.certificate.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    assert ca_secret.metadata.labels["ddiloco.dev/job-uid"] == cl.job(job)["metadata"]["uid"]
    assert ca_secret.metadata.owner_references[0].name == job
    server_secret = secret(cl, "home", f"{job}-tls")
    assert server_secret.type == "kubernetes.io/tls"
    assert set(data(server_secret)) == {"tls.crt", "tls.key", "ca.crt"}
    server = x.KeyPair.from_pem(data(server_secret)["tls.crt"], data(server_secret)["tls.key"])
    server.certificate.verify_directly_issued_by(ca.certificate)
    svc = f"{job}-synchronizer"
    assert sorted(server.dns_names) == sorted(
        [
            svc,
            f"{svc}.{cl.ns}",
            f"{svc}.{cl.ns}.svc",
            f"{svc}.{cl.ns}.svc.cluster.local",
            "lb.tls-test.example.net",
            SYNC_HOST,  # the remote group's syncUrl host
        ]
    )
    assert server.ip_addresses == ["198.51.100.9"]
    assert server.not_after - datetime.now(UTC) > timedelta(days=89)

    # every cluster with learners: the trust bundle, no key; each slot its client certificate
    for cluster, lid in (("home", "a-0"), ("region-a", "region-a-0")):
        trust = wait_secret(cl, cluster, f"{job}-trust")
        assert set(data(trust)) == {"ca.crt", "client-ca.crt"}
        assert data(trust)["ca.crt"] == ca.cert_pem
        pod = learner(cl, cluster, job)
        mounts = secret_mounts(pod.spec)
        client_name = mounts["/var/run/ddiloco/client"]
        client_secret = secret(cl, cluster, client_name)
        client = x.KeyPair.from_pem(data(client_secret)["tls.crt"], data(client_secret)["tls.key"])
        assert client.common_name == lid
        client.certificate.verify_directly_issued_by(ca.certificate)
        creds, _ = h.learner_credentials(cl, cluster, job, "a" if cluster == "home" else cluster)
        assert mounts == {
            "/var/run/ddiloco/token": creds,  # its own credential: one item, never the key
            "/var/run/ddiloco/trust": f"{job}-trust",
            "/var/run/ddiloco/client": client_name,
        }
        assert h.check_own_credential(cl, cluster, job, pod) == lid
        env = env_of(pod.spec.containers[0])
        assert env["DDILOCO_SYNC_URL"].startswith("https://")
        assert env["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
        assert env["DDILOCO_CA_FILE"] == "/var/run/ddiloco/trust/ca.crt"
        assert env["DDILOCO_CLIENT_CERT_FILE"] == "/var/run/ddiloco/client/tls.crt"
        assert env["DDILOCO_CLIENT_KEY_FILE"] == "/var/run/ddiloco/client/tls.key"
        assert "DDILOCO_TOKEN" not in env
    assert env_of(learner(cl, "home", job).spec.containers[0])["DDILOCO_SYNC_URL"] == (
        f"https://{svc}.{cl.ns}.svc:8470"
    )
    region = cl.core("region-a").list_namespaced_secret(cl.ns).items
    assert {s.metadata.name for s in region if s.metadata.name.startswith(job)} == {
        f"{job}-trust",
        secret_mounts(learner(cl, "region-a", job).spec)["/var/run/ddiloco/client"],
        secret_mounts(learner(cl, "region-a", job).spec)["/var/run/ddiloco/token"],
    }, "the CA's key, the server's key and the job key never leave home"
    other = cl.core("region-b").list_namespaced_secret(cl.ns).items
    assert not [s for s in other if s.metadata.name.startswith(job)], "no learners there"

    # the synchronizer serves the server certificate and checks client certificates
    dep = cl.apps().read_namespaced_stateful_set(svc, cl.ns)
    pod_spec = dep.spec.template.spec
    env = env_of(pod_spec.containers[0])
    assert env["DDILOCO_TLS_CERT_FILE"] == "/var/run/ddiloco/tls/tls.crt"
    assert env["DDILOCO_TLS_KEY_FILE"] == "/var/run/ddiloco/tls/tls.key"
    assert env["DDILOCO_TLS_CLIENT_CA_FILE"] == "/var/run/ddiloco/trust/client-ca.crt"
    assert env["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
    assert secret_mounts(pod_spec) == {
        "/var/run/ddiloco/token": f"{job}-token",
        "/var/run/ddiloco/tls": f"{job}-tls",
        "/var/run/ddiloco/trust": f"{job}-trust",
    }
    assert pod_spec.containers[0].readiness_probe.tcp_socket is not None  # kubelet: no client cert
    assert dep.spec.template.metadata.annotations["ddiloco.dev/tls-revision"]
    ports = cl.core().read_namespaced_service(svc, cl.ns).spec.ports
    assert [(p.name, p.app_protocol) for p in ports] == [("http", "https"), ("upload", "https")]

    # deleting the job removes the copies in the region too (no owner references there)
    h.delete_jobs(cl, operator)
    left = [s.metadata.name for s in cl.core("region-a").list_namespaced_secret(cl.ns).items]
    assert not [n for n in left if n.startswith(f"{job}-")], left


@pytest.mark.parametrize(
    ("url", "insecure", "refused"),
    [
        ("http://sync.example.com:8470", None, True),
        ("http://sync.example.com:8470", True, False),
        ("https://sync.example.com:8470", None, False),
    ],
    ids=["http-refused", "http-insecure", "https"],
)
def test_a_remote_http_sync_url_needs_insecure(
    cl: h.Clusters, url: str, insecure: bool | None, refused: bool
) -> None:
    group = h.remote("region-a", 1)
    group["syncUrl"] = url
    if insecure is not None:
        group["insecure"] = insecure
    body = h.job_manifest("plain", [group])
    done = cl.kubectl("apply", "-f", "-", input=yaml.safe_dump(body), check=False)
    if refused:
        assert done.returncode != 0
        assert "a learner group in another cluster needs an https:// syncUrl" in done.stderr
        assert "set insecure: true on the group to allow http://" in done.stderr
        assert "plain" not in cl.kubectl("get", "ddj", "-o", "name").stdout
    else:
        assert done.returncode == 0, done.stderr
        cl.kubectl("delete", "ddj", "plain", "--wait=false")


def test_a_certificate_near_expiry_is_renewed(cl: h.Clusters, operator: h.Operator) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(cl, tls_job("renew"))
    ready(cl, operator, job)
    svc = f"{job}-synchronizer"
    revision = cl.apps().read_namespaced_stateful_set(svc, cl.ns).spec.template.metadata.annotations
    pods = h.running_uids(cl, ["home", "region-a"], job)
    ca_data = data(secret(cl, "home", f"{job}-ca"))
    ca = x.KeyPair.from_pem(ca_data["tls.crt"], ca_data["tls.key"])
    # a certificate from the job's CA with its names, but a day from expiry
    old = secret(cl, "home", f"{job}-tls")
    dns = x.KeyPair.from_pem(data(old)["tls.crt"], data(old)["tls.key"]).dns_names
    short = x.issue_server(ca, dns, ["198.51.100.9"], days=1)
    old.data = {
        "tls.crt": base64.b64encode(short.cert_pem).decode(),
        "tls.key": base64.b64encode(short.key_pem).decode(),
        "ca.crt": base64.b64encode(ca.cert_pem).decode(),
    }
    cl.core().replace_namespaced_secret(f"{job}-tls", cl.ns, old)

    def renewed() -> x.KeyPair | None:
        d = data(secret(cl, "home", f"{job}-tls"))
        pair = x.KeyPair.from_pem(d["tls.crt"], d["tls.key"])
        return pair if pair.not_after - datetime.now(UTC) > timedelta(days=60) else None

    fresh = k8senv.wait_until("the renewed certificate", renewed, timeout=30)
    assert fresh.cert_pem != short.cert_pem and sorted(fresh.dns_names) == sorted(dns)
    fresh.certificate.verify_directly_issued_by(ca.certificate)
    # the synchronizer loads its certificate at startup: its pod template changes (a new pod)
    k8senv.wait_until(
        "the synchronizer rolled to the new certificate",
        lambda: (
            cl.apps().read_namespaced_stateful_set(svc, cl.ns).spec.template.metadata.annotations
            != revision
        ),
        timeout=30,
    )
    # the learners keep running: their CA did not change
    assert h.running_uids(cl, ["home", "region-a"], job) == pods


def test_a_ca_deleted_live_is_made_again_and_every_certificate_follows_it(
    cl: h.Clusters, operator: h.Operator
) -> None:
    """The job's reconcile survives certificates not signed by its current CA: deleting
    `<job>-ca` live makes a new CA, and the server certificate is reissued by it (checking
    the old one against the new CA must not raise: it had, every pass, for good)."""
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(cl, tls_job("newca"))
    ready(cl, operator, job)
    old_ca = data(secret(cl, "home", f"{job}-ca"))["tls.crt"]
    cl.core().delete_namespaced_secret(f"{job}-ca", cl.ns)

    def reissued() -> x.KeyPair | None:
        try:
            ca = data(secret(cl, "home", f"{job}-ca"))
            d = data(secret(cl, "home", f"{job}-tls"))
        except ApiException:
            return None
        if ca["tls.crt"] == old_ca:
            return None
        pair = x.KeyPair.from_pem(d["tls.crt"], d["tls.key"])
        authority = x.KeyPair.from_pem(ca["tls.crt"], ca["tls.key"])
        try:
            pair.certificate.verify_directly_issued_by(authority.certificate)
        except Exception:
            return None
        return pair

    k8senv.wait_until("a server certificate from the new CA", reissued, timeout=60)
    ready(cl, operator, job)  # the job is reconciled again, not stuck
    assert "AttributeError" not in operator.log.read_text(), operator.tail()


def token_lines(cl: h.Clusters, cluster: str, job: str) -> list[str]:
    """What a cluster's token file holds: at home the job key, in region-a the credential of
    its one learner (region-a-0)."""
    if cluster == "home":
        return h.job_key(cl, job)
    _, items = h.learner_credentials(cl, cluster, job, "region-a")
    return items["region-a-0"].splitlines()


def test_the_token_rotates_without_restarting_a_pod(cl: h.Clusters, operator: h.Operator) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    job = h.create_job(cl, tls_job("rotate", tokenRotationGraceSeconds=3))
    ready(cl, operator, job)
    clusters = ["home", "region-a"]
    pods = h.running_uids(cl, clusters, job)
    assert len(pods) == 2
    sync_pods = cl.core().list_namespaced_pod(
        cl.ns, label_selector=f"ddiloco.dev/job={job},app.kubernetes.io/component=synchronizer"
    )
    sync_uids = sorted(p.metadata.uid for p in sync_pods.items)
    dep_generation = (
        cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns).metadata.generation
    )
    (old,) = token_lines(cl, "home", job)
    assert token_lines(cl, "region-a", job) == [auth.learner_token(old, "region-a-0")]
    assert f"{job}-token" not in h.job_secret_names(cl, "region-a", job)

    cl.kubectl("annotate", "ddj", job, "ddiloco.dev/rotate-token=first", "--overwrite")
    both = k8senv.wait_until(
        "the new token beside the old one everywhere",
        lambda: (
            all(len(token_lines(cl, c, job)) == 2 for c in clusters)
            and token_lines(cl, "home", job)
        ),
        timeout=20,
    )
    new = both[0]
    assert both == [new, old] and new != old
    # the region's learner: its own credential under both keys, the new one first
    assert token_lines(cl, "region-a", job) == [
        auth.learner_token(new, "region-a-0"),
        auth.learner_token(old, "region-a-0"),
    ]
    _, home_items = h.learner_credentials(cl, "home", job, "a")
    assert home_items["a-0"] == auth.derived_lines([new, old], "learner", "a-0")
    notes = secret(cl, "home", f"{job}-token").metadata.annotations
    assert notes["ddiloco.dev/token-rotation"] == "first"
    k8senv.wait_until(
        "the old token dropped everywhere",
        lambda: (
            token_lines(cl, "home", job) == [new]
            and token_lines(cl, "region-a", job) == [auth.learner_token(new, "region-a-0")]
        ),
        timeout=30,
    )
    # the same annotation value is not acted on twice
    assert token_lines(cl, "home", job) == [new]
    # nothing restarted: same learner pods, same synchronizer pod and StatefulSet generation
    assert h.running_uids(cl, clusters, job) == pods
    again = cl.core().list_namespaced_pod(
        cl.ns, label_selector=f"ddiloco.dev/job={job},app.kubernetes.io/component=synchronizer"
    )
    assert sorted(p.metadata.uid for p in again.items) == sync_uids
    dep = cl.apps().read_namespaced_stateful_set(f"{job}-synchronizer", cl.ns)
    assert dep.metadata.generation == dep_generation
    reasons = {
        e.reason
        for e in cl.core().list_namespaced_event(cl.ns).items
        if e.involved_object.name == job
    }
    assert {"TokenRotating", "TokenRotated"} <= reasons
    assert old not in operator.log.read_text() and new not in operator.log.read_text()


def test_cert_manager_issues_when_asked_and_installed(
    k8s: Any, cl: h.Clusters, operator: h.Operator
) -> None:
    h.kubeconfig_secret(cl, "region-a-kubeconfig", "region-a")
    tls = {"issuer": "cert-manager", "issuerRef": {"name": "team-ca", "kind": "ClusterIssuer"}}
    job = h.create_job(cl, tls_job("cm", tls))
    try:
        # no cert-manager yet: the job says so
        h.wait_condition(cl, job, "Degraded", reason="CertManagerNotInstalled", timeout=30)
        k8s.kubectl("home", "apply", "-f", "-", input=yaml.safe_dump(CERT_MANAGER_CRD))
        k8s.kubectl(
            "home",
            "wait",
            "--for=condition=Established",
            "--timeout=60s",
            "crd/certificates.cert-manager.io",
        )
        cert = k8senv.wait_until(
            "the Certificate",
            lambda: cl.custom().get_namespaced_custom_object(
                "cert-manager.io", "v1", cl.ns, "certificates", f"{job}-tls"
            ),
            timeout=30,
        )
        spec = cert["spec"]
        svc = f"{job}-synchronizer"
        assert spec["secretName"] == f"{job}-tls"
        assert spec["issuerRef"] == {
            "name": "team-ca",
            "kind": "ClusterIssuer",
            "group": "cert-manager.io",
        }
        assert f"{svc}.{cl.ns}.svc" in spec["dnsNames"] and SYNC_HOST in spec["dnsNames"]
        assert spec["ipAddresses"] == ["198.51.100.9"]
        uid = cl.job(job)["metadata"]["uid"]
        assert spec["secretTemplate"]["labels"]["ddiloco.dev/job-uid"] == uid
        assert cert["metadata"]["ownerReferences"][0]["uid"] == uid
        # the synchronizer mounts the Secret the Certificate names; no CA of the operator's
        dep = cl.apps().read_namespaced_stateful_set(svc, cl.ns)
        assert secret_mounts(dep.spec.template.spec)["/var/run/ddiloco/tls"] == spec["secretName"]
        with pytest.raises(ApiException):
            secret(cl, "home", f"{job}-ca")
        h.wait_condition(cl, job, "Degraded", reason="CertificatePending", timeout=30)

        # play cert-manager: issue into the Secret, labelled from secretTemplate
        issuer = x.issue_ca("team-ca")
        server = x.issue_server(issuer, spec["dnsNames"], spec["ipAddresses"])
        cl.core().create_namespaced_secret(
            cl.ns,
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "type": "kubernetes.io/tls",
                "metadata": {"name": spec["secretName"], **spec["secretTemplate"]},
                "data": {
                    "tls.crt": base64.b64encode(server.cert_pem).decode(),
                    "tls.key": base64.b64encode(server.key_pem).decode(),
                    "ca.crt": base64.b64encode(issuer.cert_pem).decode(),
                },
            },
        )
        for cluster in ("home", "region-a"):
            trust = wait_secret(cl, cluster, f"{job}-trust")
            assert data(trust) == {"ca.crt": issuer.cert_pem}
        h.wait_condition(cl, job, "Degraded", "False", timeout=30)
        # the operator never overwrote cert-manager's Secret
        assert data(secret(cl, "home", f"{job}-tls"))["tls.crt"] == server.cert_pem
    finally:
        h.delete_jobs(cl, operator)
        k8s.kubectl(
            "home",
            "delete",
            "crd",
            "certificates.cert-manager.io",
            "--ignore-not-found",
            "--wait=false",
        )
