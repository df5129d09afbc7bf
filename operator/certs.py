"""TLS material of a job: who issues what, where it goes, and when it is renewed.

    tls = tls_plan(job, observed, plan)    # appends Secret / Certificate actions to plan
    tls.revision                           # digest of what the synchronizer serves and trusts

Pure like reconcile.py (the clock is `Observed.now`; new keys are the only randomness). With
`spec.synchronizer.tls.enabled` (the default):

    <job>-ca      home only        the job's CA: tls.crt, tls.key (the key never leaves the
                                   home namespace), ca.crt (the bundle: the current CA and,
                                   after a renewal, the previous one until it expires)
    <job>-tls     home only        the synchronizer's server certificate (kubernetes.io/tls:
                                   tls.crt, tls.key, ca.crt). SANs: the Service's names (short,
                                   .ns, .ns.svc, .ns.svc.cluster.local), spec.synchronizer.
                                   externalNames and the hosts of the groups' https syncUrls.
                                   With tls.issuer cert-manager, a Certificate of that name
                                   asks cert-manager for it instead (same Secret name).
    <job>-trust   home + regions   ca.crt: what learners verify the synchronizer against; with
                                   mutual TLS also client-ca.crt (the job's CA bundle), what
                                   the synchronizer verifies learners against. No keys.
    <pod>-client  the slot's       with tls.mutual: one client certificate per learner slot
                  cluster          (CN = learner id), kept across the slot's replacements.

Per slot rather than per group: the CN is then the learner id, so the synchronizer can tie a
connection to the learner it claims to be, and one leaked key is revoked by deleting one
Secret (the operator issues a new one). EC P-256 keys cost about a millisecond each, so a
few hundred slots are cheap.

Renewal: a certificate the operator issued is reissued once less than a third of the
validity the spec asks for (`certificateDays`) is left, when its SANs differ from the wanted
ones, or when the CA that signed it is no longer the current one. The CA lives
`CA_LIFETIME_FACTOR` times `certificateDays` and is renewed at the same third; learners and
the synchronizer trust the old and the new one meanwhile. The synchronizer loads its
certificate at startup, so a renewed one rolls its pod (`TlsPlan.revision`, on the pod
template); learners read theirs (pycurl) at each new connection.
"""

from __future__ import annotations

import hashlib
import ipaddress
import ssl
import tempfile
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from pathlib import Path
from typing import Any, Final
from urllib.parse import urlsplit

from cryptography import x509
from cryptography.exceptions import InvalidSignature

from ddiloco.operator import builders, evaluator_workload, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.plan import (
    Action,
    ClusterView,
    Observed,
    Plan,
    SecretView,
    Target,
    home,
    place,
    status_targets,
    target_of,
)
from ddiloco.operator.spares import serials_wanted
from ddiloco.wire import tls as x

CA_LIFETIME_FACTOR: Final = 10
RENEW_FRACTION: Final = 1 / 3
CERT_MANAGER_CRD: Final = "certificates.cert-manager.io"
CERT_MANAGER_MISSING: Final = "CertManagerNotInstalled"
CERT_PENDING: Final = "CertificatePending"
TLS_KEYS: Final = (builders.CERT_KEY, builders.KEY_KEY)


@dataclass
class TlsPlan:
    revision: str | None = None  # None: nothing to serve yet, or TLS off
    problems: list[tuple[str, str]] = field(default_factory=list)  # Degraded reasons, messages


# --------------------------------------------------------------------------- what to issue


def server_names(job: DecoupledDiLoCoJob) -> tuple[list[str], list[str]]:
    """(DNS names, IP addresses) of the server certificate, in a stable order."""
    names = builders.service_dns_names(job) + list(job.spec.synchronizer.external_names)
    for group in job.spec.learner_groups:
        for url in (group.sync_url or "").split(","):  # one URL per shard
            if url.startswith("https://") and (host := urlsplit(url).hostname):
                names.append(host)
    dns, ips = [], []
    for name in dict.fromkeys(names):
        try:
            ips.append(str(ipaddress.ip_address(name)))
        except ValueError:
            dns.append(name.lower())
    return list(dict.fromkeys(dns)), list(dict.fromkeys(ips))


def ca_common_name(job: DecoupledDiLoCoJob) -> str:
    """The CA's CN: namespace and job, or only the job where both exceed X.509's 64 characters
    (a namespace may have 63, a job name 40)."""
    cn = f"ddiloco {job.namespace}/{job.name} CA"
    return cn if len(cn) <= 64 else f"ddiloco {job.name} CA"


