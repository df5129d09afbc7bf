"""The DecoupledDiLoCoJob API (ddiloco.dev/v1alpha1), defined once as pydantic models.

Everything else derives from these classes: the CRD YAML (`python -m ddiloco.operator.crd`
renders deploy/crds/ from them; tests/unit/test_operator_crd.py fails on drift), the
builders (typed access to a job's spec) and the status the operator writes.

    from ddiloco.operator.api import DecoupledDiLoCoJob
    job = DecoupledDiLoCoJob.from_body(body)        # a kopf body or a dict from the API

Field names are the Python spelling of the camelCase YAML keys (`learner_groups` is
`learnerGroups`). Each field's docstring becomes its CRD description: say the unit and the
paper's symbol (Douillard et al. 2026) there. Validation that needs more than one field lives in
CEL rules (`x-kubernetes-validations`) so the apiserver refuses a bad job before the
operator sees it; `validate()` below evaluates those same rules (rules.py, cel-python) for
bodies that skipped them: each rule is written once.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema
from pydantic.alias_generators import to_camel

from ddiloco.wire.protocol import DEFAULT_BROADCAST_ENCODING, BroadcastEncoding, UpdateEncoding

GROUP: Final = "ddiloco.dev"
VERSION: Final = "v1alpha1"
KIND: Final = "DecoupledDiLoCoJob"
PLURAL: Final = "decoupleddilocojobs"
SINGULAR: Final = "decoupleddilocojob"
SHORT_NAMES: Final = ("ddj",)
API_VERSION: Final = f"{GROUP}/{VERSION}"

# The value of spec.managedBy that means "this operator" (the default when unset). Any other
# value hands the job to that controller, e.g. Kueue's MultiKueue, and we leave it alone.
MANAGED_BY_US: Final = "ddiloco.dev/operator"
# children append "-synchronizer-shards", "-<group>-<index>"; names.py. 39, not 40: the
# synchronizer StatefulSet `<job>-synchronizer` labels its pods with its name plus "-" and a
# 10-character revision hash, a label value of at most 63 characters.
MAX_JOB_NAME: Final = 39
MAX_SHARDS: Final = 64  # synchronizer.shards
MAX_GROUP_NAME: Final = 16
MAX_GROUPS: Final = 16
MAX_REPLICAS: Final = 512
DNS_LABEL: Final = r"^[a-z]([-a-z0-9]*[a-z0-9])?$"
MAX_SLOT_DETAIL: Final = 32  # status.slots lists at most this many unhealthy slots
MAX_HOT_SPARES: Final = 16  # failurePolicy.hotSpares per group
MAX_GPUS_PER_LEARNER: Final = 64  # gpusPerLearner: one pod, one node
GPU_RESOURCE: Final = "nvidia.com/gpu"  # the NVIDIA device plugin's extended resource
DEFAULT_GRACE_S: Final = 60  # terminationGracePeriodSeconds of a learner pod
MIN_GRACE_S: Final = 10
MAX_GRACE_S: Final = 3600
# A byte quantity ("8Gi", "512M", "1e9"): the apiserver's Quantity grammar without a sign or
# milli-units (resource.Quantity; a size of /dev/shm is whole bytes).
BYTES_QUANTITY: Final = r"^([0-9]+(\.[0-9]*)?|\.[0-9]+)([KMGTPE]i|[kMGTPE]|[eE][0-9]+)?$"
# A DNS name (optionally a wildcard's "*." first label; labels of 1..63 letters, digits and
# inner '-') or an IPv6 address (checked in full by `validate`), for a SAN. An IPv4 address
# is a DNS-shaped name here and is told apart by `ipaddress` where the certificate is made.
_DNS_PART: Final = r"[A-Za-z0-9]([-A-Za-z0-9]{0,61}[A-Za-z0-9])?"
EXTERNAL_NAME: Final = rf"^(\*\.)?({_DNS_PART}\.)*{_DNS_PART}$|^[0-9A-Fa-f:.]*:[0-9A-Fa-f:.]*$"
# The model presets of learner/model.py (PRESETS; tests/unit/test_operator_hostile.py keeps
# the two in step), or a Hugging Face config directory `hf:PATH`.
MODEL_PRESETS: Final = ("tiny", "small", "base", "gpt2")
MODEL: Final = "^(" + "|".join(MODEL_PRESETS) + ")$|^hf:[^\\s]+$"
# A container image reference (the distribution grammar, simplified): an optional registry
# host[:port]/, lower-case path components, then :tag and/or @digest.
_IMAGE_PATH: Final = r"[a-z0-9]+([._]|__|-+)?[a-z0-9]*([._-]+[a-z0-9]+)*"
IMAGE: Final = (
    rf"^([A-Za-z0-9][-A-Za-z0-9.]*(:[0-9]+)?/)?{_IMAGE_PATH}(/{_IMAGE_PATH})*"
    r"(:[A-Za-z0-9_][A-Za-z0-9_.-]{0,127})?(@[a-z0-9]+([+._-][a-z0-9]+)*:[a-zA-Z0-9=_-]{32,})?$"
)
# A Secret's name (a DNS subdomain) and a key in it.
SECRET_NAME: Final = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
SECRET_KEY: Final = r"^[-._a-zA-Z0-9]+$"
# One URL of a syncUrl list: a scheme and a host, no space, no empty element.
SYNC_URL: Final = r"^https?://[^\s,/]+[^\s,]*(,https?://[^\s,/]+[^\s,]*)*$"
# spec.managedBy: a controller's domain-prefixed name, as Job's managedBy
# (e.g. kueue.x-k8s.io/multikueue); within ddiloco.dev only this operator's.
MANAGED_BY: Final = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?/[-A-Za-z0-9_.]+$"

# A Kubernetes resource quantity ("500m", "16Gi", 1): int or string, as the core API has it.
Quantity = Annotated[int | str, WithJsonSchema({"x-kubernetes-int-or-string": True})]
# A size in bytes, an int (bytes) or a quantity string, checked by the apiserver's schema too.
ByteQuantity = Annotated[
    Annotated[int, Field(ge=1)] | Annotated[str, Field(pattern=BYTES_QUANTITY, max_length=32)],
    WithJsonSchema({"x-kubernetes-int-or-string": True, "pattern": BYTES_QUANTITY}),
]


class _Model(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        use_attribute_docstrings=True,
        frozen=True,
    )


class Resources(_Model):
    """Compute resources of a container, as in a Pod's `resources`."""

    requests: dict[str, Quantity] = Field(default_factory=dict)
    """Minimum resources, e.g. {cpu: "2", memory: 8Gi}."""
    limits: dict[str, Quantity] = Field(default_factory=dict)
    """Maximum resources; GPUs go here, e.g. {"nvidia.com/gpu": 1}."""

    def to_k8s(self) -> dict[str, dict[str, str]]:
        out: dict[str, dict[str, str]] = {}
        if self.requests:
            out["requests"] = {k: str(v) for k, v in self.requests.items()}
        if self.limits:
            out["limits"] = {k: str(v) for k, v in self.limits.items()}
        return out


