"""Manifests of everything a DecoupledDiLoCoJob owns, as plain dicts (like dask's build_*_spec).

    from ddiloco.operator import builders
    pod = builders.build_learner_pod(job, group, index)     # what the operator would create

Pure functions of the job (and, for Secrets, the token): no API calls, no clock. reconcile.py
decides which of them to create; clusters.py sends them. The synchronizer and learner are
configured only through environment variables (the contract of `ddiloco synchronizer` and
`ddiloco learner`); the credentials, certificates and keys reach them as files of mounted
Secrets, never through the pod spec, so a rotated token or a renewed certificate arrives
without a new pod (the kubelet updates mounted Secrets in place; environment variables it
never updates).

Credentials (operator/tokens.py): the job key, `<job>-token`, is mounted by the synchronizer
alone. A learner pod mounts one item of its group's credentials Secret
(`learner_tokens_secret_name`): its learner id's credential, which speaks for that id alone; a
hot spare mounts its own spare credential (`spare_token_key`), which reads only its own
assignment.

The synchronizer's own workload is built in sync_workload.py. It is a StatefulSet `<job>-synchronizer` of `synchronizer.shards`
(S) pods, `<job>-synchronizer-<i>` for shard i (DDILOCO_SHARD from the pod-index label), each
with its own state claim `state-<job>-synchronizer-<i>` (volumeClaimTemplates, deleted with
the StatefulSet). The headless Service `<job>-synchronizer-shards` gives each shard its DNS
name, which learners of a job with S > 1 get, comma-separated in shard order, as
DDILOCO_SYNC_URL. The ClusterIP Service `<job>-synchronizer` stays: with S = 1 it is the
learners' URL, with S > 1 it reaches shard 0 only (status, port-forward, spares).

TLS (operator/certs.py issues and renews): Secret `<job>-tls` holds the
synchronizer's server certificate (tls.crt, tls.key, ca.crt), `<job>-trust` the CA bundle a
learner verifies it against (ca.crt; with mutual TLS also client-ca.crt, what the synchronizer
verifies learners against), in the home namespace and in every remote one, and with mutual
TLS `<pod>-client` each learner slot's client certificate.
"""

from __future__ import annotations

import base64
import hashlib
import json
from collections.abc import Iterable
from typing import Any, Final

from ddiloco.operator import compute
from ddiloco.operator.api import DecoupledDiLoCoJob, LearnerGroup, PodTemplate, Training

SYNC_PORT: Final = 8470
SYNC_UPLOAD_PORT: Final = 8471
"""The synchronizer's upload port (port name "upload"): update bodies only, HTTP/1.1 or HTTPS."""
LEARNER_METRICS_PORT: Final = 9400
"""Learner and spare pods serve Prometheus metrics here (port name "metrics")."""
STATE_DIR: Final = "/var/lib/ddiloco"
TOKEN_KEY: Final = "token"
TOKEN_DIR: Final = "/var/run/ddiloco/token"
TLS_DIR: Final = "/var/run/ddiloco/tls"
TRUST_DIR: Final = "/var/run/ddiloco/trust"
CLIENT_DIR: Final = "/var/run/ddiloco/client"
CA_KEY: Final = "ca.crt"  # the CA bundle, in every TLS Secret (cert-manager's key name)
CLIENT_CA_KEY: Final = "client-ca.crt"  # in <job>-trust with mutual TLS
CERT_KEY: Final = "tls.crt"
KEY_KEY: Final = "tls.key"