def needs_renewal(cert: x509.Certificate, now: datetime, days: int) -> bool:
    """Less than RENEW_FRACTION of `days` (the validity the spec asks for) left, or not valid
    now. Measured against the spec, not the certificate's own lifetime, so a certificate issued
    shorter (or put there by hand) is renewed at the same point."""
    start, end = cert.not_valid_before_utc, cert.not_valid_after_utc
    return now < start or end - now < timedelta(days=days) * RENEW_FRACTION


def issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    """True when `ca` signed `cert`. A certificate from another CA, including one that has the
    same name (a CA Secret recreated by hand, or the job's CA after a renewal), is simply not
    issued by it: that is a reason to reissue, never an error."""
    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def _pair(secret: SecretView | None) -> x.KeyPair | None:
    """The certificate and key of a Secret, if both are there and belong together."""
    if secret is None or not all(secret.data.get(k) for k in TLS_KEYS):
        return None
    try:
        return x.KeyPair.from_pem(secret.data[builders.CERT_KEY], secret.data[builders.KEY_KEY])
    except ValueError:
        return None


def _certs(pem: bytes | None) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(pem) if pem else []
    except ValueError:
        return []


def _pem(certs: list[x509.Certificate]) -> bytes:
    from cryptography.hazmat.primitives.serialization import Encoding

    return b"".join(cert.public_bytes(Encoding.PEM) for cert in certs)


def digest(*parts: bytes | None) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part or b"")
        h.update(b"\0")
    return h.hexdigest()[:16]


# --------------------------------------------------------------------------- the plan


class _Writer:
    """Creates or replaces the job's Secrets in one target, remembering which it wants."""

    def __init__(self, job: DecoupledDiLoCoJob, tgt: Target, view: ClusterView, plan: Plan):
        self.job, self.tgt, self.view, self.plan = job, tgt, view, plan
        self.wanted: set[str] = set()
        self.conflicts: list[tuple[str, str]] = []

    def want(self, name: str) -> SecretView | None:
        """Mark a Secret wanted; return it if it is this job's (None: absent or another's)."""
        self.wanted.add(name)
        secret = self.view.secrets.get(name)
        if secret is not None and secret.job_uid != self.job.uid:
            where = f"{self.tgt.namespace}/{name} in {self.tgt.label}"
            self.conflicts.append(
                (c.NAME_CONFLICT, f"Secret {where} belongs to another job of this name")
            )
            return None
        return secret

    def put(self, name: str, data: dict[str, bytes], annotations: dict[str, str] | None = None):
        secret = self.view.secrets.get(name)
        if secret is not None and secret.job_uid != self.job.uid:
            return  # reported by want(); never overwrite what is not ours
        if secret is not None and dict(secret.data) == data:
            return
        body = builders.build_tls_secret(
            self.job,
            name,
            data,
            self.tgt.namespace,
            owned=self.tgt.secret is None,
            annotations=annotations,
        )
        verb = "create" if secret is None else "replace"
        self.plan.actions.append(Action(verb, self.tgt, "Secret", name, body))

    def prune(self, also: set[str] | None = None) -> None:
        """Delete the job's TLS Secrets here that nothing wants any more (never the key nor
        the learners' credentials: tokens.py keeps those; nor the evaluator's, which
        evaluator_workload.py keeps; nor `also`, what another target at the same place wants)."""
        keep = self.wanted | (also or set()) | {builders.token_secret_name(self.job)}
        keep.add(evaluator_workload.evaluator_token_secret_name(self.job))
        keep |= set(tokens.secret_names(self.job, self.tgt).values())
        for name, secret in sorted(self.view.secrets.items()):
            if name not in keep and secret.job_uid == self.job.uid:
                self.plan.actions.append(Action("delete", self.tgt, "Secret", name))


