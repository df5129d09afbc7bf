"""The synchronizer's workload: its StatefulSet of S shards, the ClusterIP Service and the
shards' headless Service, as plain dicts (the seam of builders.py, whose names, labels and
helpers these use).

    from ddiloco.operator import sync_workload
    sts = sync_workload.build_synchronizer_statefulset(job)   # what the operator would apply

The StatefulSet `<job>-synchronizer` runs `synchronizer.shards` (S) pods, `<job>-synchronizer-<i>`
for shard i (DDILOCO_SHARD from the pod-index label), each with its own state claim
`state-<job>-synchronizer-<i>` (volumeClaimTemplates, deleted with the StatefulSet). See
builders.py's docstring for the Services' roles.

Each pod, and both Services, have two ports: "http" (SYNC_PORT: every call, HTTP/2 or 1.1) and
"upload" (SYNC_UPLOAD_PORT, DDILOCO_UPLOAD_PORT: update bodies only, HTTP/1.1), which learners
learn at join and reach at their URL's host, falling back to "http" when they cannot. A
Service whose ports differ from these gets them (`service_ports_patch`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Final

from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.builders import (
    ANNOTATION_SPEC_HASH,
    ANNOTATION_TLS_REVISION,
    IMAGE_UID,
    LABEL_COMPONENT,
    LABEL_JOB,
    LABEL_POD_INDEX,
    STATE_DIR,
    STATE_TEMPLATE,
    SYNC_PORT,
    SYNC_UPLOAD_PORT,
    _env,
    _files,
    _metadata,
    apply_template,
    labels,
    shards_service_name,
    spec_hash,
    synchronizer_name,
)


def _sync_ports(job: DecoupledDiLoCoJob) -> list[dict[str, Any]]:
    """Both Services' ports: the main one, and the upload port (learners reach it at their
    URL's host, so a Service without it would leave them on the main port)."""
    tls = job.spec.synchronizer.tls.enabled
    return [
        {
            "name": "http",
            "port": SYNC_PORT,
            "targetPort": "http",
            "protocol": "TCP",
            # HTTPS (h2 by ALPN) with TLS on, else HTTP/2 cleartext
            "appProtocol": "https" if tls else "kubernetes.io/h2c",
        },
        {
            "name": "upload",
            "port": SYNC_UPLOAD_PORT,
            "targetPort": "upload",
            "protocol": "TCP",
            # HTTP/1.1 only (a thread per connection, upload_port.py), over TLS with it on: never h2c
            "appProtocol": "https" if tls else "http",
        },
    ]


def _sync_selector(job: DecoupledDiLoCoJob) -> dict[str, str]:
    return {LABEL_JOB: job.name, LABEL_COMPONENT: "synchronizer"}


def build_synchronizer_service(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """The ClusterIP Service: the synchronizer with S = 1; with S > 1 shard 0 only (a
    Service in front of several shards would send a fragment to a shard that does not own
    it), for `ddiloco status`, port-forwards and hot spares' assignments."""
    selector = _sync_selector(job)
    if job.spec.synchronizer.shards > 1:
        selector[LABEL_POD_INDEX] = "0"
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, synchronizer_name(job), "synchronizer", job.namespace),
        "spec": {"type": "ClusterIP", "selector": selector, "ports": _sync_ports(job)},
    }


