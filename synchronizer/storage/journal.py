"""The merge journal: a merge made durable by a record of its inputs, before it is served.

Writing and fsyncing the fragment file (64 MB of Theta and 64 MB of momentum for a 16M-parameter
fragment) before serving would be half of a merge's time (bench/RESULTS.md, "Figures behind the
code"). The merge's inputs are on disk already: every update it took is a record in the fragment's
pending log, written before the update joined its round (its uploader's fsync comes after, so the
merge syncs those segments too: mostly at once). So a merge appends one small record here and fsyncs
it (`MergeRecord`: the fragment's version before, which learners' updates up to which order it took,
in the round's order and how many, the live token mass, the merge policy, and a digest of the
result), beside its segments' fsync, and its version is served once both are done; the fragment file
is written after, by `Snapshots` (snapshots.py) in the background, and only then are the journal's
records and the log's segments it covers let go. A crash between the two fsyncs can leave the last
record without some of its updates: replay drops it (`MergeRecord.inputs`).

A restart (and `ddiloco export`) rebuilds what the fragment file lacks with `replay`: from
the file's state, each journaled merge in order, its contributions rebuilt from the log's
records exactly as admission built them (same decode, same norms, the same learner order
and absorption order), merged by the policy the record names (not today's settings), from
the round's sum formed in the log's order as admission formed it (stream.py) when the
record says the merge took that sum (`stream`: a learner's second update in a round
replaces its term there, which a sum from the contributions cannot reproduce). The
result is checked against the record's digest: the same code on the same kind of machine
gives the same bits. If it does not (another CPU's vector unit, another torch), the
contributions are still merged exactly once, but the bytes differ from those served under
that version, so the fragment takes one version more than the journal names, and learners
fetch it: no two different states are ever served under one number.

Fallbacks to the old, synchronous write: a merge whose round holds a contribution put back
by a refused merge (its sum was formed in another order than the log's), one that changed
no version (nothing weighed), and any merge that would leave the file more than
`SyncSettings.snapshot_lag` merges behind (0: every merge writes its file before it is
served, and the journal holds nothing).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import xxhash

from ddiloco.synchronizer import admission
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.merge import MergeOutcome, MergePolicy
from ddiloco.synchronizer.outer import OuterNesterov
from ddiloco.synchronizer.storage.journalfile import JournalFile
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.synchronizer.storage.state import FragmentState, Order, StateStore
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import codec, encodings
from ddiloco.wire.protocol import FragmentSpec, UpdateMeta

log = logging.getLogger(__name__)


def digest(fs: FragmentState) -> str:
    """XXH3-64 over Theta's and then the momentum's bytes, by tensor name."""
    h = xxhash.xxh3_64()
    for tensors in (fs.params, fs.momentum):
        for name in sorted(tensors):
            h.update(tensors[name].contiguous().view(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def policy_fields(policy: MergePolicy) -> dict[str, Any]:
    o = policy.outer
    return {
        "rule": policy.rule,
        "granularity": policy.granularity,
        "weighting": policy.weighting,
        "counter_cap_steps": policy.counter_cap_steps,
        "scale": policy.scale,
        "outer": {"lr": o.lr, "momentum": o.momentum, "nesterov": o.nesterov},
    }


def policy_from(fields: dict[str, Any]) -> MergePolicy:
    f = dict(fields)
    outer = OuterNesterov(**f.pop("outer"))
    return MergePolicy(outer=outer, **f)


@dataclass(frozen=True)
class MergeRecord:
    version: int
    """The fragment's version the merge started from (its result is `version + 1`)."""
    ids: list[str]
    """The learners whose contributions the merge took, in the round's order."""
    high_water: dict[str, Order]
    """Per learner taken, the highest update order in its contribution."""
    live_tokens: float
    policy: dict[str, Any]
    digest: str
    """`digest` of the merged state."""
    stream: bool = False
    """The merge took the round's sum formed as its updates were admitted (`RoundSum`; a
    replay forms it again from the log, in the log's order); else it summed the
    contributions. (A record without it, from before the field: the same bits either way.)"""
    inputs: int | None = None
    """How many of the log's updates the merge took. The record is written beside its
    inputs' fsync (durable.py), so a crash can leave a fragment's last record durable and
    some of those updates not: its merge was never served, and replay drops it when the
    log holds fewer (None: a record from before the field, written after its inputs)."""

    def encode(self) -> bytes:
        d = dataclasses.asdict(self)
        d["high_water"] = {k: list(v) for k, v in self.high_water.items()}
        return json.dumps(d, sort_keys=True).encode()

    @classmethod
    def decode(cls, raw: bytes) -> MergeRecord:
        d = json.loads(raw)
        d["high_water"] = {k: (int(v[0]), int(v[1])) for k, v in d["high_water"].items()}
        return cls(**d)