def tls_plan(job: DecoupledDiLoCoJob, obs: Observed, plan: Plan) -> TlsPlan:
    """Append the actions that issue, copy, renew and prune the job's TLS Secrets."""
    out = TlsPlan()
    h = home(job)
    home_view = obs.clusters.get(h, ClusterView())
    if home_view.problem is not None:
        return out
    tls, now = job.spec.synchronizer.tls, obs.now
    writers = {t: _Writer(job, t, v, plan) for t, v in obs.clusters.items() if v.problem is None}
    hw = writers[h] if h in writers else _Writer(job, h, home_view, plan)
    writers[h] = hw
    if tls.enabled:
        ca, bundle = None, b""
        if tls.issuer == "operator" or tls.mutual:
            ca, bundle = _ca(job, hw, now)
        if tls.issuer == "operator":
            assert ca is not None
            server_crt, trust = _server(job, hw, ca, bundle, now), bundle
        else:
            server_crt, trust = _certificate(job, obs, hw, out)
        trust_data = {builders.CA_KEY: trust} if trust else {}
        if trust_data and tls.mutual:
            trust_data[builders.CLIENT_CA_KEY] = bundle
        targets = {h} | {target_of(job, g) for g in job.spec.learner_groups}
        for tgt in sorted(targets, key=lambda t: (t.secret is not None, t.label, t.namespace)):
            if tgt in writers:
                writers[tgt].want(builders.trust_secret_name(job))
                if trust_data:  # else: cert-manager has not issued yet; keep what is there
                    writers[tgt].put(builders.trust_secret_name(job), trust_data)
        if tls.mutual and ca is not None:
            _clients(job, writers, ca, now)
        if server_crt is not None and (trust or not tls.mutual):
            out.revision = digest(server_crt, bundle if tls.mutual else None)
    # one namespace reached through two targets (two kubeconfig Secrets for one cluster, one
    # pointing back home, a place a group left): what one wants there the other keeps
    wanted_at: dict[tuple[str, str], set[str]] = {}
    for t, w in writers.items():
        if (at := place(obs, t)) is not None:
            wanted_at.setdefault(at, set()).update(w.wanted)
    for t, w in writers.items():
        out.problems += [p for p in w.conflicts if p not in out.problems]
        at = place(obs, t)
        w.prune(wanted_at.get(at, set()) if at is not None else set())
    return out


def _ca(job: DecoupledDiLoCoJob, hw: _Writer, now: datetime) -> tuple[x.KeyPair, bytes]:
    """The job's current CA and the bundle to trust (current first, then the previous one)."""
    name = builders.ca_secret_name(job)
    secret = hw.want(name)
    pair = _pair(secret)
    bundle = _certs(secret.data.get(builders.CA_KEY)) if secret is not None else []
    days = job.spec.synchronizer.tls.certificate_days * CA_LIFETIME_FACTOR
    if pair is None or needs_renewal(pair.certificate, now, days):
        pair = x.issue_ca(ca_common_name(job), days=days)
    current = pair.certificate
    keep = [cert for cert in bundle if cert != current and cert.not_valid_after_utc > now]
    bundle_pem = _pem([current, *keep[:1]])
    hw.put(name, {builders.CERT_KEY: pair.cert_pem, builders.KEY_KEY: pair.key_pem,
                  builders.CA_KEY: bundle_pem})  # fmt: skip
    return pair, bundle_pem


def _server(
    job: DecoupledDiLoCoJob, hw: _Writer, ca: x.KeyPair, bundle: bytes, now: datetime
) -> bytes | None:
    name = builders.tls_secret_name(job)
    secret = hw.want(name)
    if secret is None and name in hw.view.secrets:
        return None  # another job's Secret holds the name (a conflict, reported)
    pair = _pair(secret)
    dns, ips = server_names(job)
    if (
        pair is None
        or needs_renewal(pair.certificate, now, job.spec.synchronizer.tls.certificate_days)
        or not issued_by(pair.certificate, ca.certificate)
        or sorted(pair.dns_names) != sorted(dns)
        or sorted(pair.ip_addresses) != sorted(ips)
    ):
        days = job.spec.synchronizer.tls.certificate_days
        pair = x.issue_server(ca, dns, ips, days=days)
    data = {builders.CERT_KEY: pair.cert_pem, builders.KEY_KEY: pair.key_pem,
            builders.CA_KEY: bundle}  # fmt: skip
    hw.put(name, data)
    return pair.cert_pem