class Toleration(_Model):
    """A Pod toleration (core/v1 Toleration)."""

    key: str | None = None
    """Taint key; empty with operator Exists tolerates everything."""
    operator: Literal["Exists", "Equal"] = "Equal"
    """How key and value are compared."""
    value: str | None = None
    """Taint value for operator Equal."""
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = None
    """Taint effect to match; empty matches all effects."""
    toleration_seconds: int | None = None
    """For NoExecute: how long the pod stays bound after the taint appears (seconds)."""


DECAY_RULE: Final = (
    "!has(self.schedule) || !has(self.schedule.decay) || self.schedule.decay == 'constant' || "
    "(has(self.totalTokens) && self.totalTokens > 0) || has(self.maxSteps) || has(self.maxTokens)"
)
DECAY_MESSAGE: Final = (
    "training.schedule.decay decays over a budget: set training.totalTokens (or maxSteps or "
    "maxTokens), or use decay constant"
)
ENTRY_SETTINGS_MESSAGE: Final = (
    "training.tokenizer and training.sequenceLength are not used with training.modelEntry: "
    "the entry builds its own data"
)


class InnerOptimizer(_Model):
    """The learners' inner optimizer, AdamW; an unset field keeps the learner's default."""

    learning_rate: float | None = Field(None, gt=0, le=10)
    """Peak learning rate (the learner's default: 3e-3)."""
    weight_decay: float | None = Field(None, ge=0, le=10)
    """Decoupled weight decay (default 0.1)."""
    beta1: float | None = Field(None, ge=0, lt=1)
    """First-moment decay (default 0.9)."""
    beta2: float | None = Field(None, ge=0, lt=1)
    """Second-moment decay (default 0.95)."""
    gradient_clip: float | None = Field(None, ge=0, le=1e6)
    """Clip the gradient norm to this; 0 disables (default 1.0)."""


class Schedule(_Model):
    """The inner learning rate over time: a warm-up over each slot's steps (a replacement
    resumes its slot's), then constant or a decay over the job's budget, which every learner
    follows alike (the job's merged tokens against totalTokens, else maxSteps or maxTokens)."""

    warmup_steps: int | None = Field(None, ge=1, le=10_000_000)
    """Linear warm-up, in inner steps of the slot (the learner's default: 20)."""
    decay: Literal["constant", "cosine", "wsd"] = "constant"
    """constant; cosine to minRatio of the peak over the budget; or wsd: the peak until the
    last decayFraction of the budget, then linearly to minRatio of it."""
    decay_fraction: float | None = Field(None, gt=0, le=1)
    """The last fraction of the budget over which wsd decays (default 0.2)."""
    min_ratio: float | None = Field(None, ge=0, le=1)
    """Where a decay ends, as a fraction of the peak (default 0.1)."""


