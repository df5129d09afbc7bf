"""A restart's redo: the journaled merges a fragment file lacks, rebuilt from storage's
records (the merge journal's and the pending log's, storage/) and merged again.

    back = read_back(store, p)                         # storage: file, journal, log, in order
    done = replay(back.state, spec, back.updates, back.merges)
    done.state, done.rest                              # the state to serve, the open round's

From the file's state, each journaled merge in order, its contributions rebuilt from the log's
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

The synchronizer calls it at start (fragment.py `Fragment.replay`); `ddiloco export` through
`recovered`, which only reads.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash

from ddiloco.synchronizer import admission
from ddiloco.synchronizer.contribution import Contribution
from ddiloco.synchronizer.merge import MergeOutcome, MergePolicy
from ddiloco.synchronizer.outer import OuterNesterov
from ddiloco.synchronizer.storage.journal import MergeRecord
from ddiloco.synchronizer.storage.state import FragmentState, Order, StateStore
from ddiloco.synchronizer.storage.statedir import read_back
from ddiloco.synchronizer.stream import RoundSum
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import codec, encodings
from ddiloco.wire.protocol import FragmentSpec, UpdateMeta

log = logging.getLogger(__name__)

__all__ = [
    "Replayed",
    "decode_records",
    "digest",
    "next_state",
    "policy_fields",
    "policy_from",
    "recovered",
    "replay",
]


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
        if absent or len(mine) < rec.inputs:
            # one a later merge followed: the log lost what was durable
            if k + 1 < len(journal):
                raise ValueError(
                    f"fragment {spec.index}: journaled merge {rec.version} has {len(mine)} of "
                    f"its {rec.inputs} updates in the log"
                    + (f", none of {absent}" if absent else "")
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
            back = read_back(store, spec.index, repair=False, state=fs, log_if_merges=True)
            if back.merges:
                fs = replay(fs, spec, back.updates, back.merges).state
        except (ValueError, OSError):
            if attempt + 1 == attempts or store.fragment_version(spec.index) == base:
                raise  # not the writer's doing: the state is damaged
            continue
        if store.fragment_version(spec.index) <= fs.version:
            return fs
    return fs