def _certificate(
    job: DecoupledDiLoCoJob, obs: Observed, hw: _Writer, out: TlsPlan
) -> tuple[bytes | None, bytes | None]:
    """Ask cert-manager for the server certificate; (its tls.crt, its ca.crt) once issued."""
    name = builders.tls_secret_name(job)
    hw.wanted.add(name)  # cert-manager's, with the job's labels: never pruned, never written
    if not obs.cert_manager:
        out.problems.append(
            (
                CERT_MANAGER_MISSING,
                f"synchronizer.tls.issuer is cert-manager but its CRD {CERT_MANAGER_CRD} is "
                "not installed; install cert-manager or set issuer: operator",
            )
        )
        return None, None
    want = builders.build_certificate(job, *server_names(job))
    have = obs.certificate
    if have is None:
        hw.plan.actions.append(
            Action("create", hw.tgt, "Certificate", builders.certificate_name(job), want)
        )
    elif ((have.get("metadata") or {}).get("annotations") or {}).get(
        builders.ANNOTATION_SPEC_HASH
    ) != want["metadata"]["annotations"][builders.ANNOTATION_SPEC_HASH]:
        body = {**want, "metadata": {**want["metadata"],
                "resourceVersion": (have.get("metadata") or {}).get("resourceVersion")}}  # fmt: skip
        hw.plan.actions.append(
            Action("replace", hw.tgt, "Certificate", builders.certificate_name(job), body)
        )
    secret = hw.view.secrets.get(name)
    crt = secret.data.get(builders.CERT_KEY) if secret is not None else None
    ca = secret.data.get(builders.CA_KEY) if secret is not None else None
    if not crt:
        out.problems.append(
            (CERT_PENDING, f"Waiting for cert-manager to issue Secret {job.namespace}/{name}")
        )
        return None, None
    if not ca:
        out.problems.append(
            (
                CERT_PENDING,
                f"cert-manager's Secret {job.namespace}/{name} has no ca.crt for learners to "
                "verify the synchronizer against; use an issuer that writes one (CA, Vault, "
                "self-signed) or issuer: operator",
            )
        )
        return crt, None
    return crt, ca


def _clients(
    job: DecoupledDiLoCoJob, writers: Mapping[Target, _Writer], ca: x.KeyPair, now: datetime
) -> None:
    days = job.spec.synchronizer.tls.certificate_days
    for group in job.spec.learner_groups:
        w = writers.get(target_of(job, group))
        if w is None or not builders.uses_client_cert(job, group):
            continue
        for index in range(group.replicas):
            name = builders.client_secret_name(job, group.name, index)
            _client_cert(w, ca, name, builders.learner_id(group.name, index), now, days)
        # hot spares (spares.py): each its own, CN = its pod name, kept when it is promoted
        for serial in sorted(serials_wanted(job, group, w.view.pods)):
            name = builders.spare_client_secret_name(job, group.name, serial)
            _client_cert(w, ca, name, builders.spare_pod_name(job, group.name, serial), now, days)


def _client_cert(w: _Writer, ca: x.KeyPair, name: str, cn: str, now: datetime, days: int) -> None:
    """Keep Secret `name` holding a client certificate for `cn` from `ca`: the one it has
    unless it names another CN, is due for renewal or was issued by another CA."""
    pair = _pair(w.want(name))
    if (
        pair is None
        or pair.common_name != cn
        or needs_renewal(pair.certificate, now, days)
        or not issued_by(pair.certificate, ca.certificate)
    ):
        pair = x.issue_client(ca, cn, days=days)
    w.put(name, {builders.CERT_KEY: pair.cert_pem, builders.KEY_KEY: pair.key_pem})


# --------------------------------------------------------------------------- the operator as a client