class MergeJournal:
    """`merges-PPPP.log`: the fragment's merges not yet in its file, one record each,
    written in place into zeros made durable before them (journalfile.py)."""

    def __init__(self, root: Path, p: int) -> None:
        self.path = root / f"merges-{p:04d}.log"
        self.file = JournalFile(self.path)
        self.lock = threading.Lock()

    def create(self) -> None:
        """The file and its zeros, made before the first merge needs them."""
        with self.lock:
            self.file.create()

    def records(self, *, repair: bool = True) -> list[MergeRecord]:
        with self.lock:
            return [MergeRecord.decode(r) for r in self.file.read(repair=repair)]

    def append(self, rec: MergeRecord) -> None:
        """Durable on return (one small write and one fdatasync)."""
        with self.lock:
            self.file.append(rec.encode())

    def clear(self) -> None:
        """No records (a restart that wrote the file, or dropped a merge never served)."""
        with self.lock:
            self.file.clear()

    def compact(self, version: int) -> None:
        """Let go of the records of merges the fragment file at `version` holds: zeros
        over them if none is left (in place), else a new file of those left. One caller at
        a time (the fragment's writer, or the restart before it): merges append meanwhile,
        and the lock is held for the rename only, not the new file's writing."""
        with self.lock:
            raw = self.file.read()
            keep = [r for r in raw if MergeRecord.decode(r).version >= version]
            if not keep:
                self.file.clear()
                return
            if len(keep) == len(raw):
                return
        tmp = self.file.prepare(keep)  # fsynced, beside the file
        with self.lock:
            since = self.file.read()[len(raw) :]  # appended while it was written
            self.file.replace(tmp, since)

    def close(self) -> None:
        with self.lock:
            self.file.close()


def next_state(
    fs: FragmentState, taken: dict[str, Contribution], outcome: MergeOutcome | None
) -> FragmentState:
    """The fragment after a merge of `taken` (`fs` only read)."""
    high_water = dict(fs.high_water)
    for learner_id, c in taken.items():
        high_water[learner_id] = max(c.order, high_water.get(learner_id, c.order))
    new = dataclasses.replace(fs, high_water=high_water)
    if outcome is not None:
        new.params, new.momentum = outcome.params, outcome.momentum
        new.version += 1
        new.merges += 1
        new.tokens_merged += outcome.tokens
        new.contributions += outcome.contributors
    return new


Decoded = tuple[UpdateMeta, dict[str, Term], dict[str, float], bytes | None]
"""An update of the log as admission decoded it: meta, tensors, their norms, and the
payload the tensors view."""


@dataclass
class Replayed:
    state: FragmentState
    rest: list[Decoded]
    """The log's updates no merge took, decoded, with their norms, in log order."""
    merges: int = 0
    exact: bool = True
    dropped: MergeRecord | None = None
    """The last record, not redone: the log lacks some of its inputs (`MergeRecord.inputs`)."""


def decode_records(
    payloads: Sequence[bytes], spec: FragmentSpec, merged: dict[str, Order]
) -> list[Decoded]:
    """The log's updates not in `merged` (the file's high-water marks), decoded as admission
    decoded them (any encoding: each was accepted once), with admission's norms."""
    out = []
    for payload in payloads:
        header = codec.read_header(payload, codes=True)
        meta = UpdateMeta.from_metadata(header.metadata)
        done = merged.get(meta.learner_id)
        if done is not None and meta.order() <= done:
            continue  # in the file already; the log was not let go of yet
        delta = encodings.decode_update(
            payload, header, spec, encodings.ALL
        )  # views of the payload
        out.append((meta, delta, admission.delta_norms(delta, spec), payload))
    return out


