"""The synchronizer's merge gives what the method, written plainly, gives.

    pytest tests/unit/test_reference_merge.py

Random rounds go through the synchronizer's own entry points (join, init, submit of payloads
a learner encodes with `encode_update`, merge, the served fragment): the round's sum as
updates are admitted (stream.py), the merge (merge.py), the outer step (outer.py), with
every update encoding, a learner's several updates in one round, stale updates, and large
tensors' passes split in pieces or not. After each merge the served Theta must equal, within
float32 rounding, what `reference_merge` makes of the decoded updates in float64.
"""

from __future__ import annotations

import math
import os
import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from ddiloco.synchronizer import parallel_passes
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.merge import cap_counters
from ddiloco.synchronizer.reference_merge import Update, reference_merge
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec, encodings
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    UPDATE_ENCODINGS,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

LEARNERS = [f"l{i}" for i in range(6)]
MAX_STALENESS = 3


class Clock:
    now = 1000.0

    def __call__(self) -> float:
        return self.now


@dataclass(frozen=True)
class Sent:
    learner: int
    encoding: str
    block: int
    steps: int
    tokens_per_step: int
    staleness: int
    size: float
    seed: int
    zero: bool
    """One of its tensors all zeros: no direction, it counts in RDA's radius only."""


Shapes = list[list[list[int]]]
"""Per fragment, its tensors' shapes."""
Knobs = dict[str, Any]
"""The method's settings of one example (`SyncSettings` names)."""
Plan = list[tuple[int, list[Sent]]]
"""The rounds: the fragment merged, and the updates sent to it before, in order."""

shape = st.lists(st.integers(2, 40), min_size=1, max_size=2)
fragment = st.lists(shape, min_size=1, max_size=3)
sent = st.builds(
    Sent,
    learner=st.integers(0, len(LEARNERS) - 1),
    encoding=st.sampled_from(UPDATE_ENCODINGS),
    block=st.sampled_from([16, 32, 128]),
    steps=st.integers(1, 24),
    tokens_per_step=st.integers(1, 64),
    staleness=st.integers(0, MAX_STALENESS),
    size=st.floats(0.01, 1.0),
    seed=st.integers(0, 2**31),
    zero=st.booleans(),
)
rounds = st.lists(
    st.tuples(st.integers(0, 1), st.lists(sent, min_size=1, max_size=6)), min_size=1, max_size=4
)
policy = st.fixed_dictionaries(
    {
        "merge": st.sampled_from(["rda", "mean"]),
        "rda_granularity": st.sampled_from(["tensor", "fragment"]),
        "weighting": st.sampled_from(["tokens2_per_step", "tokens", "uniform"]),
        "merge_scale": st.sampled_from(["contributors", "live"]),
        "outer_lr": st.floats(0.1, 1.5),
        "outer_momentum": st.floats(0.0, 0.95),
        "nesterov": st.booleans(),
        "counter_cap_steps": st.sampled_from([16, 96]),
    }
)


def layout_of(shapes: Shapes) -> Layout:
    """Fragment 0 is the embedding's (always averaged), fragment 1 merges by the rule."""
    return Layout(
        fragments=[
            FragmentSpec(
                index=p,
                embedding=p == 0,
                tensors=[TensorSpec(name=f"t{p}{i}", shape=s) for i, s in enumerate(ss)],
            )
            for p, ss in enumerate(shapes)
        ]
    )


def check(state: Path, shapes: Shapes, knobs: Knobs, plan: Plan, ways: int) -> int:
    """Runs the plan against the reference; returns the pieces the merges split into (the
    layout's adoption encodes every fragment, in pieces too: not counted)."""
    layout = layout_of(shapes)
    sync = Synchronizer(
        SyncSettings(
            token="t",
            state_dir=state,
            quorum=1,
            grace=False,
            max_staleness=MAX_STALENESS,
            max_update_ratio=1e3,
            max_norm_ratio=1e6,
            merge_threads=ways,
            update_encodings=list(UPDATE_ENCODINGS),
            broadcast_encoding="float32",  # the served copy is Theta exactly: the reference's
            **knobs,
        ),
        clock=Clock(),
    )
    g = torch.Generator().manual_seed(len(plan))
    theta = {t.name: torch.randn(t.shape, generator=g) for f in layout.fragments for t in f.tensors}
    sync.init(codec.encode(theta, {LAYOUT_KEY: layout.model_dump_json()}))
    for lid in LEARNERS:  # all of them live (`merge_scale = live` averages over the live set)
        sync.join(JoinRequest(learner_id=lid))
    before = parallel_passes.stats["pieces"]
    try:
        rounds_against_reference(sync, layout, theta, knobs, plan)
    finally:
        sync.close()
    return parallel_passes.stats["pieces"] - before