class Training(_Model):
    """What every learner trains, and how often it talks to the synchronizer."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "has(self.model) != has(self.modelEntry)",
                    "message": "set exactly one of training.model (a preset name) "
                    "or training.modelEntry (module:function)",
                },
                {
                    "rule": "!has(self.modelEntry) || !has(self.data)",
                    "message": "training.data is not used with training.modelEntry: "
                    "the entry loads its own data",
                },
                {
                    "rule": "self.innerSteps % self.fragments == 0",
                    "message": "training.innerSteps (H) must be a multiple of training.fragments (P)",
                },
                {
                    "rule": "self.overlapSteps < self.innerSteps",
                    "message": "training.overlapSteps (tau) must be less than training.innerSteps (H)",
                },
                {
                    "rule": DECAY_RULE,
                    "message": DECAY_MESSAGE,
                },
                {
                    "rule": "!has(self.modelEntry) || (!has(self.tokenizer) && "
                    "!has(self.sequenceLength))",
                    "message": ENTRY_SETTINGS_MESSAGE,
                },
            ]
        }
    )

    model: str | None = Field(None, max_length=1024, pattern=MODEL)
    """Model preset name (tiny, the CPU debug preset; small, base, gpt2), or hf:PATH, a
    Hugging Face config directory in the image or a mounted volume. Exclusive with
    modelEntry."""
    model_entry: str | None = Field(None, max_length=256, pattern=r"^[\w.]+:[\w.]+$")
    """Model factory as "package.module:function". Exclusive with model."""
    data: str | None = Field(None, min_length=1, max_length=1024)
    """Training corpus of a model preset: a text file, folder or uint16 .bin in the image or a
    mounted volume; unset uses the small corpus every image has (the Python standard library's
    sources). Not with modelEntry, which loads its own data."""
    inner_steps: int = Field(24, ge=1, le=100_000)
    """H: inner steps between two merges of the same fragment."""
    fragments: int = Field(4, ge=1, le=1024)
    """P: number of fragments the parameters are split into; must divide H."""
    overlap_steps: int = Field(2, ge=1, le=100_000)
    """tau: steps a learner keeps training while a fragment is being merged."""
    tokenizer: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^/[^\s]*$")
    """Absolute path, inside the learner pods, of a Hugging Face tokenizer (a directory or
    tokenizer.json) for text, JSONL and Parquet data; unset: an hf: model directory's own,
    else bytes. Not with modelEntry."""
    data_field: str | None = Field(None, min_length=1, max_length=256)
    """The text column of JSONL and Parquet data (the learner's default: text)."""
    sequence_length: int | None = Field(None, ge=1, le=1 << 20)
    """Tokens per training sequence; unset: the model's context length, the most it takes.
    Not with modelEntry."""
    batch_size: int | None = Field(None, ge=1, le=65_536)
    """Sequences per micro-batch on each rank (the learner's default: 8)."""
    gradient_accumulation: int = Field(1, ge=1, le=4096)
    """Micro-batches per inner step: a step trains batchSize x gradientAccumulation sequences
    per rank, with one optimizer step."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """The forward pass in bf16 autocast or fp32 (parameters and optimizer stay fp32); auto:
    bf16 on GPUs, fp32 on CPUs."""
    parallel: Literal["ddp", "fsdp2"] = "ddp"
    """How the ranks of one learner (gpusPerLearner > 1) train together: DDP, every GPU
    holding the model, or FSDP2, the parameters sharded over them for a model one GPU cannot
    hold."""
    seed: int | None = Field(None, ge=0, le=(1 << 32) - 1)
    """Seed of the initial model (the same on every learner) and of the data order."""
    inner_optimizer: InnerOptimizer = Field(default_factory=InnerOptimizer)
    """The inner AdamW's settings."""
    schedule: Schedule = Field(default_factory=Schedule)
    """The inner learning-rate schedule."""
    max_steps: int | None = Field(None, ge=1)
    """Step budget per learner (inner steps); unset means no step limit."""
    max_tokens: int | None = Field(None, ge=1)
    """Token budget per learner; unset means no token limit."""
    max_seconds: float | None = Field(None, gt=0)
    """Time budget per learner pod (seconds of training); unset means no time limit."""
    init_from: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^/[^\s]*$")
    """Absolute path, inside the learner pods, of a model directory to start from: its
    safetensors weights (a previous job's `ddiloco export` or checkpoint, or a Hugging Face
    snapshot on a volume mounted through the group's volumes and volumeMounts). Unset: a
    fresh init. With one synchronizer shard it is the synchronizer's too (mount it there
    through synchronizer.volumes and volumeMounts): from a checkpoint it resumes the outer
    optimizer's momentum and the versions as well."""
    total_tokens: int = Field(0, ge=0)
    """The job's budget in merged tokens, counted by the synchronizer: once merged, every
    learner hands over and exits 0 and the job is Succeeded. 0: no budget (the job runs
    until it is deleted or every learner reaches its own limit)."""
    data_parts: int | None = Field(None, ge=1, le=MAX_GROUPS * MAX_REPLICAS)
    """Number of disjoint parts the training data is cut into; each learner slot trains one
    part, the same one for the slot's whole life (replacements included). Set it to the most
    learners the job will scale to: scaling within it never restarts a learner. Unset: the
    total replicas when the job starts, raised (restarting every learner on its new part) when
    a scale-up exceeds it. Changing it restarts every learner on its new part."""


class Storage(_Model):
    """The synchronizer's persistent volume (global fragments, outer optimizer state)."""

    size: Quantity = "1Gi"
    """Requested capacity of the PersistentVolumeClaim."""
    storage_class_name: str | None = None
    """StorageClass of the claim; unset uses the cluster default, "" asks for no class."""


class IssuerRef(_Model):
    """A cert-manager issuer (cert-manager.io/v1 Certificate `spec.issuerRef`)."""

    name: str = Field(min_length=1, max_length=253)
    """Name of the Issuer (in the job's namespace) or ClusterIssuer."""
    kind: Literal["Issuer", "ClusterIssuer"] = "Issuer"
    """Issuer kind."""
    group: str = Field("cert-manager.io", min_length=1, max_length=253)
    """API group of the issuer; other groups are external issuers cert-manager supports."""


class Tls(_Model):
    """TLS between learners and the synchronizer (HTTPS: HTTP/2 by ALPN, and HTTP/1.1)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.issuer) || self.issuer != 'cert-manager' || "
                    "has(self.issuerRef)",
                    "message": "synchronizer.tls.issuer cert-manager needs "
                    "synchronizer.tls.issuerRef",
                },
            ]
        }
    )

    enabled: bool = True
    """Serve HTTPS; false serves HTTP/2 cleartext (h2c), for a network you trust end to end."""
    issuer: Literal["operator", "cert-manager"] = "operator"
    """Who issues the server certificate: the operator, from a CA it makes for the job (Secret
    <job>-ca, which never leaves this cluster), or cert-manager (a Certificate for issuerRef;
    its CRDs must be installed). Either way it lands in Secret <job>-tls."""
    issuer_ref: IssuerRef | None = None
    """The cert-manager issuer, for issuer cert-manager."""
    mutual: bool = False
    """Mutual TLS: every learner slot gets a client certificate (CN = its learner id) from the
    job's CA, and the synchronizer refuses connections without one."""
    certificate_days: int = Field(90, ge=1, le=3650)
    """Validity of the certificates the operator issues (days); each is renewed once less than
    a third of its validity is left. The job's CA lives ten times as long."""


# What the operator puts in the pods it builds (builders.py, compute.py, sync_workload.py),
# which a pod template (`PodTemplate`) may not replace: volumes by name, mounts by name or by
# a mountPath at or below one of these, containers by name, env vars by this prefix.
OWNED_VOLUMES: Final = ("token", "tls", "trust", "client", "dshm", "state")
OWNED_MOUNT_PATHS: Final = ("/var/run/ddiloco", "/var/lib/ddiloco", "/dev/shm")
OWNED_CONTAINERS: Final = ("learner", "synchronizer")
OWNED_ENV_PREFIX: Final = "DDILOCO_"


def _cel_list(items: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{x}'" for x in items) + "]"


class _K8sObject(BaseModel):
    """A Kubernetes object given by the user, kept as written: the fields the operator checks
    are typed, every other one passes through to the pod unchanged (the apiserver validates
    the pod)."""

    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="allow",
        use_attribute_docstrings=True,
        frozen=True,
        json_schema_extra={"x-kubernetes-preserve-unknown-fields": True},
    )

    def to_k8s(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_none=True)


def _owned(*rules: tuple[str, str]) -> dict[str, Any]:
    """x-kubernetes-validations of a template item, with the preserve-unknown-fields marker
    (a model's json_schema_extra replaces its base's)."""
    return {
        "x-kubernetes-preserve-unknown-fields": True,
        "x-kubernetes-validations": [
            {"rule": rule, "messageExpression": message} for rule, message in rules
        ],
    }


ENV_OWNED_MESSAGE: Final = (
    "is set by the operator (every DDILOCO_ variable is, from the job's spec); "
    "set what it means through the spec instead"
)
VOLUME_OWNED_MESSAGE: Final = (
    f"is a name the operator's volumes use ({', '.join(OWNED_VOLUMES)}); choose another"
)
MOUNT_PATH_OWNED_MESSAGE: Final = (
    f"is at or below a path the operator mounts ({', '.join(OWNED_MOUNT_PATHS)}); "
    "mount it elsewhere"
)
CONTAINER_OWNED_MESSAGE: Final = (
    f"is a name of the operator's containers ({', '.join(OWNED_CONTAINERS)}); choose another"
)


class EnvVar(_K8sObject):
    """An environment variable of the container (core/v1 EnvVar: name, value or valueFrom)."""

    model_config = ConfigDict(
        json_schema_extra=_owned(
            (
                f"!self.name.startsWith('{OWNED_ENV_PREFIX}')",
                f'"env " + self.name + " {ENV_OWNED_MESSAGE}"',
            )
        )
    )

    name: str = Field(min_length=1, max_length=253)
    """Variable name; not one starting with DDILOCO_ (the operator's)."""


class Volume(_K8sObject):
    """A pod volume (core/v1 Volume: name and one source, e.g. persistentVolumeClaim)."""

    model_config = ConfigDict(
        json_schema_extra=_owned(
            (
                f"!(self.name in {_cel_list(OWNED_VOLUMES)})",
                f'"volume name " + self.name + " {VOLUME_OWNED_MESSAGE}"',
            )
        )
    )

    name: str = Field(min_length=1, max_length=63)
    """Volume name, referred to by volumeMounts; not one of the operator's."""


class VolumeMount(_K8sObject):
    """A mount of a volume into the container (core/v1 VolumeMount)."""

    model_config = ConfigDict(
        json_schema_extra=_owned(
            (
                f"!(self.name in {_cel_list(OWNED_VOLUMES)})",
                f'"volumeMount name " + self.name + " {VOLUME_OWNED_MESSAGE}"',
            ),
            (
                f"!{_cel_list(OWNED_MOUNT_PATHS)}.exists(o, self.mountPath == o || "
                "self.mountPath.startsWith(o + '/'))",
                f'"volumeMount mountPath " + self.mountPath + " {MOUNT_PATH_OWNED_MESSAGE}"',
            ),
        )
    )

    name: str = Field(min_length=1, max_length=63)
    """The volume mounted."""
    mount_path: str = Field(min_length=1, max_length=1024)
    """Where in the container; not at or below a path the operator mounts."""


class Container(_K8sObject):
    """An init container (core/v1 Container), run to completion before the main one."""

    model_config = ConfigDict(
        json_schema_extra=_owned(
            (
                f"!(self.name in {_cel_list(OWNED_CONTAINERS)})",
                f'"initContainer name " + self.name + " {CONTAINER_OWNED_MESSAGE}"',
            )
        )
    )

    name: str = Field(min_length=1, max_length=63)
    """Container name; not one of the operator's."""


class EnvFromSource(_K8sObject):
    """Variables from a ConfigMap or Secret (core/v1 EnvFromSource). The container's `env`
    wins over these, so the operator's DDILOCO_ variables stay the operator's."""


class LocalObjectReference(_Model):
    """A reference to an object in the pod's namespace by name."""

    name: str = Field(min_length=1, max_length=253, pattern=SECRET_NAME)
    """Name of the object (an image pull Secret)."""


# An object of the core API kept as written (affinity, security contexts).
FreeForm = Annotated[
    dict[str, Any], WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})
]