# Labels: the recommended app.kubernetes.io set, plus ours to select a job's objects. The job's
# uid tells a pod of this job from a leftover of an earlier job with the same name.
LABEL_JOB: Final = "ddiloco.dev/job"
LABEL_JOB_UID: Final = "ddiloco.dev/job-uid"
LABEL_GROUP: Final = "ddiloco.dev/group"
LABEL_SLOT: Final = "ddiloco.dev/slot"
LABEL_LEARNER_ID: Final = "ddiloco.dev/learner-id"
# A learner pod's data part ("<shard>-of-<count>") and which incarnation of its slot it is (0
# for the first pod, n for the n-th replacement): reconcile.py reads both back from the pod.
LABEL_DATA_PART: Final = "ddiloco.dev/data-part"
LABEL_ATTEMPT: Final = "ddiloco.dev/attempt"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
# Hot spares (failurePolicy.hotSpares, operator/spares.py): a spare pod carries role "spare"
# and no slot labels; promoting it patches role to "learner" and adds the slot's labels. Its
# serial (LABEL_SPARE, in its name too) stays, so a promoted spare is still known as one.
LABEL_ROLE: Final = "ddiloco.dev/role"
LABEL_SPARE: Final = "ddiloco.dev/spare"
ROLE_SPARE: Final = "spare"
ROLE_LEARNER: Final = "learner"
ANNOTATION_PROMOTED_AT: Final = "ddiloco.dev/promoted-at"
SPARE_READY_FILE: Final = "/tmp/ddiloco-spare-ready"  # learner/spare.py writes it once warm
ANNOTATION_SPEC_HASH: Final = "ddiloco.dev/spec-hash"
# On the synchronizer's pod template: a digest of the certificates it serves and trusts. The
# synchronizer loads them at startup, so a renewed certificate rolls its pod (the token, which
# it re-reads, does not).
ANNOTATION_TLS_REVISION: Final = "ddiloco.dev/tls-revision"
MANAGED_BY: Final = "ddiloco-operator"


def token_secret_name(job: DecoupledDiLoCoJob) -> str:
    """The job key: home only, mounted by the synchronizer, read by the operator."""
    return f"{job.name}-token"


def learner_tokens_secret_name(job: DecoupledDiLoCoJob, group: str) -> str:
    """`<job>-<group>-tokens-<tag>`: a group's learner and spare credentials, in the group's
    cluster, one item per learner id and per spare pod (each pod mounts its own item only).
    One Secret per group keeps it well below the apiserver's 1 MiB for the largest group
    (512 slots and their spares, two lines each during a rotation); the tag, as for pod
    names, keeps two jobs' Secrets apart in a namespace they share."""
    return _tagged_pod_name(job, group, "tokens")


def spare_token_key(pod: str) -> str:
    """The item of a hot spare's credential in its group's credentials Secret. Learner ids
    (`<group>-<index>`) never hold a dot, so the two kinds of item cannot meet."""
    return f"spare.{pod}"


def synchronizer_name(job: DecoupledDiLoCoJob) -> str:
    return f"{job.name}-synchronizer"


def ca_secret_name(job: DecoupledDiLoCoJob) -> str:
    """The job's CA, certificate and key: home namespace only."""
    return f"{job.name}-ca"


def tls_secret_name(job: DecoupledDiLoCoJob) -> str:
    """The synchronizer's server certificate (kubernetes.io/tls); cert-manager's secretName."""
    return f"{job.name}-tls"


def trust_secret_name(job: DecoupledDiLoCoJob) -> str:
    """CA certificates only (no key): what learners verify the synchronizer against."""
    return f"{job.name}-trust"


def certificate_name(job: DecoupledDiLoCoJob) -> str:
    """The cert-manager Certificate, with tls.issuer cert-manager."""
    return f"{job.name}-tls"


def client_secret_name(job: DecoupledDiLoCoJob, group: str, index: int) -> str:
    """A learner slot's client certificate (mutual TLS); it outlives the slot's pods."""
    return f"{learner_pod_name(job, group, index)}-client"


def spare_pod_name(job: DecoupledDiLoCoJob, group: str, serial: int) -> str:
    """`<job>-<group>-spare-<serial>-<tag>`: a hot spare of a group (the tag as for slots).
    A promoted spare keeps its name; the next spare takes the lowest serial not in use."""
    return _tagged_pod_name(job, group, f"spare-{serial}")


