"""Synchronizer shards: S processes, each owning a balanced subset of the fragments.

    ddiloco synchronizer --shard 0 --shards 2 --port 8470 --state-dir state-0
    ddiloco synchronizer --shard 1 --shards 2 --port 8471 --state-dir state-1
    DDILOCO_SYNC_URL=http://h:8470,http://h:8471 ddiloco learner ...   # in shard order
    job = merge_statuses([client.status() for client in shard_clients])

Rounds are per fragment already, so shards need no coordination on the merge path: shard
`i` owns the fragments `protocol.shard_map(layout, S)` gives it and keeps their Theta,
outer momentum, versions, pending logs and merges in its own state directory. Every shard
receives the whole init upload and keeps only its own fragments (decoded straight from the
payload's bytes: no float32 copy of another shard's fragment is ever made). Learners
heartbeat to every shard, so each shard's liveness and step time (the grace window's
inputs) see every learner, and each shard's ledger keeps each slot's data position.

A shard's own `Status` lists only the fragments it owns (`FragmentStatus.shard` says
whose), its `global_version`, `merges`, contributions and bytes count only those, and its
`tokens_merged` is the average over its own fragments (every fragment sees every token, so
that is already an estimate of the job's). `merge_statuses` makes the job's view; its
definitions (ledger.py) are the one-shard ones over the whole layout. Each shard serves its
own /metrics (per-fragment series for its own fragments; a learner's merged tokens there are
divided by the whole layout's P, so summing that series over the shards gives the job's).
This module imports no torch at module level: the operator and `ddiloco status` use
`merge_statuses`.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.wire.protocol import (
    FragmentStatus,
    Layout,
    LearnerStatus,
    Status,
    shard_map,
)

if TYPE_CHECKING:
    import torch

    from ddiloco.synchronizer.config import SyncSettings
    from ddiloco.synchronizer.storage.state import FragmentState, StateStore
    from ddiloco.wire.codec import Header
    from ddiloco.wire.tls import ClientTLS

SHARD_FILE = "shard.json"
"""In a shard's state directory: which shard of how many wrote it (absent: shard 0 of 1)."""


# ---- the synchronizer's side -------------------------------------------------------
def owners(layout: Layout | None, settings: SyncSettings) -> list[int]:
    """The owner shard of each fragment (`protocol.shard_map`); [] before init."""
    return [] if layout is None else shard_map(layout, settings.shards)


def check_state_dir(settings: SyncSettings) -> None:
    """Refuse (ValueError, one line) a state directory another shard, or a job of another S,
    wrote: its fragments are not ours, and there is no resharding."""
    path = Path(settings.state_dir) / SHARD_FILE
    if not path.exists():
        if settings.shards > 1 and (Path(settings.state_dir) / "layout.json").exists():
            raise ValueError(
                f"state dir {settings.state_dir} belongs to an unsharded synchronizer; shard "
                f"{settings.shard} of {settings.shards} needs a state dir of its own"
            )
        return
    saved = json.loads(path.read_text())
    mine = {"shard": settings.shard, "shards": settings.shards}
    if {k: saved.get(k) for k in mine} != mine:
        raise ValueError(
            f"state dir {settings.state_dir} is shard {saved.get('shard')} of "
            f"{saved.get('shards')}, not shard {settings.shard} of {settings.shards}: give each "
            "shard its own state dir, and keep S for the life of the job (no resharding)"
        )


def save_state_dir(settings: SyncSettings) -> None:
    """Record which shard of how many this state dir is (atomically, before the layout)."""
    from ddiloco.synchronizer.storage.state import _replace

    root = Path(settings.state_dir)
    tmp = root / f".{SHARD_FILE}.tmp"
    tmp.write_text(json.dumps({"shard": settings.shard, "shards": settings.shards}))
    _replace(tmp, root / SHARD_FILE)


def placeholder() -> FragmentState:
    """What a shard holds for a fragment another shard owns: no tensors, version 0."""
    from ddiloco.synchronizer.storage.state import FragmentState

    return FragmentState({}, {})


def load_owned(store: StateStore, layout: Layout, mine: list[int]) -> list[FragmentState]:
    """The fragment states over the whole layout: ours from their files, placeholders else."""
    keep = set(mine)
    return [
        store.load_fragment(p) if p in keep else placeholder() for p in range(len(layout.fragments))
    ]