class PodTemplate(_Model):
    """What a user adds to the pods the operator builds: their volumes and mounts, variables,
    scheduling, identity and security. Merged into the built pod, never replacing what the
    operator sets: its env (DDILOCO_*), its volumes (by name), its mounts (by name and path)
    and its containers (by name) are refused, by the apiserver and again by the operator."""

    volumes: list[Volume] = Field(default_factory=list, max_length=64)
    """Pod volumes (core/v1 Volume), e.g. a PersistentVolumeClaim with the data or a model."""
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=64)
    """Mounts of those volumes into the main container (core/v1 VolumeMount)."""
    env: list[EnvVar] = Field(default_factory=list, max_length=128)
    """Extra environment variables of the main container (core/v1 EnvVar)."""
    env_from: list[EnvFromSource] = Field(default_factory=list, max_length=32)
    """Variables from ConfigMaps or Secrets (core/v1 EnvFromSource); `env` and the
    operator's variables win over them."""
    affinity: FreeForm | None = None
    """Pod affinity, anti-affinity and node affinity (core/v1 Affinity)."""
    service_account_name: str | None = Field(
        None, min_length=1, max_length=253, pattern=SECRET_NAME
    )
    """ServiceAccount the pods run as (its token is still not mounted: add a projected
    volume for workload identity)."""
    image_pull_secrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16)
    """Secrets to pull the image with (core/v1 LocalObjectReference)."""
    security_context: FreeForm | None = None
    """Pod security context (core/v1 PodSecurityContext), merged over the operator's
    (fsGroup 10001, which keeps its Secret files readable by the image's user)."""
    container_security_context: FreeForm | None = None
    """Security context of the main container (core/v1 SecurityContext)."""
    init_containers: list[Container] = Field(default_factory=list, max_length=8)
    """Containers run to completion before the main one (core/v1 Container), e.g. to copy
    a model or data onto a volume."""


class Synchronizer(PodTemplate):
    """The merge service: a StatefulSet of `shards` pods in this cluster, reached by every
    learner group, with the pod template fields (`PodTemplate`) of its pods."""

    quorum: int = Field(1, ge=1, le=MAX_REPLICAS * MAX_GROUPS)
    """K: minimum number of learners whose contributions a merge waits for."""
    grace_gamma: float = Field(0.5, gt=0, lt=1)
    """gamma: fraction of the measured slack spent waiting for stragglers (0 < gamma < 1)."""
    grace_cap_steps: float = Field(1.0, ge=0)
    """Upper bound of the grace window, in inner steps."""
    merge: Literal["rda", "mean"] = "rda"
    """How contributions are combined: radial-directional averaging or a plain mean."""
    merge_scale: Literal["live", "contributors"] = "live"
    """What a merge is averaged over: the whole live set's tokens per period (`live`: K = 1
    moves like averaging) or only the contributions present (`contributors`)."""
    outer_learning_rate: float = Field(0.7, gt=0)
    """eta: outer (Nesterov) learning rate."""
    outer_momentum: float = Field(0.9, ge=0, lt=1)
    """mu: outer momentum."""
    max_staleness: int = Field(4, ge=0, le=1000)
    """Merge an update based on up to this many versions before the current one into the
    next round (0: refuse any update whose round already merged)."""
    resources: Resources = Resources()
    """Resources of the synchronizer container."""
    storage: Storage = Storage()
    """The synchronizer's state volume."""
    tls: Tls = Tls()
    """HTTPS for the synchronizer: certificates, who issues them, mutual TLS."""
    external_names: list[
        Annotated[str, Field(min_length=1, max_length=253, pattern=EXTERNAL_NAME)]
    ] = Field(default_factory=list, max_length=32)
    """Extra DNS names or IP addresses for the server certificate: the addresses learners in
    other clusters reach the synchronizer at (a load balancer, a DNS name). The hosts of the
    learner groups' https syncUrls are added without being listed here."""
    shards: int = Field(1, ge=1, le=MAX_SHARDS)
    """S: synchronizer shards, one pod and one state volume each; each owns a balanced share
    of the fragments (by bytes) and learners send every fragment to its owner. Fixed for the
    job's life: the apiserver refuses a change (there is no resharding)."""
    token_rotation_grace_seconds: float = Field(300.0, ge=0, le=86_400)
    """After a token rotation (annotation ddiloco.dev/rotate-token), how long the old token
    stays accepted beside the new one (seconds), so every learner re-reads its Secret first."""


class SecretKeyRef(_Model):
    """A key of a Secret in the job's namespace."""

    name: str = Field(min_length=1, max_length=253, pattern=SECRET_NAME)
    """Name of the Secret."""
    key: str = Field("kubeconfig", min_length=1, max_length=253, pattern=SECRET_KEY)
    """Key in the Secret that holds a kubeconfig file."""


class Cluster(_Model):
    """Where a learner group runs: this cluster, or the one a kubeconfig Secret points at."""

    kubeconfig_secret: SecretKeyRef
    """Secret (in the job's namespace) with a kubeconfig for the remote cluster or region."""
    namespace: str | None = Field(None, max_length=63, pattern=DNS_LABEL)
    """Namespace in the remote cluster; defaults to the job's namespace name."""


INSECURE_MESSAGE: Final = (
    "a learner group in another cluster needs an https:// syncUrl (its token and updates "
    "cross the network); set insecure: true on the group to allow http://"
)


GPU_TWICE_MESSAGE: Final = (
    f"a learner group sets gpusPerLearner and also {GPU_RESOURCE} in resources: "
    "name the GPUs once, in gpusPerLearner"
)