def spare_client_secret_name(job: DecoupledDiLoCoJob, group: str, serial: int) -> str:
    """A hot spare's own client certificate (mutual TLS, CN = its pod name): it keeps it
    when promoted, so no slot's key is ever mounted into another pod."""
    return f"{spare_pod_name(job, group, serial)}-client"


STATE_TEMPLATE: Final = "state"  # the StatefulSet's volumeClaimTemplate (and volume) name
LABEL_POD_INDEX: Final = "apps.kubernetes.io/pod-index"  # set by the StatefulSet controller


def shards_service_name(job: DecoupledDiLoCoJob) -> str:
    """The headless Service that names each synchronizer shard's pod in DNS."""
    return f"{synchronizer_name(job)}-shards"


def shard_pod_name(job: DecoupledDiLoCoJob, shard: int) -> str:
    return f"{synchronizer_name(job)}-{shard}"


def shard_claim_name(job: DecoupledDiLoCoJob, shard: int) -> str:
    """`<template>-<statefulset>-<ordinal>`: the claim the StatefulSet makes for a shard."""
    return f"{STATE_TEMPLATE}-{synchronizer_name(job)}-{shard}"


def shard_host(job: DecoupledDiLoCoJob, shard: int) -> str:
    return f"{shard_pod_name(job, shard)}.{shards_service_name(job)}.{job.namespace}.svc"


def learner_id(group: str, index: int) -> str:
    return f"{group}-{index}"


def learner_pod_name(job: DecoupledDiLoCoJob, group: str, index: int) -> str:
    """`<job>-<group>-<index>-<tag>`, a DNS label of at most 63 characters.

    The tag, 5 base32 characters of a hash of the job's uid and the group, keeps names of
    different jobs apart: without it job `p-col` (group `a-b`) and job `p-col-a` (group `b`)
    would both need pod `p-col-a-b-0`, and a new job would meet the leftovers of an older one
    of the same name. It is a function of the job's uid, so a slot keeps its name across
    operator restarts. A long job and group name is cut before the index; the tag still tells
    the slots apart. Should two names meet anyway, the pod that exists is not the job's, and
    the operator refuses to use it (runtime.py) instead of adopting it.
    """
    return _tagged_pod_name(job, group, str(index))


def _tagged_pod_name(job: DecoupledDiLoCoJob, group: str, middle: str) -> str:
    """`<job>-<group>` cut to fit, then `-<middle>-<tag>` (learner_pod_name says why)."""
    digest = hashlib.sha256(f"{job.uid}/{group}".encode()).digest()
    tail = f"-{middle}-{base64.b32encode(digest).decode()[:5].lower()}"
    return f"{job.name}-{group}"[: 63 - len(tail)].rstrip("-") + tail


def synchronizer_service_url(job: DecoupledDiLoCoJob) -> str:
    """The ClusterIP Service's URL: the synchronizer with S = 1, shard 0 with S > 1."""
    scheme = "https" if job.spec.synchronizer.tls.enabled else "http"
    return f"{scheme}://{synchronizer_name(job)}.{job.namespace}.svc:{SYNC_PORT}"


def shard_urls(job: DecoupledDiLoCoJob) -> list[str]:
    """One URL per shard, in shard order, as in-cluster learners reach them: the Service's
    with S = 1 (what learners had before shards), else each shard pod's headless DNS name."""
    shards = job.spec.synchronizer.shards
    if shards == 1:
        return [synchronizer_service_url(job)]
    scheme = "https" if job.spec.synchronizer.tls.enabled else "http"
    return [f"{scheme}://{shard_host(job, i)}:{SYNC_PORT}" for i in range(shards)]


def service_dns_names(job: DecoupledDiLoCoJob) -> list[str]:
    """The names the synchronizer answers to inside its cluster (the server certificate's
    SANs): the Service's, and with S > 1 every shard's headless name."""
    svc, ns = synchronizer_name(job), job.namespace
    names = [svc, f"{svc}.{ns}", f"{svc}.{ns}.svc", f"{svc}.{ns}.svc.cluster.local"]
    if job.spec.synchronizer.shards > 1:
        for i in range(job.spec.synchronizer.shards):
            names += [shard_host(job, i), f"{shard_host(job, i)}.cluster.local"]
    return names