def owned_tensors(payload: bytes, header: Header, names: set[str]) -> dict[str, torch.Tensor]:
    """The named tensors of a checked safetensors payload, each a view of its bytes (no
    decode of the others). Callers copy what they keep."""
    import torch

    from ddiloco.wire.codec import ST_DTYPES
    from ddiloco.wire.errors import PayloadError

    start = len(payload) - header.data_bytes
    out = {}
    for name in names:
        t = header.tensors.get(name)
        if t is None:
            continue
        dtype = ST_DTYPES[t.dtype][0]
        count = (t.end - t.begin) // max(1, ST_DTYPES[t.dtype][1])
        if count == 0:
            out[name] = torch.zeros(t.shape, dtype=dtype)
            continue
        try:
            flat = torch.frombuffer(payload, dtype=dtype, count=count, offset=start + t.begin)
        except (ValueError, RuntimeError, TypeError) as e:
            raise PayloadError(f"tensor {name!r} cannot be read: {str(e)[:200]}") from None
        out[name] = flat.view(t.shape)
    return out


def initial_owned(
    layout: Layout, mine: list[int], payload: bytes, header: Header
) -> list[FragmentState]:
    """The version-0 fragment states of an init payload over the whole layout: ours decoded
    and checked (admission.initial_fragments), placeholders for the others."""
    import warnings

    from ddiloco.synchronizer import admission

    specs = [layout.fragments[p] for p in mine]
    names = {t.name for spec in specs for t in spec.tensors}
    with warnings.catch_warnings():  # frombuffer on immutable bytes: we only read, then copy
        warnings.simplefilter("ignore", UserWarning)
        tensors = owned_tensors(payload, header, names)
        ours = admission.initial_fragments(Layout(fragments=specs), tensors)
    out = [placeholder() for _ in layout.fragments]
    for p, fs in zip(mine, ours, strict=True):
        out[p] = fs
    return out


# ---- the job's view ----------------------------------------------------------------
def _freshest(rows: list[LearnerStatus]) -> LearnerStatus:
    """The row last heard from (last_seen_s -1 means never)."""
    heard = [r for r in rows if r.last_seen_s >= 0]
    return min(heard, key=lambda r: r.last_seen_s) if heard else rows[0]


def merge_learners(rows: list[LearnerStatus]) -> LearnerStatus:
    """One learner slot's row from every shard's: alive if alive on any; step, loss, times
    from the freshest; incarnation, data position and tokens computed the highest any shard
    holds (each is a lower bound of the truth); contributions summed (each shard counts the
    merges of its own fragments)."""
    best = _freshest(rows)
    return best.model_copy(
        update={
            "alive": any(r.alive for r in rows),
            "incarnation": max(r.incarnation for r in rows),
            "contributions": sum(r.contributions for r in rows),
            "data_position": max(r.data_position for r in rows),
            "tokens_computed": max(r.tokens_computed for r in rows),
            "slot_steps": max(r.slot_steps for r in rows),
            "compute_seconds": max(r.compute_seconds for r in rows),
            "uptime_seconds": max(r.uptime_seconds for r in rows),
        }
    )


def _xi(statuses: Sequence[Status], key: str, how: Any) -> float | None:
    values = [s.xi.get(key) for s in statuses]
    known = [v for v in values if v is not None]
    return how(known) if known else None