class LearnerGroup(PodTemplate):
    """A set of interchangeable learner slots in one cluster (e.g. one region's GPUs), with
    the pod template fields (`PodTemplate`) its learner pods and hot spares share."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "!has(self.minReplicas) || self.minReplicas <= self.replicas",
                    "message": "minReplicas must be at most replicas",
                },
                {
                    "rule": "!has(self.cluster) || has(self.syncUrl)",
                    "message": "a learner group in another cluster needs a syncUrl: the home "
                    "cluster's Service name does not resolve there",
                },
                {
                    "rule": "!has(self.cluster) || !has(self.syncUrl) || "
                    "self.syncUrl.split(',').all(u, u.startsWith('https://')) || "
                    "(has(self.insecure) && self.insecure)",
                    "message": INSECURE_MESSAGE,
                },
                {
                    "rule": "!has(self.gpusPerLearner) || self.gpusPerLearner == 0 || "
                    "!has(self.resources) || "
                    f"((!has(self.resources.requests) || !('{GPU_RESOURCE}' in "
                    "self.resources.requests)) && (!has(self.resources.limits) || "
                    f"!('{GPU_RESOURCE}' in self.resources.limits)))",
                    "message": GPU_TWICE_MESSAGE,
                },
            ]
        }
    )

    name: str = Field(min_length=1, max_length=MAX_GROUP_NAME, pattern=DNS_LABEL)
    """Group name: a DNS label, unique in the job; part of learner ids and pod names."""
    cluster: Cluster | None = None
    """Target cluster; unset means the operator's own cluster."""
    replicas: int = Field(1, ge=0, le=MAX_REPLICAS)
    """Number of learner slots; changing it adds or removes the highest-numbered slots."""
    min_replicas: int | None = Field(None, ge=1, le=MAX_REPLICAS)
    """Fewest learner slots the group may start with when it is queued in Kueue (the job's
    `kueue.x-k8s.io/queue-name` label) and the queue's quota is short: Kueue's partial
    admission then admits between this and replicas (the Workload pod set's minCount).
    Unset: all replicas or none. No effect on a job without a queue."""
    gpus_per_learner: int = Field(0, ge=0, le=MAX_GPUS_PER_LEARNER)
    """GPUs of each learner pod (nvidia.com/gpu, requested and limited). The learner then
    runs one training process per GPU, a data-parallel group that is one learner to the
    synchronizer (DDILOCO_NPROC_PER_NODE), and gets a memory-backed /dev/shm (shmSize) and a
    toleration of the nvidia.com/gpu taint. 0: a CPU learner, one process, unless resources
    name nvidia.com/gpu (the older spelling; that count is used the same way)."""
    resources: Resources = Resources()
    """Resources of each learner container: CPU and memory per learner, e.g. requests
    {cpu: "12", memory: 96Gi}, limits {memory: 128Gi}. GPUs go in gpusPerLearner."""
    shm_size: ByteQuantity | None = None
    """Size limit of each learner pod's /dev/shm (an emptyDir of medium Memory), where NCCL
    and data loader workers exchange buffers between the learner's processes; its pages count
    against the container's memory. Unset: 1Gi per GPU, at most half the memory limit, and
    none for a CPU learner (the container runtime's 64 MiB)."""
    termination_grace_period_seconds: int = Field(DEFAULT_GRACE_S, ge=MIN_GRACE_S, le=MAX_GRACE_S)
    """Seconds a learner pod gets between SIGTERM (eviction, preemption, node drain) and
    SIGKILL. The learner hands over every fragment on SIGTERM and waits for those uploads for
    this minus a margin (a quarter, at least 5 s; DDILOCO_DRAIN_S), so it exits 0 in time.
    Hot spares get the same. A node shutdown may cut it short: set at most what your nodes'
    preemption notice gives pods."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels each learner pod requires."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the learner pods tolerate."""
    priority_class_name: str | None = Field(None, max_length=253)
    """PriorityClass of the learner pods (preemptible fleets use a low one)."""
    sync_url: str | None = Field(None, max_length=1024, pattern=SYNC_URL)
    """Synchronizer URL for this group's pods; defaults to the in-cluster Service URL (with
    synchronizer.shards > 1, the shards' in-cluster URLs). With shards > 1 it is a comma list
    of one URL per shard, in shard order (e.g. each shard's load balancer)."""
    insecure: bool = False
    """Allow an http:// syncUrl for a group in another cluster: its token and traffic then
    cross the network in clear text. Without it such a group needs an https:// syncUrl."""


class FailurePolicy(_Model):
    """How the operator replaces learner pods that were evicted, preempted, failed or deleted."""

    max_replacements_per_slot: int = Field(10, ge=0, le=10_000)
    """Replacements allowed per learner slot; past it the job reports Degraded."""
    backoff_seconds: float = Field(1.0, ge=0, le=3600)
    """Delay before a slot's first replacement; it doubles with each further one."""
    max_backoff_seconds: float = Field(300.0, ge=0, le=86_400)
    """Upper bound of the doubling delay."""
    hot_spares: int = Field(0, ge=0, le=MAX_HOT_SPARES)
    """Idle learner pods kept started per learner group (image pulled, Python and torch
    imported, model built), holding no slot. When a slot's pod fails and its replacement is
    due, a Ready spare of its group takes over the slot's identity (learner id, data part)
    within about a second instead of a cold start, and a new spare is started in the
    background. Without a Ready spare the slot is replaced by a new pod, as with 0."""


CHECKPOINT_DEST_MESSAGE: Final = (
    "set exactly one of checkpoints.path (a volume in the synchronizer pod) or checkpoints.url "
    "(object storage)"
)
CHECKPOINT_PATH_MESSAGE: Final = "checkpoints.path must be an absolute path in the synchronizer pod"
CHECKPOINT_OWNED_MESSAGE: Final = (
    f"checkpoints.path is at or below a path the operator mounts ({', '.join(OWNED_MOUNT_PATHS)})"
    ": those go with the job; mount your volume elsewhere through synchronizer.volumeMounts"
)
CHECKPOINT_PERIOD_MESSAGE: Final = "set checkpoints.everyVersions or checkpoints.everySeconds"
CHECKPOINT_SHARDS_MESSAGE: Final = (
    "checkpoints need synchronizer.shards 1: a checkpoint holds every fragment, a shard only "
    "its own"
)


class Checkpoints(_Model):
    """Periodic checkpoints the synchronizer writes outside the job (synchronizer/
    checkpoints.py): each a model directory `from_pretrained` and `training.initFrom` load,
    with the outer optimizer's state beside it, so a new job resumes from one. Deleting the
    job never deletes them."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {"rule": "has(self.path) != has(self.url)", "message": CHECKPOINT_DEST_MESSAGE},
                {
                    "rule": "!has(self.path) || self.path.startsWith('/')",
                    "message": CHECKPOINT_PATH_MESSAGE,
                },
                {
                    "rule": f"!has(self.path) || !{_cel_list(OWNED_MOUNT_PATHS)}.exists(o, "
                    "self.path == o || self.path.startsWith(o + '/'))",
                    "message": CHECKPOINT_OWNED_MESSAGE,
                },
                {
                    "rule": "(has(self.everyVersions) && self.everyVersions > 0) || "
                    "(has(self.everySeconds) && self.everySeconds > 0)",
                    "message": CHECKPOINT_PERIOD_MESSAGE,
                },
            ]
        }
    )

    path: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^\S+$")
    """Absolute path in the synchronizer pod: a volume you mount through synchronizer.volumes
    and synchronizer.volumeMounts (a claim of your own, so that it outlives the job).
    Exclusive with url."""
    url: str | None = Field(
        None, min_length=1, max_length=1024, pattern=r"^[a-z][a-z0-9+.-]*://\S+$"
    )
    """Object storage, e.g. s3://bucket/prefix; credentials from the synchronizer's
    environment (synchronizer.envFrom a Secret with AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY,
    and AWS_ENDPOINT_URL for an S3-compatible store). Exclusive with path."""
    every_versions: int = Field(0, ge=0)
    """A checkpoint each time the global version moves this much; 0: not by versions."""
    every_seconds: float = Field(0, ge=0)
    """A checkpoint this often (seconds) while merges happen; 0: not by time."""
    keep: int = Field(3, ge=1, le=1000)
    """The newest checkpoints kept; older ones are deleted."""

    def dest(self) -> str:
        """The synchronizer's DDILOCO_CHECKPOINT_DEST."""
        return str(self.path or self.url)