def uses_tls(job: DecoupledDiLoCoJob, group: LearnerGroup) -> bool:
    """Whether this group's learners talk TLS to this job's synchronizer (verified by its CA)."""
    urls = sync_url_for(job, group).split(",")
    return job.spec.synchronizer.tls.enabled and any(u.startswith("https://") for u in urls)


def uses_client_cert(job: DecoupledDiLoCoJob, group: LearnerGroup) -> bool:
    return uses_tls(job, group) and job.spec.synchronizer.tls.mutual


def sync_url_for(job: DecoupledDiLoCoJob, group: LearnerGroup) -> str:
    """DDILOCO_SYNC_URL of a group's learners: its syncUrl (one URL per shard, the CRD
    checks), else the shards' in-cluster URLs, comma-separated in shard order."""
    return group.sync_url or ",".join(shard_urls(job))


def learner_selector(job: DecoupledDiLoCoJob, groups: Iterable[str] | None = None) -> str:
    """Label selector for the job's learner pods, in any cluster: by the job's uid, so that
    pods of another job of the same name (an older one, or one of another home namespace
    sharing a remote namespace) are never seen, let alone deleted; with `groups`, only the
    pods of those groups. A target sees only the groups it holds, because two targets can be
    one namespace (two kubeconfig Secrets for one cluster, or one pointing back home): each
    would otherwise take the other's pods for strays and delete them."""
    out = f"{LABEL_JOB_UID}={job.uid},{LABEL_COMPONENT}=learner"
    if groups is not None:
        out += f",{LABEL_GROUP} in ({','.join(sorted(groups))})"
    return out


def made_by(job: DecoupledDiLoCoJob, meta: Any) -> bool:
    """True if an object's metadata (a dict as the API sends it, or a client model's
    V1ObjectMeta) says this job made it: its job-uid label, or an ownerReference to the job.
    The operator changes and deletes only such objects; one without is someone else's."""
    if meta is None:
        return False
    if isinstance(meta, dict):
        labels = meta.get("labels") or {}
        refs = [r.get("uid") for r in meta.get("ownerReferences") or []]
    else:
        labels = meta.labels or {}
        refs = [r.uid for r in meta.owner_references or []]
    return bool(job.uid) and (labels.get(LABEL_JOB_UID) == job.uid or job.uid in refs)


def labels(job: DecoupledDiLoCoJob, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "ddiloco",
        "app.kubernetes.io/instance": job.name,
        LABEL_COMPONENT: component,
        "app.kubernetes.io/managed-by": MANAGED_BY,
        LABEL_JOB: job.name,
        LABEL_JOB_UID: job.uid,
    }


def owner_reference(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    # Only for objects in the job's own cluster: owner references cannot cross clusters,
    # which is why deletion also goes through the finalizer.
    return {
        "apiVersion": job.api_version,
        "kind": job.kind,
        "name": job.name,
        "uid": job.uid,
        "controller": True,
    }


def _metadata(
    job: DecoupledDiLoCoJob, name: str, component: str, namespace: str, owned: bool = True
) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name, "namespace": namespace, "labels": labels(job, component)}
    if owned:
        meta["ownerReferences"] = [owner_reference(job)]
    return meta


def build_token_secret(
    job: DecoupledDiLoCoJob,
    token: str,
    namespace: str | None = None,
    owned: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """The job key: the synchronizer's and the operator's credential, home only (learners
    hold credentials derived from it, `build_learner_tokens_secret`). During a rotation it
    holds two lines, "new\nold" (operator/tokens.py)."""
    meta = _metadata(job, token_secret_name(job), "token", namespace or job.namespace, owned)
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta,
        "data": {TOKEN_KEY: base64.b64encode(token.encode()).decode()},
    }


