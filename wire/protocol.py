"""The wire protocol between learners and the synchronizer (API version v1).

Both sides import this module, as torchft's lighthouse and manager share one proto file.
It imports no torch, so the operator and the CLI can parse status answers cheaply.

Bulk payloads are safetensors bytes (never pickle). Control messages are JSON:

    POST /v1/join                    JoinRequest            -> JoinResponse
    PUT  /v1/init                    safetensors (metadata: layout)   -> InitResponse
    GET  /v1/fragments/{p}           -> safetensors of the global fragment, header X-DDiLoCo-Version
    POST /v1/fragments/{p}/updates   safetensors of the learner's progress on p since its
                                     previous hand-over, metadata = UpdateMeta fields
                                     -> UpdateResponse
    POST /v1/heartbeat               Heartbeat              -> HeartbeatResponse
    GET  /v1/model                   -> ModelSpec (what the init upload said the job trains)
    GET  /v1/status                  -> Status
    POST /v1/evaluations             EvaluationReport (an evaluator's)   -> EvaluationStatus
    PUT  /v1/spares/{pod}            SpareAssignment (the operator's)    -> SpareAnswer
    GET  /v1/spares/{pod}?wait_s=20  -> SpareGrant (a hot spare's), or 204: poll again
    GET  /healthz, GET /metrics

Every /v1 call carries `Authorization: Bearer <credential>`: the job key, or a learner's,
spare's or evaluator's credential derived from it (auth.py; docs/protocol.md).
"""

from __future__ import annotations

import hashlib
import json
from typing import Annotated, Any, Final, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

API_PREFIX: Final = "/v1"
VERSION_HEADER: Final = "X-DDiLoCo-Version"
CONTENT_TYPE: Final = "application/vnd.safetensors"
LAYOUT_KEY: Final = "ddiloco.layout"  # safetensors metadata key carrying the layout JSON
MODEL_KEY: Final = "ddiloco.model"  # init metadata key carrying the ModelSpec JSON (optional)
MAX_COUNT: Final = (1 << 53) - 1
"""The largest count a client may send (steps, tokens, versions, positions): exact in any
JSON reader and in a float, so no sum or ratio of a few of them overflows when rendered."""
MAX_DATA_POSITION: Final = MAX_COUNT
"""The largest data position (windows of a slot's stream) accepted: exact in any JSON."""
MAX_SECONDS: Final = 10 * 365.25 * 86400.0
"""The longest duration a client may report (compute, uptime): ten years, finite."""
MAX_FRAGMENTS: Final = 4096
"""The most fragments a layout may have, and so the longest per-fragment list a heartbeat
may carry (the synchronizer also refuses one longer than its job's layout)."""

UpdateEncoding = Literal["float32", "bfloat16", "int8", "int4"]
"""How a learner's update crosses the wire (wire/encodings.py): float tensors, or
blockwise absmax codes with float32 scales."""
UPDATE_ENCODINGS: Final[tuple[str, ...]] = ("float32", "bfloat16", "int8", "int4")

BroadcastEncoding = Literal["float32", "bfloat16", "int8", "int8-delta", "int4-delta"]
"""How the synchronizer serves merged fragments (wire/broadcast.py): float tensors,
int8 codes of Theta, or int8 / int4 deltas from the version a learner holds."""
BROADCAST_ENCODINGS: Final[tuple[str, ...]] = (
    "float32",
    "bfloat16",
    "int8",
    "int8-delta",
    "int4-delta",
)
DEFAULT_BROADCAST_ENCODING: Final = "bfloat16"
"""What the synchronizer serves unless told otherwise: level with float32 at equal tokens, at
half its bytes (bench/RESULTS.md, "Downloads: bytes up plus down against data-parallel")."""
HELD_QUERY: Final = "held"
"""GET /v1/fragments/{p}?held=<token>: the token of the fragment the learner holds (the
`ddiloco.served` metadata of its last download), for a delta from it (wire/broadcast.py)."""

MergeRule = Literal["rda", "mean"]
"""How a fragment's contributions combine: radial-directional averaging, or the weighted mean."""
MAX_STEP_SECONDS: Final = 3600.0
"""The longest inner step a heartbeat may report; a larger (or non-finite) one is refused, so
one learner cannot stretch every grace window without bound."""