EVALUATION_PERIOD_MESSAGE: Final = "set evaluation.everyVersions or evaluation.everySeconds"
EVALUATION_MUTUAL_MESSAGE: Final = (
    "evaluation is not available with synchronizer.tls.mutual: the evaluator has no client "
    "certificate of its own"
)


class Evaluation(PodTemplate):
    """An evaluator: `ddiloco evaluate` in a pod of its own (Deployment `<job>-evaluator`),
    which measures the global model's held-out loss and perplexity as it trains, with the
    learners' model and data settings (`training`), and reports each result to the
    synchronizer (status.evaluation, `kubectl get ddj` column Eval Loss, the ddiloco_eval_*
    gauges). It only reads: merges never wait for it. Its credential (Secret
    `<job>-evaluator-token`) reads the model and posts evaluations, nothing else. With the pod
    template fields (`PodTemplate`): mount the data volume, set resources."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "(has(self.everyVersions) && self.everyVersions > 0) || "
                    "!has(self.everySeconds) || self.everySeconds > 0",
                    "message": EVALUATION_PERIOD_MESSAGE,
                },
            ]
        }
    )

    data: str | None = Field(None, min_length=1, max_length=1024)
    """The data whose held-out part is measured, a path in the evaluator's pod (split as the
    learners split theirs: the tail of a token file, every 20th document); unset: the
    learners' training.data, so the held-out set is exactly the one every learner holds out."""
    every_versions: int = Field(0, ge=0, le=1_000_000)
    """N: measure when the global version moved this many merges past the last measurement;
    0: not by versions."""
    every_seconds: float = Field(300.0, ge=0, le=7 * 86_400)
    """T: measure when this many seconds passed since the last measurement and the model
    changed; 0: not by time."""
    eval_batches: int = Field(8, ge=1, le=100_000)
    """Batches of held-out sequences per measurement (of training.batchSize sequences each)."""
    tensorboard_dir: str | None = Field(None, min_length=1, max_length=1024, pattern=r"^/\S*$")
    """Absolute path in the evaluator's pod (a volume you mount through volumes and
    volumeMounts) where it writes TensorBoard event files (eval/loss, eval/perplexity);
    unset: none."""
    resources: Resources = Resources()
    """Resources of the evaluator container (it holds one copy of the model, no optimizer)."""
    node_selector: dict[str, str] = Field(default_factory=dict)
    """Node labels the evaluator pod requires."""
    tolerations: list[Toleration] = Field(default_factory=list, max_length=32)
    """Taints the evaluator pod tolerates."""


# CEL: a field's value, or its default where unset (a job made before the field existed).
_SHARDS: Final = (
    "(has({x}.synchronizer) && has({x}.synchronizer.shards) ? {x}.synchronizer.shards : 1)"
)
_ENCODING: Final = "(has({x}.updateEncoding) ? {x}.updateEncoding : 'bfloat16')"
SHARDS_IMMUTABLE_MESSAGE: Final = (
    "synchronizer.shards cannot change on an existing job: each shard's state volume holds "
    "the fragments it owns and there is no resharding; create a new job to change it"
)
ENCODING_IMMUTABLE_MESSAGE: Final = (
    "updateEncoding cannot change on an existing job: its synchronizer would refuse the "
    "updates of the learners still running with the old one; create a new job to change it"
)
SHARDS_FRAGMENTS_MESSAGE: Final = (
    "synchronizer.shards must not exceed training.fragments: each shard owns at least one "
    "fragment (more shards would stand idle, each with a pod and a volume)"
)
TLS_OFF_HTTPS_MESSAGE: Final = (
    "a learner group in this cluster names an https:// syncUrl while "
    "synchronizer.tls.enabled is false: the synchronizer then serves plain h2c, use http:// "
    "(a group in another cluster may reach it through a proxy that terminates TLS)"
)
MANAGED_BY_MESSAGE: Final = (
    f"managedBy within ddiloco.dev must be {MANAGED_BY_US}; another controller's name has "
    "its own domain (e.g. kueue.x-k8s.io/multikueue)"
)
SYNC_URLS_MESSAGE: Final = (
    "a learner group's syncUrl must list one URL per synchronizer shard "
    "(synchronizer.shards), comma-separated, in shard order"
)


class JobSpec(_Model):
    """Desired state of a DecoupledDiLoCoJob."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": "self.synchronizer.quorum <= self.learnerGroups.map(g, g.replicas).sum()",
                    "message": "synchronizer.quorum must not exceed the total replicas of learnerGroups",
                },
                {
                    "rule": "!has(self.training.dataParts) || "
                    "self.learnerGroups.map(g, g.replicas).sum() <= self.training.dataParts",
                    "message": "the total replicas of learnerGroups must not exceed "
                    "training.dataParts: every learner slot needs its own data part",
                },
                {
                    "rule": "has(self.managedBy) == has(oldSelf.managedBy) && "
                    "(!has(self.managedBy) || self.managedBy == oldSelf.managedBy)",
                    "message": "managedBy is immutable",
                },
                {
                    "rule": f"{_SHARDS.format(x='self')} == {_SHARDS.format(x='oldSelf')}",
                    "message": SHARDS_IMMUTABLE_MESSAGE,
                },
                {
                    "rule": f"{_ENCODING.format(x='self')} == {_ENCODING.format(x='oldSelf')}",
                    "message": ENCODING_IMMUTABLE_MESSAGE,
                },
                {
                    "rule": "self.learnerGroups.all(g, !has(g.syncUrl) || "
                    f"g.syncUrl.split(',').size() == {_SHARDS.format(x='self')})",
                    "message": SYNC_URLS_MESSAGE,
                },
                {
                    "rule": f"{_SHARDS.format(x='self')} <= "
                    "(has(self.training.fragments) ? self.training.fragments : 4)",
                    "message": SHARDS_FRAGMENTS_MESSAGE,
                },
                {
                    "rule": "!has(self.synchronizer) || !has(self.synchronizer.tls) || "
                    "!has(self.synchronizer.tls.enabled) || self.synchronizer.tls.enabled || "
                    "self.learnerGroups.all(g, has(g.cluster) || !has(g.syncUrl) || "
                    "!g.syncUrl.contains('https://'))",
                    "message": TLS_OFF_HTTPS_MESSAGE,
                },
                {
                    "rule": "!has(self.managedBy) || !self.managedBy.startsWith('ddiloco.dev/') "
                    f"|| self.managedBy == '{MANAGED_BY_US}'",
                    "message": MANAGED_BY_MESSAGE,
                },
                {
                    "rule": f"!has(self.checkpoints) || {_SHARDS.format(x='self')} == 1",
                    "message": CHECKPOINT_SHARDS_MESSAGE,
                },
                {
                    "rule": "!has(self.evaluation) || !has(self.synchronizer) || "
                    "!has(self.synchronizer.tls) || !has(self.synchronizer.tls.mutual) || "
                    "!self.synchronizer.tls.mutual",
                    "message": EVALUATION_MUTUAL_MESSAGE,
                },
            ]
        }
    )

    image: str = Field(min_length=1, max_length=512, pattern=IMAGE)
    """Container image with the `ddiloco` command, for the synchronizer and the learners."""
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    """Pull policy of every container the job creates."""
    training: Training
    """Model, data and schedule of every learner."""
    synchronizer: Synchronizer = Synchronizer()
    """The merge service."""
    learner_groups: list[LearnerGroup] = Field(
        min_length=1,
        max_length=MAX_GROUPS,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Learner groups, each in one cluster; names are unique."""
    failure_policy: FailurePolicy = FailurePolicy()
    """Replacement of failed learner pods."""
    checkpoints: Checkpoints | None = None
    """Periodic checkpoints of the global model and the outer state, written by the
    synchronizer to your volume or bucket; unset: none."""
    evaluation: Evaluation | None = None
    """An evaluator pod measuring the global model's held-out loss as it trains; unset: none."""
    update_encoding: UpdateEncoding = "bfloat16"
    """How learners encode the updates they send: bfloat16, float32, or int8 / int4
    (blockwise absmax scales, with error feedback on the learner). The synchronizer accepts
    only this encoding. Fixed for the job's life."""
    broadcast_encoding: BroadcastEncoding = DEFAULT_BROADCAST_ENCODING
    """How learners download merged fragments: bfloat16 (the default: level with float32 at
    equal tokens, at half its bytes), float32, int8, or int8-delta / int4-delta (the change
    since the copy the learner holds, quantized with its error carried into the next: every
    learner holds what the synchronizer serves bit for bit; one that missed a version gets it
    whole). int8-delta measured level with float32 at a quarter of its bytes, for links that
    are the bottleneck; its encoding costs the synchronizer seconds per merge of a large
    fragment on few cores (bench/RESULTS.md, "Downloads" and "The round trip"), so it is not
    the default."""
    suspend: bool = False
    """While true no learner pods run and the synchronizer is scaled to zero (Kueue sets it)."""
    managed_by: str | None = Field(None, min_length=3, max_length=63, pattern=MANAGED_BY)
    """Controller that reconciles this job, a domain-prefixed name (Kueue's MultiKueue:
    kueue.x-k8s.io/multikueue); unset or "ddiloco.dev/operator" means this one, and no other
    name in ddiloco.dev is one."""

    def total_replicas(self) -> int:
        return sum(g.replicas for g in self.learner_groups)