def merge_statuses(statuses: Sequence[Status]) -> Status:
    """The job's Status from its shards' (one status is returned as it is).

    Fragments come from their owners (a fragment two answers list is taken from the one
    whose `shard` matches, else the higher version); versions, merges, contributions,
    refusals and bytes add up; `tokens_merged` is the sum over all fragments over P (as one
    synchronizer averages); learners merge by id (`merge_learners`); goodput is compute over
    uptime of the merged rows, and the merged-work ratio `tokens_merged` over the slots'
    tokens computed (ledger.py's definitions); mean staleness is weighted by contributions;
    xi: step the slowest (max), quorum and sync the mean over shards. The token budget
    (budget.py): the job is finished as soon as any shard is (each shard's count estimates
    the job's, and learners stop on the first shard's `finished`), its progress is then 1,
    else the merged fragments' tokens over the budget; the time left is the shortest any
    shard estimates. The evaluation is the latest any shard holds (evaluators post to shard 0)."""
    if not statuses:
        raise ValueError("merge_statuses needs at least one shard's status")
    if len(statuses) == 1:
        return statuses[0]
    by_index: dict[int, FragmentStatus] = {}
    for s in statuses:
        for f in s.fragments:
            old = by_index.get(f.index)
            if old is None or (old.shard != s.shard and f.version > old.version):
                by_index[f.index] = f.model_copy(update={"shard": s.shard})
    fragments = [by_index[i] for i in sorted(by_index)]
    rows: dict[str, list[LearnerStatus]] = {}
    for s in statuses:
        for r in s.learners:
            rows.setdefault(r.learner_id, []).append(r)
    learners = [merge_learners(rows[k]) for k in sorted(rows)]
    tokens_merged = sum(f.tokens_merged for f in fragments) // max(1, len(fragments))
    merges = sum(s.merges for s in statuses)
    contributions = sum(s.contributions_merged for s in statuses)
    refusals: dict[str, int] = {}
    for s in statuses:
        for k, v in s.refusals.items():
            refusals[k] = refusals.get(k, 0) + v
    compute = sum(r.compute_seconds for r in learners)
    uptime = sum(r.uptime_seconds for r in learners)
    computed = sum(r.tokens_computed for r in learners)
    staleness_w = sum(s.mean_staleness * s.contributions_merged for s in statuses)
    total_tokens = max(s.total_tokens for s in statuses)
    finished = any(s.finished for s in statuses)
    estimates = [
        s.estimated_remaining_seconds for s in statuses if s.estimated_remaining_seconds is not None
    ]
    scale_w = sum(s.mean_merge_scale * s.merges for s in statuses)
    return Status(
        initialized=all(s.initialized for s in statuses),
        global_version=sum(f.version for f in fragments),
        merges=merges,
        tokens_merged=tokens_merged,
        contributions_merged=contributions,
        contributions_rejected=sum(s.contributions_rejected for s in statuses),
        refusals=refusals,
        merges_refused=sum(s.merges_refused for s in statuses),
        mean_contributors=contributions / merges if merges else 0.0,
        mean_staleness=staleness_w / contributions if contributions else 0.0,
        mean_merge_scale=scale_w / merges if merges else 1.0,
        bytes_up=sum(s.bytes_up for s in statuses),
        bytes_down=sum(s.bytes_down for s in statuses),
        goodput=compute / uptime if uptime > 0 else None,
        merged_work_ratio=min(1.0, tokens_merged / computed) if computed > 0 else None,
        fragments=fragments,
        learners=learners,
        xi={
            "step": _xi(statuses, "step", max),
            "quorum": _xi(statuses, "quorum", statistics.fmean),
            "sync": _xi(statuses, "sync", statistics.fmean),
        },
        shard=0,
        shards=max(s.shards for s in statuses),
        total_tokens=total_tokens,
        progress=(1.0 if finished else min(1.0, tokens_merged / total_tokens))
        if total_tokens
        else None,
        estimated_remaining_seconds=(0.0 if finished else min(estimates))
        if total_tokens and (finished or estimates)
        else None,
        finished=finished,
        evaluation=max(
            (s.evaluation for s in statuses if s.evaluation is not None),
            key=lambda e: e.time,
            default=None,
        ),
    )


def split_urls(value: str) -> list[str]:
    """A comma-separated list of shard URLs, in shard order (one URL: one synchronizer)."""
    urls = [u.strip().rstrip("/") for u in value.split(",")]
    if not all(urls):
        raise ValueError(f"empty URL in the shard list {value!r}")
    return urls


class ShardClients:
    """A `SyncClient` per shard behind the calls a launcher or a status reader makes:
    `status()` is `merge_statuses` of every shard's (SyncUnavailable if any is away),
    `fragment(p)` asks p's owner (learnt from the last status), `request` goes to shard 0.

        clients = ShardClients(["http://h:8470", "http://h:8471"], token)
        job = clients.status()
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: Any,
        *,
        timeout: float = 60.0,
        tls: ClientTLS | None = None,
    ) -> None:
        from ddiloco.learner.sync_client import SyncClient

        self.clients = [SyncClient(u, token, timeout=timeout, tls=tls) for u in urls]
        self.owners: dict[int, int] = {}

    @property
    def http_version(self) -> str:
        return self.clients[0].http_version

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.clients)

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.clients)

    def statuses(self) -> list[Status]:
        return [c.status() for c in self.clients]

    def status(self) -> Status:
        job = merge_statuses(self.statuses())
        self.owners = {f.index: f.shard for f in job.fragments}
        return job

    def fragment(self, p: int) -> Any:
        if p not in self.owners:
            self.status()
        return self.clients[self.owners.get(p, 0)].fragment(p)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        return self.clients[0].request(*args, **kwargs)

    def model_spec(self) -> Any:
        """What the job trains (every shard got the same init upload: shard 0's)."""
        return self.clients[0].model_spec()

    def evaluation(self, report: Any) -> Any:
        """Post an evaluation to shard 0, which keeps the job's (`merge_statuses`)."""
        return self.clients[0].evaluation(report)

    def healthy(self) -> bool:
        return all(c.healthy() for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()


def state_dirs(root: Path, shards: int) -> list[Path]:
    """Where `ddiloco local` keeps each shard's state: <root>/state (one), <root>/sync-<i>."""
    if shards == 1:
        return [root / "state"]
    return [root / f"sync-{i}" for i in range(shards)]


__all__ = [
    "ShardClients",
    "check_state_dir",
    "merge_learners",
    "merge_statuses",
    "owners",
    "shard_map",
    "split_urls",
]
