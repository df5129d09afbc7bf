"""Synchronizer shards: S processes, each owning a balanced subset of the fragments.

    ddiloco synchronizer --shard 0 --shards 2 --port 8470 --state-dir state-0
    ddiloco synchronizer --shard 1 --shards 2 --port 8471 --state-dir state-1
    DDILOCO_SYNC_URL=http://h:8470,http://h:8471 ddiloco learner ...   # in shard order

Rounds are per fragment already, so shards need no coordination on the merge path: shard
`i` owns the fragments `protocol.shard_map(layout, S)` gives it and keeps their Theta,
outer momentum, versions, pending logs and merges in its own state directory. Every shard
receives the whole init upload and keeps only its own fragments (decoded straight from the
payload's bytes: no float32 copy of another shard's fragment is ever made). Learners
heartbeat to every shard, so each shard's liveness and step time (the grace window's
inputs) see every learner, and each shard's ledger keeps each slot's data position.

A shard's own `Status` lists only the fragments it owns; `wire/job_status.merge_statuses`
makes the job's view from every shard's, and learner/shard_clients.py is the client of
them all. Each shard serves its own /metrics (per-fragment series for its own fragments; a
learner's merged tokens there are divided by the whole layout's P, so summing that series
over the shards gives the job's).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from ddiloco.wire.protocol import (
    Layout,
    shard_map,
)

if TYPE_CHECKING:
    import torch

    from ddiloco.synchronizer.config import SyncSettings
    from ddiloco.synchronizer.storage.state import FragmentState, StateStore
    from ddiloco.wire.codec import Header

SHARD_FILE = "shard.json"
"""In a shard's state directory: which shard of how many wrote it (absent: shard 0 of 1)."""


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
    from ddiloco.synchronizer.storage.records import load_json

    saved = load_json(path, "shard")
    mine = {"shard": settings.shard, "shards": settings.shards}
    if {k: saved.get(k) for k in mine} != mine:
        raise ValueError(
            f"state dir {settings.state_dir} is shard {saved.get('shard')} of "
            f"{saved.get('shards')}, not shard {settings.shard} of {settings.shards}: give each "
            "shard its own state dir, and keep S for the life of the job (no resharding)"
        )


def save_state_dir(settings: SyncSettings) -> None:
    """Record which shard of how many this state dir is (atomically, before the layout)."""
    from ddiloco.synchronizer.storage.records import save_json

    body = {"shard": settings.shard, "shards": settings.shards}
    save_json(Path(settings.state_dir) / SHARD_FILE, "shard", body)


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


__all__ = [
    "check_state_dir",
    "initial_owned",
    "load_owned",
    "owners",
    "save_state_dir",
]