class Condition(_Model):
    """A status condition, as metav1.Condition."""

    type: str
    """Condition type: Ready, SynchronizerReady, LearnersReady, Degraded, Suspended,
    Complete or Failed."""
    status: Literal["True", "False", "Unknown"]
    """Whether the condition holds."""
    reason: str
    """CamelCase reason for the last transition."""
    message: str = ""
    """One sentence for humans."""
    last_transition_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    """When the status last changed."""
    observed_generation: int | None = None
    """metadata.generation the condition was computed from."""


class FormerPlace(_Model):
    """Where a learner group's objects were left when its cluster changed (its kubeconfig
    Secret edited to point elsewhere, another Secret named, or another namespace): cleaned,
    then forgotten. No credentials: the operator reaches it with the client it last used."""

    server: str = Field(max_length=2048)
    """The API server URL the group's objects were made through."""
    namespace: str = Field(max_length=253)
    """Their namespace there."""
    kubeconfig_secret: str | None = Field(None, max_length=253)
    """The kubeconfig Secret it was reached with then (None: the operator's own cluster)."""


class FailedSlots(_Model):
    """Slots of a group whose last pod failed and is not replaced yet, by reason and time."""

    slots: str
    """Slot indexes as ranges, as a Job's completedIndexes: "0-3,7"."""
    reason: str
    """Why their last pod went away: Evicted, Preempted, OOMKilled, Error, Deleted, ..."""
    time: str = Field(json_schema_extra={"format": "date-time"})
    """When the failure was seen (the replacement backoff counts from it)."""


class GroupStatus(_Model):
    """Observed state of one learner group, with the bookkeeping of its slots in compact form
    (a few fields per group, not an object per slot, so the status stays small at the CRD's
    largest spec)."""

    name: str
    """Group name."""
    cluster: str
    """"local", or the kubeconfig Secret the group's cluster is reached through."""
    kubeconfig_secret: SecretKeyRef | None = None
    """The group's kubeconfig Secret, kept so a removed group's pods can still be found."""
    namespace: str | None = None
    """Namespace of the group's pods in its cluster."""
    desired: int = 0
    """Slots the spec asks for."""
    ready: int = 0
    """Learner pods that are Ready."""
    replaced: int = 0
    """Replacements made in this group since the job started."""
    parts: list[int] = Field(default_factory=list)
    """Data part of each slot, by slot index (of status.dataParts): allocated once per slot,
    kept by its replacements, freed when the slot is scaled away."""
    slot_replacements: list[int] = Field(default_factory=list)
    """Replacement pods made for each slot, by slot index; empty while none was replaced."""
    live_slots: str = ""
    """Slots whose current pod the operator has seen, as ranges ("0-3,7"): one that vanishes
    from there was deleted, a failure."""
    failed_slots: list[FailedSlots] = Field(default_factory=list)
    """Slots whose pod failed and whose replacement is pending (backoff) or refused (limit)."""
    spares: int = 0
    """Hot spare pods of the group that hold no slot (failurePolicy.hotSpares)."""
    spares_ready: int = 0
    """Of those, the Ready ones: what a failed slot can be handed to at once."""
    promoted: int = 0
    """Replacements in this group made by promoting a hot spare since the job started."""
    server: str | None = Field(None, max_length=2048)
    """The API server URL of the group's cluster when last seen (no credentials), so that
    moving the group elsewhere leaves a record of where its objects are."""
    former: list[FormerPlace] = Field(default_factory=list, max_length=8)
    """Places the group's objects were left when its cluster changed, until cleaned."""


class SlotStatus(_Model):
    """A learner slot that is not healthy: its pod failed and is not replaced yet."""

    id: str
    """Learner id, "<group>-<index>"."""
    replacements: int = 0
    """Replacement pods made for this slot so far."""
    last_failure_reason: str | None = None
    """Why the last pod went away: Evicted, Preempted, OOMKilled, Error, Deleted, ..."""
    last_failure_time: str | None = Field(None, json_schema_extra={"format": "date-time"})
    """When the last failure was seen."""
    limit_reached: bool = False
    """The slot used up failurePolicy.maxReplacementsPerSlot and stays empty."""


class ComponentStatus(_Model):
    """Pod counts of one component of the job, in the shape of a Kubeflow TrainJob's
    status.jobsStatus entries (counts of pods here, not of child Jobs)."""

    name: str
    """`synchronizer`, `learners-<group>` (the names of the job's Kueue pod sets) or
    `evaluator`."""
    active: int = Field(0, ge=0)
    """Pods that are pending or running and not counted failed (learners: hot spares not
    included, status.groups[].spares has them)."""
    ready: int = Field(0, ge=0)
    """Of those, the Ready ones."""
    succeeded: int = Field(0, ge=0)
    """Pods that finished (a learner that exited 0: its slot is done)."""
    failed: int = Field(0, ge=0)
    """Learners: slots whose pod failed and that hold no pod now (waiting for the
    replacement's backoff, or at the replacement limit). Synchronizer: pods that failed or
    whose container crash-loops (CrashLoopBackOff)."""
    suspended: int = Field(0, ge=0)
    """Pods the spec asks for that do not run because the job is suspended (spec.suspend,
    or not admitted by Kueue)."""