def build_learner_tokens_secret(
    job: DecoupledDiLoCoJob,
    group: str,
    data: dict[str, bytes],
    namespace: str | None = None,
    owned: bool = True,
) -> dict[str, Any]:
    """A group's learner credentials (`learner_tokens_secret_name`), `data` as tokens.py
    derives it from the job key: one item per learner id and per spare pod."""
    meta = _metadata(
        job,
        learner_tokens_secret_name(job, group),
        "learner-tokens",
        namespace or job.namespace,
        owned,
    )
    meta["labels"][LABEL_GROUP] = group
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": meta,
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())},
    }


def build_tls_secret(
    job: DecoupledDiLoCoJob,
    name: str,
    data: dict[str, bytes],
    namespace: str | None = None,
    owned: bool = True,
    annotations: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Secret of PEM files: type kubernetes.io/tls when it holds tls.crt and tls.key."""
    meta = _metadata(job, name, "tls", namespace or job.namespace, owned)
    if annotations:
        meta["annotations"] = dict(annotations)
    kind = "kubernetes.io/tls" if {CERT_KEY, KEY_KEY} <= set(data) else "Opaque"
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": kind,
        "metadata": meta,
        "data": {k: base64.b64encode(v).decode() for k, v in sorted(data.items())},
    }


def build_certificate(
    job: DecoupledDiLoCoJob, dns_names: list[str], ip_addresses: list[str]
) -> dict[str, Any]:
    """A cert-manager Certificate for the synchronizer, writing Secret <job>-tls. The
    secretTemplate puts the job's labels on that Secret, so the operator finds it like its own."""
    tls = job.spec.synchronizer.tls
    assert tls.issuer_ref is not None
    spec: dict[str, Any] = {
        "secretName": tls_secret_name(job),
        "secretTemplate": {"labels": labels(job, "tls")},
        "commonName": dns_names[0],
        "dnsNames": dns_names,
        "usages": ["digital signature", "key encipherment", "server auth"],
        "privateKey": {"algorithm": "ECDSA", "size": 256, "rotationPolicy": "Always"},
        "issuerRef": tls.issuer_ref.model_dump(by_alias=True),
    }
    if ip_addresses:
        spec["ipAddresses"] = ip_addresses
    meta = _metadata(job, certificate_name(job), "tls", job.namespace)
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(spec)}
    return {
        "apiVersion": "cert-manager.io/v1",
        "kind": "Certificate",
        "metadata": meta,
        "spec": spec,
    }


def secret_token(secret: dict[str, Any] | None) -> str | None:
    """The token held by a Secret as the API returns it (base64 data), if any."""
    data = ((secret or {}).get("data") or {}).get(TOKEN_KEY)
    return base64.b64decode(data).decode() if data else None


def _secret_volume(name: str, secret: str, item: str | None = None) -> dict[str, Any]:
    """A Secret volume, 0440 + the pod's fsGroup: readable by the image's user, not by the
    world. With `item`, only that key of the Secret, as the file TOKEN_KEY (a projection the
    kubelet keeps current, unlike a subPath)."""
    source: dict[str, Any] = {"secretName": secret, "defaultMode": 0o440}
    if item is not None:
        source["items"] = [{"key": item, "path": TOKEN_KEY}]
    return {"name": name, "secret": source}


def _mount(name: str, path: str) -> dict[str, Any]:
    # never subPath: a subPath mount is not updated when the Secret changes
    return {"name": name, "mountPath": path, "readOnly": True}