def replay(
    fs: FragmentState,
    spec: FragmentSpec,
    payloads: Sequence[bytes],
    journal: Sequence[MergeRecord],
) -> Replayed:
    """`fs` (from the fragment file) with every journaled merge it lacks redone, in order,
    and the log's updates left over for the open round."""
    updates = decode_records(payloads, spec, fs.high_water)
    out = Replayed(fs, [])
    for k, rec in enumerate(journal):
        if rec.version < out.state.version:
            continue  # in the file
        if rec.version > out.state.version:  # a merge missing between: never written so
            raise ValueError(
                f"fragment {spec.index}: journaled merge from version {rec.version}, the "
                f"state is at {out.state.version}"
            )
        mine, left = [], []
        for u in updates:
            hw = rec.high_water.get(u[0].learner_id)
            (left if hw is None or u[0].order() > hw else mine).append(u)
        absent = sorted(set(rec.ids) - {u[0].learner_id for u in mine})
        if absent or (rec.inputs is not None and len(mine) < rec.inputs):
            # a record written after its inputs (no count), or one a later merge followed:
            # the log lost what was durable
            if rec.inputs is None or k + 1 < len(journal):
                of = "" if rec.inputs is None else f" of its {rec.inputs}"
                raise ValueError(
                    f"fragment {spec.index}: journaled merge {rec.version} has {len(mine)}{of} "
                    f"updates in the log" + (f", none of {absent}" if absent else "")
                )
            log.warning(  # a crash before its inputs' fsync returned: never served
                "fragment %d: the last journaled merge (version %d) has %d of its %d updates "
                "in the log; it was never served, and is dropped (those updates wait in the "
                "round again)",
                spec.index,
                rec.version + 1,
                len(mine),
                rec.inputs,
            )
            out.dropped = rec
            break
        policy = policy_from(rec.policy)
        summed = RoundSum(policy, policy.rule_for(spec)) if rec.stream else None
        taken: dict[str, Contribution] = dict.fromkeys(rec.ids)  # type: ignore[arg-type]
        for meta, delta, norms, body in mine:  # the log's order: admission's
            if (c := taken[meta.learner_id]) is None:
                taken[meta.learner_id] = c = Contribution.of(meta, delta, norms, body)
                if summed is not None:
                    summed.offer(c)
            elif summed is not None:
                summed.absorb(c, meta, delta, body)
            else:
                c.absorb(meta, delta, body)
        try:
            outcome = policy.merge(
                spec, out.state.params, out.state.momentum, out.state.version,
                list(taken.values()), rec.live_tokens, summed,
            )  # fmt: skip
        finally:
            if summed is not None:
                summed.discard()
        new = next_state(out.state, taken, outcome)
        if digest(new) != rec.digest:
            out.exact = False
        out.state, updates = new, left
        out.merges += 1
    if not out.exact:
        out.state.version += 1
        log.error(
            "fragment %d: replayed merges differ in their bits from those served (another "
            "machine or torch?); every contribution is merged once, served as version %d",
            spec.index,
            out.state.version,
        )
    out.rest = updates
    return out


def recovered(store: StateStore, spec: FragmentSpec, attempts: int = 5) -> FragmentState:
    """Fragment `spec.index` as a restart would resume it: its file's state with the
    journaled merges it lacks redone; reads only, beside a running synchronizer too. There
    the snapshot writer may replace the file, then let go of the journal's records and the
    log's segments it covers, between these reads (file, journal, segments): a replay that
    finds a record or a segment gone, or a result older than the file is now, reads again
    from the new file (at most `attempts` times; then what the last read gave, or its
    error)."""
    for attempt in range(attempts):
        fs = store.load_fragment(spec.index)
        base = fs.version
        try:
            journaled = MergeJournal(store.root, spec.index).records(repair=False)
            if journaled:
                payloads = FragmentLog(store.root, spec.index).read(repair=False)
                fs = replay(fs, spec, payloads, journaled).state
        except (ValueError, OSError):
            if attempt + 1 == attempts or store.fragment_version(spec.index) == base:
                raise  # not the writer's doing: the state is damaged
            continue
        if store.fragment_version(spec.index) <= fs.version:
            return fs
    return fs