class StatusTLS:
    """TLS contexts for the operator's own GET /v1/status, per job: verified against the job's
    trust bundle and, with mutual TLS, presenting a client certificate the operator issues
    itself from the job's CA (CN ddiloco-operator), kept in memory and renewed like the rest."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[str, ssl.SSLContext, datetime]] = {}

    def context(
        self, job: DecoupledDiLoCoJob, home_view: ClusterView, now: datetime
    ) -> ssl.SSLContext | None:
        tls = job.spec.synchronizer.tls
        if not tls.enabled:
            return None
        trust = home_view.secrets.get(builders.trust_secret_name(job))
        cadata = trust.data.get(builders.CA_KEY) if trust is not None else None
        if not cadata:
            return None
        ca = _pair(home_view.secrets.get(builders.ca_secret_name(job))) if tls.mutual else None
        if tls.mutual and ca is None:
            return None
        key = digest(cadata, ca.cert_pem if ca is not None else None)
        with self._lock:
            cached = self._cache.get(job.uid)
        if cached is not None and cached[0] == key and cached[2] > now:
            return cached[1]
        ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=cadata.decode())
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        valid_until = now + timedelta(days=365)
        if ca is not None:
            client = x.issue_client(ca, "ddiloco-operator", days=tls.certificate_days)
            with tempfile.TemporaryDirectory(prefix="ddiloco-op-") as d:
                crt, key_file = x.write_pair(client, Path(d) / "tls.crt", Path(d) / "tls.key")
                ctx.load_cert_chain(crt, key_file)  # read now; the files may go
            start, end = client.not_before, client.not_after
            valid_until = end - (end - start) * RENEW_FRACTION
        with self._lock:
            self._cache[job.uid] = (key, ctx, valid_until)
        return ctx

    def forget(self, uid: str) -> None:
        with self._lock:
            self._cache.pop(uid, None)


# --------------------------------------------------------------------------- observation (I/O)


def secret_names(job: DecoupledDiLoCoJob, tgt: Target, *, all_clients: bool = False) -> list[str]:
    """The names the job's TLS Secrets can have in one target, so that each is read by name
    (RBAC `get`) and nothing has to list a namespace's Secrets: at home the CA and the server
    certificate, everywhere the trust bundle, and with mutual TLS (or `all_clients`, for the
    cleanup) the client certificate of every slot the spec or the last status has there."""
    names = [builders.trust_secret_name(job)]
    if tgt.is_home:
        names = [builders.ca_secret_name(job), builders.tls_secret_name(job), *names]
    mutual = job.spec is not None and job.spec.synchronizer.tls.mutual
    if not (mutual or all_clients):
        return names
    slots: dict[str, int] = {}
    for g in job.spec.learner_groups if job.spec is not None else []:
        if target_of(job, g) == tgt:
            slots[g.name] = max(slots.get(g.name, 0), g.replicas)
    for gs in job.status.groups:
        if tgt in status_targets(job, gs):
            slots[gs.name] = max(slots.get(gs.name, 0), len(gs.parts), gs.desired)
    names += [
        builders.client_secret_name(job, g, i) for g, n in sorted(slots.items()) for i in range(n)
    ]
    # hot spares' own (spares.py): serials stay below the group's pods born spares plus
    # hotSpares, at most slots + 2 hotSpares (the cleanup: the spec's, or the status' spares)
    hot = job.spec.failure_policy.hot_spares if job.spec is not None else 0
    had = {gs.name: gs for gs in job.status.groups if gs.spares or gs.promoted}
    spare_slots = {
        g: max(n + 2 * hot, len(had[g].parts) + 2 * had[g].spares if g in had else 0)
        for g, n in slots.items()
        if hot or g in had
    }
    names += [
        builders.spare_client_secret_name(job, g, k)
        for g, n in sorted(spare_slots.items())
        for k in range(n)
    ]
    return names


def observe_secrets(
    core: Any, job: DecoupledDiLoCoJob, tgt: Target, timeout: float
) -> dict[str, SecretView]:
    """The job's TLS Secrets in one target, each read by name (`secret_names`). A Secret of
    that name the job did not make is left out: writing it then meets the apiserver's
    AlreadyExists, a NameConflict, instead of overwriting someone else's object. (The token
    Secret is read once by the runtime, which adds it.)"""
    from kubernetes.client.exceptions import ApiException

    out: dict[str, SecretView] = {}
    for name in secret_names(job, tgt):
        try:
            item = core.read_namespaced_secret(name, tgt.namespace, _request_timeout=timeout)
        except ApiException as e:
            if e.status == 404:
                continue
            raise
        if not builders.made_by(job, item.metadata):
            continue
        out[name] = SecretView.from_k8s(core.api_client.sanitize_for_serialization(item))
    return out


def observe_cert_manager(
    client: Any, job: DecoupledDiLoCoJob, timeout: float
) -> tuple[bool, dict[str, Any] | None]:
    """(cert-manager's Certificate CRD is installed, the job's Certificate or None); looked at
    only for a job whose tls.issuer is cert-manager."""
    import kubernetes
    from kubernetes.client.exceptions import ApiException

    tls = job.spec.synchronizer.tls
    if not (tls.enabled and tls.issuer == "cert-manager"):
        return False, None
    try:
        kubernetes.client.ApiextensionsV1Api(client).read_custom_resource_definition(
            CERT_MANAGER_CRD, _request_timeout=timeout
        )
    except ApiException as e:
        if e.status == 404:
            return False, None
        raise
    try:
        cert = kubernetes.client.CustomObjectsApi(client).get_namespaced_custom_object(
            "cert-manager.io",
            "v1",
            job.namespace,
            "certificates",
            builders.certificate_name(job),
            _request_timeout=timeout,
        )
    except ApiException as e:
        if e.status == 404:
            return True, None
        raise
    return True, dict(cert)