def _files(
    job: DecoupledDiLoCoJob, group: LearnerGroup | None, index: int = 0
) -> tuple[dict[str, str], list[dict[str, Any]], list[dict[str, Any]]]:
    """The env, volumes and mounts of the Secret files a container reads: the synchronizer's
    (group None: the job key) or a learner slot's (its own credential, one item of its
    group's credentials Secret; a spare swaps the item, `build_spare_pod`)."""
    env = {"DDILOCO_TOKEN_FILE": f"{TOKEN_DIR}/{TOKEN_KEY}"}
    if group is None:
        volumes = [_secret_volume("token", token_secret_name(job))]
    else:
        secret = learner_tokens_secret_name(job, group.name)
        volumes = [_secret_volume("token", secret, learner_id(group.name, index))]
    mounts = [_mount("token", TOKEN_DIR)]
    tls = job.spec.synchronizer.tls
    if group is None and tls.enabled:
        env["DDILOCO_TLS_CERT_FILE"] = f"{TLS_DIR}/{CERT_KEY}"
        env["DDILOCO_TLS_KEY_FILE"] = f"{TLS_DIR}/{KEY_KEY}"
        volumes.append(_secret_volume("tls", tls_secret_name(job)))
        mounts.append(_mount("tls", TLS_DIR))
        if tls.mutual:
            env["DDILOCO_TLS_CLIENT_CA_FILE"] = f"{TRUST_DIR}/{CLIENT_CA_KEY}"
            volumes.append(_secret_volume("trust", trust_secret_name(job)))
            mounts.append(_mount("trust", TRUST_DIR))
    elif group is not None and uses_tls(job, group):
        env["DDILOCO_CA_FILE"] = f"{TRUST_DIR}/{CA_KEY}"
        volumes.append(_secret_volume("trust", trust_secret_name(job)))
        mounts.append(_mount("trust", TRUST_DIR))
        if uses_client_cert(job, group):
            env["DDILOCO_CLIENT_CERT_FILE"] = f"{CLIENT_DIR}/{CERT_KEY}"
            env["DDILOCO_CLIENT_KEY_FILE"] = f"{CLIENT_DIR}/{KEY_KEY}"
            volumes.append(_secret_volume("client", client_secret_name(job, group.name, index)))
            mounts.append(_mount("client", CLIENT_DIR))
    return env, volumes, mounts


def training_env(training: Training) -> dict[str, Any]:
    """The learner settings `spec.training` sets (learner/config.py reads each); an unset
    one is left out, so the learner's default applies."""
    opt, sched = training.inner_optimizer, training.schedule
    return {
        "DDILOCO_TOKENIZER": training.tokenizer,
        "DDILOCO_DATA_FIELD": training.data_field,
        "DDILOCO_SEQ_LEN": training.sequence_length,
        "DDILOCO_BATCH_SIZE": training.batch_size,
        "DDILOCO_GRAD_ACCUM": training.gradient_accumulation,
        "DDILOCO_PRECISION": training.precision,
        "DDILOCO_PARALLEL": training.parallel,
        "DDILOCO_SEED": training.seed,
        "DDILOCO_INNER_LR": opt.learning_rate,
        "DDILOCO_WEIGHT_DECAY": opt.weight_decay,
        "DDILOCO_BETA1": opt.beta1,
        "DDILOCO_BETA2": opt.beta2,
        "DDILOCO_GRAD_CLIP": opt.gradient_clip,
        "DDILOCO_WARMUP_STEPS": sched.warmup_steps,
        "DDILOCO_LR_SCHEDULE": sched.decay,
        "DDILOCO_DECAY_FRACTION": sched.decay_fraction,
        "DDILOCO_MIN_LR_RATIO": sched.min_ratio,
    }


def _env(pairs: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"name": k, "value": str(v)} for k, v in pairs.items() if v is not None]


IMAGE_UID = 10001  # the non-root user of the project's Dockerfile


def global_index(job: DecoupledDiLoCoJob, group: LearnerGroup, index: int) -> int:
    """Position of a slot among all learners (groups in spec order): the data part a fresh
    job's allocation gives the slot. A running job's shards are in its status (reconcile.py)."""
    offset = 0
    for g in job.spec.learner_groups:
        if g.name == group.name:
            return offset + index
        offset += g.replicas
    raise KeyError(group.name)