def build_shards_service(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """The StatefulSet's headless Service: DNS names `<sync>-<i>.<sync>-shards.<ns>.svc`,
    for Ready shard pods only (publishNotReadyAddresses false: a learner retries a shard
    that is starting, as it retries a Service without endpoints)."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _metadata(job, shards_service_name(job), "synchronizer", job.namespace),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": False,
            "selector": _sync_selector(job),
            "ports": _sync_ports(job),
        },
    }


SERVICE_PORT_FIELDS: Final = ("name", "port", "targetPort", "protocol", "appProtocol")
"""What `service_ports_patch` compares of each port (the apiserver fills in others: nodePort)."""


def service_ports_patch(
    want: Mapping[str, Any], have: Sequence[Mapping[str, Any]] | None
) -> dict[str, Any] | None:
    """The JSON merge patch (RFC 7386) that sets an existing Service's spec.ports (`have`, as
    read) to those of `want` (a built Service), or None when they already match on
    SERVICE_PORT_FIELDS, in order, or were not read (None).

    A merge patch replaces the list whole, so the Service ends with exactly the wanted ports;
    a strategic merge patch would merge them by `port`, keeping a port no longer wanted and
    the fields of an old entry that the new one leaves out. Nothing else of the Service is
    touched (clusterIP, type, selector). A nodePort the Service has for a wanted (port,
    protocol) is kept, so that one made a NodePort by hand keeps it."""
    if have is None:
        return None
    ports = [dict(p) for p in want["spec"]["ports"]]
    if _port_fields(have) == _port_fields(ports):
        return None
    node_ports = {(p.get("port"), p.get("protocol") or "TCP"): p.get("nodePort") for p in have}
    for p in ports:
        if node_port := node_ports.get((p["port"], p.get("protocol") or "TCP")):
            p["nodePort"] = node_port
    return {"spec": {"ports": ports}}


def _port_fields(ports: Sequence[Mapping[str, Any]]) -> list[tuple[Any, ...]]:
    return [tuple(p.get(k) for k in SERVICE_PORT_FIELDS) for p in ports]


def _claim_spec(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    storage = job.spec.synchronizer.storage
    spec: dict[str, Any] = {
        "accessModes": ["ReadWriteOnce"],
        "resources": {"requests": {"storage": str(storage.size)}},
    }
    if storage.storage_class_name is not None:
        spec["storageClassName"] = storage.storage_class_name
    return spec


COUNTER_CAP_H: Final = 4
"""The synchronizer caps the steps a contribution may claim at this many H (README, "Weights
and merge"; `ddiloco local` sets the same). Its own default, 96, is 4H only for H = 24."""


def max_learners(job: DecoupledDiLoCoJob) -> int:
    """DDILOCO_MAX_LEARNERS, the most learner records the synchronizer keeps (a new learner id
    beyond it is refused): twice the job's learner ids (its slots, or `training.dataParts`,
    what it will scale to, if more, plus the hot spares) and a margin of 16, rounded up to a
    power of two so that scaling within it does not roll the synchronizer. A replaced slot
    reuses its id, so replacements need no room."""
    spec = job.spec
    slots = max(spec.total_replicas(), spec.training.data_parts or 0)
    spares = spec.failure_policy.hot_spares * len(spec.learner_groups)
    want = 2 * (slots + spares) + 16
    return 1 << (want - 1).bit_length()


def checkpoint_env(job: DecoupledDiLoCoJob) -> dict[str, Any]:
    """The synchronizer's checkpoint settings (`spec.checkpoints`), and `training.initFrom`,
    which one synchronizer starts from (a checkpoint's outer state too; a sharded one leaves
    it to the learners' init upload): synchronizer/checkpoints.py. Unset ones are left out,
    so a job without them keeps the pod template it had."""
    spec = job.spec
    ckpt = spec.checkpoints
    env: dict[str, Any] = {
        "DDILOCO_INIT_FROM": spec.training.init_from if spec.synchronizer.shards == 1 else None
    }
    if ckpt is not None:
        env |= {
            "DDILOCO_CHECKPOINT_DEST": ckpt.dest(),
            "DDILOCO_CHECKPOINT_EVERY_VERSIONS": ckpt.every_versions or None,
            "DDILOCO_CHECKPOINT_EVERY_SECONDS": ckpt.every_seconds or None,
            "DDILOCO_CHECKPOINT_KEEP": ckpt.keep,
        }
    return env


def build_synchronizer_statefulset(
    job: DecoupledDiLoCoJob, tls_revision: str | None = None
) -> dict[str, Any]:
    """S synchronizer shards, one pod and one state claim each (replicas 0 while suspended).

    Each pod learns its shard from its pod-index label (downward API: DDILOCO_SHARD) and the
    count from DDILOCO_SHARDS. A rolling update deletes a shard's pod before it makes its
    successor, so no two pods ever write one state volume. The claims
    (volumeClaimTemplates) are deleted with the StatefulSet (whenDeleted: Delete) and kept
    when it scales to 0 (whenScaled: Retain: a suspend keeps the state). `tls_revision`
    (certs.py) names the certificates the pods serve; a new one rolls them."""
    spec, sync = job.spec, job.spec.synchronizer
    files, volumes, mounts = _files(job, None)
    env = [
        *_env(
            {
                **files,
                "DDILOCO_HOST": "0.0.0.0",
                "DDILOCO_STATE_DIR": STATE_DIR,
                "DDILOCO_PORT": SYNC_PORT,
                "DDILOCO_UPLOAD_PORT": SYNC_UPLOAD_PORT,
                "DDILOCO_QUORUM": sync.quorum,
                "DDILOCO_GRACE_GAMMA": sync.grace_gamma,
                "DDILOCO_GRACE_CAP_STEPS": sync.grace_cap_steps,
                "DDILOCO_MERGE": sync.merge,
                "DDILOCO_MERGE_SCALE": sync.merge_scale,
                "DDILOCO_OUTER_LR": sync.outer_learning_rate,
                "DDILOCO_OUTER_MOMENTUM": sync.outer_momentum,
                "DDILOCO_MAX_STALENESS": sync.max_staleness,
                "DDILOCO_TAU": spec.training.overlap_steps,
                "DDILOCO_COUNTER_CAP_STEPS": COUNTER_CAP_H * spec.training.inner_steps,
                "DDILOCO_SHARDS": sync.shards,
                "DDILOCO_UPDATE_ENCODINGS": spec.update_encoding,
                "DDILOCO_BROADCAST_ENCODING": spec.broadcast_encoding,
                # DDILOCO_MAX_TOKENS_PER_STEP keeps the synchronizer's default: the spec does
                # not know a learner's batch size and sequence length (the preset does)
                "DDILOCO_MAX_LEARNERS": max_learners(job),
                # the job's budget in merged tokens; unset without one (0), so a job without
                # a budget keeps the pod template it had
                "DDILOCO_TOTAL_TOKENS": spec.training.total_tokens or None,
                **checkpoint_env(job),
            }
        ),
        {
            "name": "DDILOCO_SHARD",
            "valueFrom": {"fieldRef": {"fieldPath": f"metadata.labels['{LABEL_POD_INDEX}']"}},
        },
    ]
    probe: dict[str, Any] = {"httpGet": {"path": "/healthz", "port": "http"}, "periodSeconds": 10}
    if sync.tls.enabled:
        probe["httpGet"]["scheme"] = "HTTPS"  # the kubelet does not verify the certificate
    if sync.tls.enabled and sync.tls.mutual:
        # the kubelet has no client certificate to present: check that the port accepts
        probe = {"tcpSocket": {"port": "http"}, "periodSeconds": 10}
    container = {
        "name": "synchronizer",
        "image": spec.image,
        "imagePullPolicy": spec.image_pull_policy,
        "command": ["ddiloco", "synchronizer"],
        # its one-line error on a refused start (exit 2) becomes the termination message,
        # which the job's Failed condition quotes (operator/conditions.py)
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "env": env,
        "ports": [
            {"name": "http", "containerPort": SYNC_PORT, "protocol": "TCP"},
            {"name": "upload", "containerPort": SYNC_UPLOAD_PORT, "protocol": "TCP"},
        ],
        # Liveness counts only once the port first answers: loading the state and replaying
        # the pending log of a large model takes minutes, and a busy 2-core node took over the
        # liveness budget (60 s) to start one, which the kubelet then killed in a loop.
        "startupProbe": {**probe, "periodSeconds": 2, "failureThreshold": 300},
        "readinessProbe": {**probe, "periodSeconds": 5},
        "livenessProbe": {**probe, "failureThreshold": 6},
        "resources": sync.resources.to_k8s(),
        "volumeMounts": [{"name": STATE_TEMPLATE, "mountPath": STATE_DIR}, *mounts],
    }
    template: dict[str, Any] = {
        "metadata": {"labels": labels(job, "synchronizer")},
        "spec": {
            "containers": [container],
            "enableServiceLinks": False,
            "automountServiceAccountToken": False,
            # The image runs as uid 10001 (Dockerfile); fsGroup makes the state volume writable
            # for it on storage classes that mount volumes root-owned.
            "securityContext": {"runAsNonRoot": True, "fsGroup": IMAGE_UID},
            "volumes": volumes,
        },
    }
    apply_template(sync, template["spec"])  # the user's volumes, env, ... (builders.py)
    if tls_revision:
        template["metadata"]["annotations"] = {ANNOTATION_TLS_REVISION: tls_revision}
    sts_spec: dict[str, Any] = {
        "replicas": 0 if spec.suspend else sync.shards,
        "serviceName": shards_service_name(job),
        "podManagementPolicy": "Parallel",  # shards are independent: start them together
        "updateStrategy": {"type": "RollingUpdate"},
        "selector": {"matchLabels": _sync_selector(job)},
        "template": template,
        "volumeClaimTemplates": [
            {
                "metadata": {"name": STATE_TEMPLATE, "labels": labels(job, "synchronizer")},
                "spec": _claim_spec(job),
            }
        ],
        "persistentVolumeClaimRetentionPolicy": {
            "whenDeleted": "Delete",
            "whenScaled": "Retain",
        },
    }
    meta = _metadata(job, synchronizer_name(job), "synchronizer", job.namespace)
    meta["annotations"] = {ANNOTATION_SPEC_HASH: spec_hash(sts_spec)}
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": meta,
        "spec": sts_spec,
    }