class _Msg(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
"""A client's count: non-negative and at most `MAX_COUNT`."""
Seconds = Annotated[float, Field(ge=0.0, le=MAX_SECONDS)]
"""A client's duration: finite, non-negative, at most `MAX_SECONDS`."""
PerFragment = Annotated[list[Count], Field(max_length=MAX_FRAGMENTS)]
"""A list indexed by fragment (the synchronizer refuses one longer than its layout)."""


class TensorSpec(_Msg):
    name: str
    shape: list[int]
    dtype: str = "float32"


class FragmentSpec(_Msg):
    index: int = Field(ge=0)
    embedding: bool = False
    """An embedding fragment always merges by the weighted mean (the method's rule); every
    other fragment by the synchronizer's configured rule (`SyncSettings.merge`)."""
    tensors: list[TensorSpec]

    def numel(self) -> int:
        total = 0
        for t in self.tensors:
            n = 1
            for d in t.shape:
                n *= d
            total += n
        return total


class Layout(_Msg):
    """How the model's parameters split into fragments; identical on every learner."""

    fragments: list[FragmentSpec] = Field(max_length=MAX_FRAGMENTS)

    def digest(self) -> str:
        raw = json.dumps(self.model_dump(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(raw.encode()).hexdigest()[:16]


def shard_map(layout: Layout, shards: int) -> list[int]:
    """The shard that owns each fragment (indexed like `layout.fragments`), balanced by bytes
    (float32 numel): the largest fragment first onto the least-loaded shard, ties by the lower
    fragment index and then the lower shard. Deterministic, so every shard and every learner
    compute the same map from the same layout; with `shards` = 1 every fragment is shard 0's.

        shard_map(layout, 2)   # e.g. [0, 1, 1, 0]
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    sizes = [f.numel() for f in layout.fragments]
    load = [0] * shards
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        s = min(range(shards), key=lambda k: (load[k], k))
        owner[i] = s
        load[s] += sizes[i]
    return owner


class JoinRequest(_Msg):
    learner_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    layout_digest: str | None = Field(None, max_length=64)
    """The learner's layout digest; a mismatch with the synchronizer's is refused."""
    host: str = Field("", max_length=255)
    pid: int = Field(0, ge=0, le=(1 << 32) - 1)
    data_reserve: int = Field(0, ge=0, le=MAX_DATA_POSITION)
    """Windows of the slot's data stream this learner reserves beyond the position it is
    answered, before its first heartbeat can (learner/corpus.py: the data contract)."""
    tokens_per_step: int | None = Field(None, ge=1, le=MAX_COUNT)
    """The tokens one inner step of this learner trains on, its whole group's (batch x
    sequence length x data-parallel ranks x accumulation steps). Its updates may claim at
    most this many tokens per step (the merge weights a contribution by tokens^2 / steps, so
    an inflated claim would outweigh everyone); at most the synchronizer's
    `max_tokens_per_step`, which is also the bound when this is None."""
    incarnation_floor: int = Field(0, ge=0, le=MAX_DATA_POSITION)
    """The highest incarnation another shard of the job answered this learner (a sharded
    job's learner sends one incarnation to every shard): the join is answered at least
    that, so no shard sees an incarnation it did not issue. It moves only the caller's own
    order forward (a credential speaks for one learner)."""


class JoinResponse(_Msg):
    initialized: bool
    """False until the first learner uploaded the initial parameters (PUT /v1/init)."""
    layout_digest: str | None
    versions: list[int]
    incarnation: int
    """This join's incarnation of the learner id: 1 on its first join, one more on each
    later one, never one it had before. A new id starts above every incarnation of a record
    the synchronizer dropped (`max_learners`), so it may start above 1."""
    data_position: int = 0
    """Where this slot's data stream resumes: the highest data position recorded for this
    learner id (durable in the ledger), before this join's `data_reserve` was added."""
    shard: int = 0
    """This synchronizer's shard index (0 <= shard < shards)."""
    shards: int = 1
    """S, the job's synchronizer shards: a learner sends fragment p to shard `shard_map(layout,
    S)[p]` and heartbeats to every shard. `versions` stays indexed over the whole layout: a
    shard answers 0 for the fragments it does not own."""
    owned: list[int] = []
    """The fragments this shard owns ([] before init)."""
    update_encodings: list[str] = []
    """The update encodings this synchronizer accepts (`UpdateEncoding`s); a learner whose
    own is not among them stops at join with one line."""
    upload_port: int | None = None
    """The port of this synchronizer's upload listener (`SyncSettings.upload_port`, upload_port.py)
    on the host the learner reached it by; None: post updates to the main port."""
    broadcast_encoding: BroadcastEncoding
    """How fragments are served (`SyncSettings.broadcast_encoding`, wire/broadcast.py): with a
    delta encoding a joiner names the copy it holds already (its own initial values) by
    their content, and needs no download of a version 0 that equals them."""
    slot_steps: int = 0
    """Where this slot's inner LR schedule resumes: the highest `Heartbeat.slot_step` any
    incarnation of this learner id reported (durable in the ledger). A replacement starts
    its warm-up and decay there, not at 0."""
    finished: bool = False
    """The job's token budget is merged (`Status.finished`): a joiner stops at once."""
    total_tokens: int = 0
    """The job's token budget in merged tokens (0: none): with `tokens_merged`, where the
    learners' LR schedule stands (learner/schedule.py)."""
    tokens_merged: int = 0
    """The tokens behind merged contributions now (`Status.tokens_merged`)."""


class InitResponse(_Msg):
    created: bool
    layout_digest: str
    versions: list[int]


class UpdateMeta(_Msg):
    """What stands behind one fragment update (carried as safetensors metadata)."""

    learner_id: str = Field(min_length=1, max_length=128)
    fragment: int = Field(ge=0, lt=MAX_FRAGMENTS)
    base_version: Count
    """Version of the global fragment the learner last adopted (its staleness is measured
    from it). The delta is the learner's progress on the fragment since its previous
    hand-over of it or its last adoption, whichever came later: successive updates of one
    learner never overlap, so the synchronizer may merge each of them once, in any round."""
    steps: Count
    """c_steps: inner steps behind the delta."""
    tokens: Count
    """c_tokens: tokens behind those steps (at most the learner's declared tokens per step
    times `steps`, see `JoinRequest.tokens_per_step`)."""
    learner_step: Count
    """The learner's local step t_m when it handed the fragment over."""
    incarnation: Count = 0
    """The learner's incarnation (from its join). With `learner_step` it orders one learner's
    updates of a fragment: the synchronizer keeps, per learner and fragment, the highest
    (incarnation, learner_step) it accepted, durably, and answers `duplicate` to anything at
    or below it, however long ago that was."""
    encoding: UpdateEncoding = "float32"
    """The update's encoding (wire/encodings.py): its tensors are of the float dtype it names
    (or float32, never narrower), or its quantized codes. Always in the metadata; the
    synchronizer refuses one it was not configured for (415)."""

    def update_id(self) -> str:
        return f"{self.learner_id}/{self.fragment}/{self.incarnation}/{self.learner_step}"

    def order(self) -> tuple[int, int]:
        """Position among this learner's updates of this fragment."""
        return (self.incarnation, self.learner_step)

    def to_metadata(self) -> dict[str, str]:
        return {k: str(v) for k, v in self.model_dump().items() if v is not None}

    @classmethod
    def from_metadata(cls, meta: dict[str, str] | None) -> UpdateMeta:
        if not meta:
            raise ValueError("update carries no metadata (learner_id, fragment, base_version, ...)")
        fields = {k: v for k, v in meta.items() if k in cls.model_fields}
        return cls.model_validate(fields)


class UpdateResponse(_Msg):
    status: Literal["accepted", "duplicate"]
    fragment: int
    round_version: int
    """The version this update will help produce once its round merges."""


class Heartbeat(_Msg):
    learner_id: str = Field(min_length=1, max_length=128)
    step: Count
    steps: PerFragment
    """c_steps per fragment."""
    tokens: PerFragment
    """c_tokens per fragment."""
    base_versions: PerFragment
    step_seconds: float = Field(ge=0.0, le=MAX_STEP_SECONDS)
    """Moving average of this learner's inner-step time (xi_step), at most an hour."""
    compute_seconds: Seconds = 0.0
    """Time spent executing inner steps since the process started (at most its uptime)."""
    uptime_seconds: Seconds = 0.0
    tokens_total: Count = 0
    loss: float | None = None
    known_versions: PerFragment = []
    """Fragment versions the learner already knows of (for the long poll)."""
    known_requested: PerFragment = []
    """Requested fragments the learner already knows of (for the long poll)."""
    wait_s: float = Field(0.0, ge=0.0, le=5.0)
    """Long poll: if nothing is new for the learner, answer after at most this long, as soon
    as a fragment merges or a round it could join opens (no busy polling, ~ms latency)."""
    data_position: int = Field(0, ge=0, le=MAX_DATA_POSITION)
    """Windows of the slot's data stream consumed, plus those reserved ahead (learner/
    corpus.py). The synchronizer keeps the highest one durably and answers it at join."""
    slot_step: Count = 0
    """The slot's position in its inner LR schedule: the `slot_steps` answered at this
    incarnation's join plus the steps it took since. The synchronizer keeps the highest."""


class HeartbeatResponse(_Msg):
    versions: list[int]
    requested: list[int]
    """Fragments whose round is collecting: send them now if you have steps on them."""
    finished: bool = False
    """The job's token budget is merged (`Status.finished`): hand over what is pending,
    let the uploads drain and exit 0. Updates still arriving are accepted and merged."""
    tokens_merged: int = 0
    """The tokens behind merged contributions now: the job's progress through its budget
    (`JoinResponse.total_tokens`), which the learners' LR schedule follows."""


class LearnerStatus(_Msg):
    learner_id: str
    alive: bool
    incarnation: int
    step: int
    tokens_total: int
    step_seconds: float
    compute_seconds: float
    uptime_seconds: float
    contributions: int
    last_seen_s: float
    loss: float | None = None
    data_position: int = 0
    """The highest data position recorded for this slot (see Heartbeat.data_position)."""
    tokens_computed: int = 0
    """Tokens the slot computed over all its incarnations, as reported (`tokens_total` is
    the current incarnation's alone)."""
    slot_steps: int = 0
    """The highest LR-schedule step the slot reported (`Heartbeat.slot_step`)."""


FileName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")]
"""A plain file name: no directory part, no leading dot."""


class ModelSpec(_Msg):
    """What the job trains, as the learner that initialized it described it (the init
    upload's `MODEL_KEY` metadata); `ddiloco export` writes a loadable model from it."""

    kind: Literal["gpt", "hf", "entry", "unknown"] = "unknown"
    """gpt: a built-in preset; hf: a Hugging Face config; entry: a --model-entry."""
    name: str = Field("", max_length=4096)
    """The preset, `hf:PATH` or `module:function` the learners were given."""
    config: dict[str, Any] = {}
    """The preset's GPTConfig fields, or the hf model's config.json."""
    tokenizer: Literal["bytes", "hf", ""] = ""
    """bytes: byte-level tokens; hf: the tokenizer whose files are in `files`."""
    files: dict[FileName, str] = {}
    """Text files an hf export needs beside its weights (tokenizer, generation config), by
    file name (plain names only, no paths)."""
    tokenizer_omitted: bool = False
    """The tokenizer's files were too large to carry: an export must be given them."""


class FragmentStatus(_Msg):
    index: int
    merge: MergeRule
    """The rule this fragment's merges use."""
    version: int
    contributors_pending: int
    tokens_merged: int = 0
    """Tokens behind every contribution merged into this fragment."""
    tokens_pending: int = 0
    """Tokens behind accepted contributions waiting in its open round (durable, see state)."""
    shard: int = 0
    """The shard that owns (merges and serves) this fragment."""


MAX_EVAL_LOSS: Final = 700.0
"""The largest eval loss (nats per token) an evaluation may report: its perplexity, e^loss,
is then still a finite float (e^709.8 is the largest). A larger one is refused as absurd."""


class EvaluationReport(_Msg):
    """One measurement of the global model on the held-out set (POST /v1/evaluations), by
    an evaluator (`ddiloco evaluate`, learner/evaluate.py)."""

    loss: float = Field(ge=0.0, le=MAX_EVAL_LOSS)
    """Mean cross-entropy of the global model on the held-out set, nats per token."""
    global_version: Count
    """The global version (sum of fragment versions) of the model measured; at most the
    synchronizer's own (a single synchronizer refuses one from the future)."""
    tokens: Count = 0
    """Held-out tokens the loss is the mean over."""


class EvaluationStatus(_Msg):
    """The latest evaluation the synchronizer was sent (`Status.evaluation`), kept in its
    state directory so that it survives a restart."""

    loss: float
    """Held-out loss of the global model, nats per token."""
    perplexity: float
    """e^loss."""
    global_version: int
    """The global version the loss was measured at."""
    tokens: int = 0
    """Held-out tokens behind the loss."""
    time: float
    """When the synchronizer received it, Unix seconds."""
    evaluator: str = ""
    """Who sent it: the evaluator's name (its credential's), or "job" for the job key."""


class Status(_Msg):
    initialized: bool
    global_version: int
    """Sum of the fragment versions: the number of merges since the run began."""
    merges: int
    tokens_merged: int
    """Tokens behind merged contributions, averaged over fragments (each sees every token)."""
    contributions_merged: int
    contributions_rejected: int
    """Requests refused, all reasons together."""
    refusals: dict[str, int] = {}
    """Requests refused, by reason (`errors.Refusal`)."""
    merges_refused: int = 0
    """Merges refused because their result was not finite (the fragment kept its version)."""
    mean_contributors: float
    mean_staleness: float
    mean_merge_scale: float = 1.0
    """The mean factor merges scaled their progress by (`merge_scale = live`: below 1 when
    a merge had fewer than the whole live set's tokens; 1 with `contributors`)."""
    bytes_up: int
    bytes_down: int
    goodput: float | None
    """Share of learner uptime spent computing inner steps (local/goodput.py defines it for whole slots), None before data."""
    merged_work_ratio: float | None = None
    """`tokens_merged` over the tokens all learner slots report having computed (all their
    incarnations); None before any is reported."""
    fragments: list[FragmentStatus]
    learners: list[LearnerStatus]
    xi: dict[str, float | None]
    """Current moving averages: step (slowest live learner), quorum, sync; seconds."""
    shard: int = 0
    """The shard that answered (a shard's status lists only the fragments it owns, and its
    counts are over those; `job_status.merge_statuses` makes the job's view, `shard` 0 there)."""
    shards: int = 1
    """S, the job's synchronizer shards (1: one synchronizer owns every fragment)."""
    total_tokens: int = 0
    """The job's token budget in merged tokens (`SyncSettings.total_tokens`; 0: none)."""
    progress: float | None = None
    """`tokens_merged` / `total_tokens`, at most 1 (None without a budget)."""
    estimated_remaining_seconds: float | None = None
    """Time until the budget is merged at the recent merged-token rate (0 once finished;
    None without a budget or before a rate is known, e.g. just after a restart)."""
    finished: bool = False
    """`tokens_merged` reached `total_tokens`: the job is done (derived from the durable
    fragment counts, so it holds across restarts)."""
    evaluation: EvaluationStatus | None = None
    """The latest held-out evaluation of the global model an evaluator posted (None before
    any)."""


class SpareAssignment(BaseModel):
    """A learner slot's identity, as a slot pod has it in its env (DDILOCO_LEARNER_ID,
    DDILOCO_LEARNER_INDEX, DDILOCO_NUM_LEARNERS), and where it stands in the slot's books."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    learner_id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9._-]+$")
    """The slot's learner id, `<group>-<index>`."""
    learner_index: int = Field(ge=0, le=1 << 20)
    """The slot's data part."""
    num_learners: int = Field(ge=1, le=1 << 20)
    """The number of data parts."""
    group: str | None = Field(None, max_length=63)
    """The slot's learner group."""
    slot: int | None = Field(None, ge=0, le=1 << 20)
    """The slot's index in its group."""
    attempt: int = Field(0, ge=0, le=1 << 30)
    """Which incarnation of the slot the spare becomes."""

    @model_validator(mode="after")
    def _shard_in_range(self) -> SpareAssignment:
        if self.learner_index >= self.num_learners:
            raise ValueError(
                f"learner_index {self.learner_index} must be below num_learners {self.num_learners}"
            )
        return self


class SpareGrant(SpareAssignment):
    """What the spare is answered: its slot's identity and the slot's learner credential."""

    token: str = Field(repr=False)
    """`auth.learner_token` of `learner_id` under the job key in force: the spare's credential
    from now on (never logged)."""


class SpareAnswer(BaseModel):
    pod: str
    delivered: bool
    """The spare has fetched this assignment (GET answered it)."""
    assignment: SpareAssignment