def build_learner_pod(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    index: int,
    namespace: str | None = None,
    owned: bool = True,
    *,
    shard: tuple[int, int] | None = None,
    attempt: int = 0,
) -> dict[str, Any]:
    """One learner slot. restartPolicy Never: a failed pod is replaced whole, by the operator.

    `shard` is (data part, shard count), as reconcile.py allocated it for the slot; unset, a
    fresh job's allocation (`global_index` of the total replicas). `attempt` numbers the slot's
    pods (0, then one more per replacement). On failure the container's last log lines become
    its termination message (FallbackToLogsOnError), which the LearnerFailed event carries.
    The group's GPUs, processes, /dev/shm and grace period come from compute.py.
    """
    spec, training = job.spec, job.spec.training
    if shard is None:
        shard = (global_index(job, group, index), max(1, spec.total_replicas()))
    lid = learner_id(group.name, index)
    files, volumes, mounts = _files(job, group, index)
    env = [
        *_env(
            {
                **files,
                "DDILOCO_SYNC_URL": sync_url_for(job, group),
                "DDILOCO_LEARNER_ID": lid,
                "DDILOCO_LEARNER_INDEX": shard[0],
                "DDILOCO_NUM_LEARNERS": shard[1],
                "DDILOCO_MODEL": training.model,
                "DDILOCO_MODEL_ENTRY": training.model_entry,
                "DDILOCO_DATA": training.data,
                "DDILOCO_INIT_FROM": training.init_from,
                "DDILOCO_H": training.inner_steps,
                "DDILOCO_P": training.fragments,
                **training_env(training),
                "DDILOCO_MAX_STEPS": training.max_steps,
                "DDILOCO_MAX_TOKENS": training.max_tokens,
                "DDILOCO_MAX_SECONDS": training.max_seconds,
                "DDILOCO_METRICS_PORT": LEARNER_METRICS_PORT,
                "DDILOCO_UPDATE_ENCODING": spec.update_encoding,
                **compute.env(group),  # processes per learner, SIGTERM drain budget
            }
        ),
    ]
    meta = _metadata(
        job, learner_pod_name(job, group.name, index), "learner", namespace or job.namespace, owned
    )
    meta["labels"].update(
        {
            LABEL_GROUP: group.name,
            LABEL_SLOT: str(index),
            LABEL_LEARNER_ID: lid,
            LABEL_DATA_PART: f"{shard[0]}-of-{shard[1]}",
            LABEL_ATTEMPT: str(attempt),
        }
    )
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "enableServiceLinks": False,
        "automountServiceAccountToken": False,
        "containers": [
            {
                "name": "learner",
                "image": spec.image,
                "imagePullPolicy": spec.image_pull_policy,
                "command": ["ddiloco", "learner"],
                "env": env,
                "ports": [
                    {"name": "metrics", "containerPort": LEARNER_METRICS_PORT, "protocol": "TCP"}
                ],
                "volumeMounts": mounts,
                "terminationMessagePolicy": "FallbackToLogsOnError",
            }
        ],
        "volumes": volumes,
        # the Secret files are 0440: readable through the group by the image's user
        "securityContext": {"fsGroup": IMAGE_UID},
    }
    if group.node_selector:
        pod_spec["nodeSelector"] = dict(group.node_selector)
    if group.tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(by_alias=True, exclude_none=True) for t in group.tolerations
        ]
    if group.priority_class_name:
        pod_spec["priorityClassName"] = group.priority_class_name
    compute.apply(group, pod_spec)  # resources, GPUs, /dev/shm, grace period (compute.py)
    apply_template(group, pod_spec)
    return {"apiVersion": "v1", "kind": "Pod", "metadata": meta, "spec": pod_spec}