def rounds_against_reference(
    sync: Synchronizer, layout: Layout, theta: dict[str, torch.Tensor], knobs: Knobs, plan: Plan
) -> None:
    momentum = {k: torch.zeros_like(v, dtype=torch.float64) for k, v in theta.items()}
    theta64 = {k: v.double() for k, v in theta.items()}
    versions = [0, 0]
    step = {lid: 0 for lid in LEARNERS}
    period = {lid: 0 for lid in LEARNERS}  # each learner's last update's capped tokens
    cap = knobs["counter_cap_steps"]
    for p, updates in plan:
        spec = layout.fragments[p]
        names = [t.name for t in spec.tensors]
        round_: dict[str, Update] = {}
        for u in updates:
            lid = LEARNERS[u.learner]
            step[lid] += 1
            gen = torch.Generator().manual_seed(u.seed)
            delta = {k: torch.randn(theta[k].shape, generator=gen) * u.size for k in names}
            if u.zero and len(names) > 1:  # (never a whole update: the norm guard's median)
                delta[names[-1]].zero_()
            meta = UpdateMeta(
                learner_id=lid, fragment=p, base_version=versions[p] - min(u.staleness, versions[p]),
                steps=u.steps, tokens=u.steps * u.tokens_per_step, learner_step=step[lid],
                incarnation=1,
            )  # fmt: skip
            payload, decoded = encodings.encode_update(delta, meta, u.encoding, u.block)
            assert sync.submit(payload).status == "accepted"
            period[lid] = cap_counters(meta.tokens, meta.steps, cap)[0]
            held = round_.get(lid)
            if held is None:
                round_[lid] = Update(
                    {k: v.double() for k, v in decoded.items()}, meta.tokens, meta.steps
                )
            else:  # the learner's updates in one round add up
                round_[lid] = Update(
                    {k: held.delta[k] + decoded[k].double() for k in names},
                    held.tokens + meta.tokens,
                    held.steps + meta.steps,
                )  # fmt: skip
        known = [t for t in period.values() if t > 0]
        live = statistics.fmean(known) * len(LEARNERS) if known else 0.0
        expected = reference_merge(
            {k: theta64[k] for k in names},
            {k: momentum[k] for k in names},
            list(round_.values()),
            rule=knobs["merge"],
            embedding=spec.embedding,
            granularity=knobs["rda_granularity"],
            weighting=knobs["weighting"],
            counter_cap_steps=cap,
            live_tokens=live if knobs["merge_scale"] == "live" else None,
            lr=knobs["outer_lr"],
            mu=knobs["outer_momentum"],
            nesterov=knobs["nesterov"],
        )
        merged = sync.merge(p)
        if expected is None:  # nothing weighed: nothing merged
            assert merged is None
        else:
            versions[p] += 1
            assert merged == versions[p]
            theta64.update(expected[0])
            momentum.update(expected[1])
        served = codec.decode(sync.fragment(p)[1])
        scale = max(1.0, *(float(theta64[k].abs().max()) for k in names))
        for k in names:
            torch.testing.assert_close(
                served[k].double(),
                theta64[k],
                rtol=1e-5,
                atol=1e-5 * scale,
                msg=lambda m, k=k: f"{k}: {m}",
            )


@settings(
    max_examples=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    shapes=st.lists(fragment, min_size=2, max_size=2),
    knobs=policy,
    plan=rounds,
    split=st.booleans(),
)
def test_the_synchronizers_merge_is_the_reference_merge(
    shapes: Shapes, knobs: Knobs, plan: Plan, split: bool
) -> None:
    note(f"{shapes=} {knobs=} {plan=} {split=}")
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None  # real files; fsyncs cost nothing
    with tempfile.TemporaryDirectory(dir=shm) as state, pytest.MonkeyPatch.context() as mp:
        if split:  # pieces of small tensors: 64-value strides, 3 ways (a 128-block stays whole)
            mp.setattr(parallel_passes, "MIN_PIECE", 64)
            mp.setattr(parallel_passes, "STRIDE", 64)
        pieces = check(Path(state), shapes, knobs, plan, ways=3 if split else 1)
        merged = {p for p, _ in plan}
        large = any(math.prod(s) >= 128 for p in merged for s in shapes[p])
        assert (pieces > 0) is (split and large)