class SynchronizerStatus(_Model):
    """Where the synchronizer is and whether it answers."""

    endpoint: str | None = None
    """In-cluster URL of the synchronizer Service; with shards > 1 every shard's URL,
    comma-separated in shard order (what in-cluster learners get as DDILOCO_SYNC_URL)."""
    ready: bool = False
    """The synchronizer StatefulSet has every shard's pod available."""
    reachable: bool = False
    """The operator's last request to every shard's status endpoint got an answer."""
    shards: int | None = None
    """Synchronizer shards (spec.synchronizer.shards)."""
    available_shards: int | None = None
    """Shard pods that are available (the StatefulSet's availableReplicas)."""


class EvaluationStatus(_Model):
    """The latest evaluation of the global model, as the synchronizer holds it."""

    loss: float
    """Held-out loss of the global model, nats per token (`kubectl get ddj`, column Eval Loss)."""
    perplexity: float
    """e^loss."""
    global_version: int
    """The global version it was measured at."""
    time: str = Field(json_schema_extra={"format": "date-time"})
    """When the synchronizer received it."""


class JobStatus(_Model):
    """Observed state, written only by the operator."""

    phase: (
        Literal["Pending", "Running", "Degraded", "Suspended", "Succeeded", "Failed", "Invalid"]
        | None
    ) = None
    """Summary of the conditions for `kubectl get`; never a trigger."""
    observed_generation: int | None = None
    """metadata.generation this status was computed from."""
    conditions: list[Condition] = Field(
        default_factory=list,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["type"]},
    )
    """Ready, SynchronizerReady, LearnersReady, Degraded; Suspended, Complete and Failed when
    they apply (operator/conditions.py says when each is True)."""
    desired_learners: int | None = None
    """Learner slots in all groups."""
    ready_learners: int | None = None
    """Learner pods that are Ready, in all groups."""
    groups: list[GroupStatus] = Field(default_factory=list)
    """Per-group counts and slot bookkeeping."""
    components: list[ComponentStatus] = Field(
        default_factory=list,
        max_length=MAX_GROUPS + 2,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]},
    )
    """Pod counts per component: the synchronizer, each learner group, the evaluator when
    spec.evaluation is set."""
    slots: list[SlotStatus] = Field(
        default_factory=list,
        max_length=MAX_SLOT_DETAIL,
        json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["id"]},
    )
    """Up to 32 slots that are not healthy (a failed pod not replaced yet), those at the
    replacement limit first; status.groups has every slot's counts."""
    unhealthy_slots: int | None = None
    """Slots that are not healthy, in all groups (status.slots lists up to 32 of them)."""
    data_parts: int | None = None
    """Data parts the training data is cut into (spec.training.dataParts, or the total
    replicas when the job started); every learner trains part groups[].parts[i] of these."""
    synchronizer: SynchronizerStatus | None = None
    """The synchronizer's endpoint and readiness."""
    global_version: int | None = None
    """Merges applied by the synchronizer (its global version), from its status endpoint."""
    merges: int | None = None
    """Fragment merges the synchronizer has done."""
    tokens_merged: int | None = None
    """Tokens behind all merged contributions."""
    goodput: float | None = None
    """Fraction of learner compute that ended up in a merge (0..1), if the synchronizer knows it."""
    merged_work_ratio: float | None = None
    """Tokens merged over the tokens all learners report having trained (0..1): the share of
    the work done that reached the global model (`kubectl get ddj`, column Merged)."""
    live_learners: int | None = None
    """Learners the synchronizer heard from recently (`kubectl get ddj`, column Live)."""
    progress_percentage: int | None = Field(None, ge=0, le=100)
    """Percent of training.totalTokens merged (`kubectl get ddj`, column Progress); unset
    without a budget."""
    estimated_remaining_seconds: int | None = Field(None, ge=0)
    """Seconds until training.totalTokens are merged at the recent merged-token rate
    (`kubectl get ddj`, column Remaining); 0 once reached, unset before a rate is known."""
    evaluation: EvaluationStatus | None = None
    """The latest held-out evaluation of the global model (spec.evaluation's evaluator)."""


class DecoupledDiLoCoJob(_Model):
    """One Decoupled DiLoCo training run: a synchronizer here, learner pods in many clusters."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                {
                    "rule": f"self.metadata.name.size() <= {MAX_JOB_NAME}",
                    "message": f"metadata.name must be at most {MAX_JOB_NAME} characters",
                },
                {
                    "rule": f"self.metadata.name.matches('{DNS_LABEL}')",
                    "message": "metadata.name must be a DNS-1035 label: lower-case letters, "
                    "digits and '-', starting with a letter, no '.' (it names a Service)",
                },
            ]
        }
    )

    api_version: str = API_VERSION
    kind: str = KIND
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: JobSpec
    status: JobStatus = JobStatus()

    @classmethod
    def from_body(cls, body: Any) -> DecoupledDiLoCoJob:
        """Parse a job from the API (a dict or kopf's Body); raises pydantic.ValidationError."""
        raw = dict(body)
        try:  # a status written by another operator version must not block the job
            status = JobStatus.model_validate(known_status(dict(raw.get("status") or {})))
        except ValidationError:
            status = JobStatus()
        return cls.model_validate(
            {
                "apiVersion": raw.get("apiVersion", API_VERSION),
                "kind": raw.get("kind", KIND),
                "metadata": dict(raw.get("metadata") or {}),
                "spec": dict(raw.get("spec") or {}),
                "status": status,
            }
        )

    @property
    def name(self) -> str:
        return str(self.metadata["name"])

    @property
    def namespace(self) -> str:
        return str(self.metadata.get("namespace") or "default")

    @property
    def uid(self) -> str:
        return str(self.metadata.get("uid") or "")

    @property
    def generation(self) -> int:
        return int(self.metadata.get("generation") or 0)

    def is_ours(self) -> bool:
        return self.spec.managed_by in (None, MANAGED_BY_US)


def known_status(status: dict[str, Any]) -> dict[str, Any]:
    # The status subresource may hold fields of an older operator version; ignore, don't fail.
    fields = {f.alias or n for n, f in JobStatus.model_fields.items()}
    return {k: v for k, v in status.items() if k in fields}


def validate(spec: JobSpec) -> list[str]:
    """Problems of a spec the apiserver did not validate: the CRD's own CEL rules, evaluated
    as the apiserver does (rules.py), then what the structural schema enforces by itself
    (list-map keys are unique) and what the rules do not say (an IPv6 literal in
    externalNames)."""
    from ddiloco.operator import rules

    problems = rules.problems(spec.model_dump(mode="json", by_alias=True, exclude_none=True))
    names = [g.name for g in spec.learner_groups]
    if len(set(names)) != len(names):
        problems.append("learnerGroups names must be unique")
    for name in spec.synchronizer.external_names:
        if ":" in name:
            try:
                ipaddress.IPv6Address(name)
            except ValueError:
                problems.append(
                    f"synchronizer.externalNames: {name!r} is neither a DNS name nor an IP address"
                )
    return problems