def apply_template(template: PodTemplate, pod_spec: dict[str, Any]) -> None:
    """Merge a user's pod template fields into a built pod spec (its first container is the
    main one): lists are appended after the operator's entries, the pod security context
    is merged over the operator's, the rest is set. Nothing the operator set is replaced:
    the template's items that would (an env DDILOCO_*, a volume, mount or container of the
    operator's name, a mount at or below one of its paths) are refused before any pod is
    built (the CRD's CEL rules, which the operator evaluates too: rules.py)."""
    container = pod_spec["containers"][0]
    if template.volumes:
        pod_spec["volumes"] = [
            *pod_spec.get("volumes", []),
            *(v.to_k8s() for v in template.volumes),
        ]
    if template.volume_mounts:
        container["volumeMounts"] = [
            *container.get("volumeMounts", []),
            *(m.to_k8s() for m in template.volume_mounts),
        ]
    if template.env:
        container["env"] = [*container.get("env", []), *(e.to_k8s() for e in template.env)]
    if template.env_from:
        container["envFrom"] = [e.to_k8s() for e in template.env_from]
    if template.container_security_context is not None:
        container["securityContext"] = dict(template.container_security_context)
    if template.init_containers:
        pod_spec["initContainers"] = [c.to_k8s() for c in template.init_containers]
    if template.affinity is not None:
        pod_spec["affinity"] = dict(template.affinity)
    if template.service_account_name is not None:
        pod_spec["serviceAccountName"] = template.service_account_name
    if template.image_pull_secrets:
        pod_spec["imagePullSecrets"] = [r.model_dump() for r in template.image_pull_secrets]
    if template.security_context is not None:
        pod_spec["securityContext"] = {
            **pod_spec.get("securityContext", {}),
            **template.security_context,
        }


SLOT_ENV: Final = ("DDILOCO_LEARNER_ID", "DDILOCO_LEARNER_INDEX", "DDILOCO_NUM_LEARNERS")
"""What a slot's pod has that a spare's has not: the spare receives them on promotion."""


def build_spare_pod(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    serial: int,
    namespace: str | None = None,
    owned: bool = True,
) -> dict[str, Any]:
    """A hot spare of `group`: a learner pod without a slot identity (operator/spares.py).

    Everything else is a slot pod's (image, resources, scheduling, trust files), plus
    DDILOCO_SPARE=1 and its own name (DDILOCO_POD_NAME, downward API): `ddiloco learner`
    then warms up (learner/spare.py), writes SPARE_READY_FILE, which its readiness probe
    waits for, and long-polls the synchronizer's GET /v1/spares/<pod> for the slot it takes
    over. Its token file is its own spare credential (`spare_token_key`), which reads that
    assignment and nothing else; the assignment brings the slot's learner credential. Under
    mutual TLS it mounts its own client certificate (`spare_client_secret_name`): no slot's
    credential or key is ever mounted into another pod."""
    pod = build_learner_pod(job, group, 0, namespace, owned)
    name = spare_pod_name(job, group.name, serial)
    meta = pod["metadata"]
    meta["name"] = name
    for key in (LABEL_SLOT, LABEL_LEARNER_ID, LABEL_DATA_PART, LABEL_ATTEMPT):
        meta["labels"].pop(key)
    meta["labels"].update({LABEL_ROLE: ROLE_SPARE, LABEL_SPARE: str(serial)})
    meta["annotations"] = {ANNOTATION_PROMOTED_AT: ""}  # the promotion's patch sets it
    spec = pod["spec"]
    (container,) = spec["containers"]
    env = [e for e in container["env"] if e["name"] not in SLOT_ENV]
    env += [
        {"name": "DDILOCO_SPARE", "value": "1"},
        {"name": "DDILOCO_POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
    ]
    container["env"] = env
    container["readinessProbe"] = {
        "exec": {"command": ["test", "-e", SPARE_READY_FILE]},
        "periodSeconds": 1,
    }
    own = {
        "client": _secret_volume("client", spare_client_secret_name(job, group.name, serial)),
        "token": _secret_volume(
            "token", learner_tokens_secret_name(job, group.name), spare_token_key(name)
        ),
    }
    spec["volumes"] = [own.get(v["name"], v) for v in spec["volumes"]]
    return pod


def spec_hash(obj: Any) -> str:
    """A short digest of a manifest, to notice drift without comparing server-defaulted fields."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:16]
