"""Property: whatever the interleaving, every token is accounted for and nothing merges twice.

    pytest tests/unit/test_ledger_property.py

Hypothesis drives learners (the real `Outbox` of learner/streaming.py) and the real
`Synchronizer` on a real state directory through random interleavings of inner steps,
hand-overs, uploads whose answer is lost (the learner re-sends), merges, synchronizer
crashes (the object is dropped: every durable write happened before the call returned, so
this is what a SIGKILL leaves) and restarts, outages longer than H (the outbox sums what
queues up), learners killed and replaced by a new incarnation, and adoptions of merged
versions. At the end, with the synchronizer up and each live learner's outbox drained:

    tokens computed = tokens merged + tokens pending (in open rounds)
                      + tokens refused (too stale) + tokens lost with learners that died
                      before the synchronizer accepted them + tokens not yet handed over

per fragment, from the synchronizer's own counters on one side, and the merged tokens equal
the sum over distinct accepted updates, so none was merged twice.
"""

from __future__ import annotations

import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from ddiloco.learner.outbox import Entry, Outbox
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec
from ddiloco.wire.errors import SyncError
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

P = 2
LEARNERS = ("a", "b", "c")
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=p, tensors=[TensorSpec(name=f"w{p}", shape=[3])]) for p in range(P)
    ]
)


@dataclass
class Learner:
    incarnation: int
    outbox: Outbox = field(default_factory=lambda: Outbox(P))
    step: int = 0
    c_tokens: list[int] = field(default_factory=lambda: [0] * P)
    c_steps: list[int] = field(default_factory=lambda: [0] * P)
    base: list[int] = field(default_factory=lambda: [0] * P)


class LedgerMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="ddiloco-ledger-"))
        self.settings = SyncSettings(
            token="t",
            state_dir=self.dir,
            quorum=1,
            grace=False,
            outer_lr=1.0,
            outer_momentum=0.0,
            max_staleness=2,
        )
        self.sync: Synchronizer | None = Synchronizer(self.settings)
        self.learners: dict[str, Learner] = {}
        for lid in LEARNERS:
            self.learners[lid] = Learner(self.sync.join(JoinRequest(learner_id=lid)).incarnation)
        init = {f"w{p}": torch.zeros(3) for p in range(P)}
        self.sync.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        self.computed = [0] * P
        self.refused = [0] * P
        self.lost_dead = [0] * P
        self.accepted: dict[str, int] = {}  # update id -> tokens, as the synchronizer said
        self.accepted_fragment: dict[str, int] = {}

    def teardown(self) -> None:
        if self.sync is not None:
            self.sync.close()
        shutil.rmtree(self.dir, ignore_errors=True)

    # ---- learners ------------------------------------------------------------------
    @rule(lid=st.sampled_from(LEARNERS), tokens=st.integers(1, 64))
    def inner_step(self, lid: str, tokens: int) -> None:
        ln = self.learners[lid]
        ln.step += 1
        for p in range(P):
            ln.c_tokens[p] += tokens
            ln.c_steps[p] += 1
            self.computed[p] += tokens

    @rule(lid=st.sampled_from(LEARNERS), p=st.integers(0, P - 1))
    def hand_over(self, lid: str, p: int) -> None:
        ln = self.learners[lid]
        if ln.c_tokens[p] == 0:
            return
        meta = UpdateMeta(
            learner_id=lid,
            fragment=p,
            base_version=ln.base[p],
            steps=ln.c_steps[p],
            tokens=ln.c_tokens[p],
            learner_step=ln.step,
            incarnation=ln.incarnation,
        )
        ln.outbox.put(meta, {f"w{p}": torch.full((3,), 0.01)})
        ln.c_tokens[p] = ln.c_steps[p] = 0
        ln.step += 1  # the next hand-over of p comes at a later step

    @precondition(lambda self: self.sync is not None)
    @rule(lid=st.sampled_from(LEARNERS), answer_lost=st.booleans())
    def upload(self, lid: str, answer_lost: bool) -> None:
        ln = self.learners[lid]
        entry = ln.outbox.take(timeout=0)
        if entry is not None:
            self.deliver(ln, entry, answer_lost)

    def deliver(self, ln: Learner, entry: Entry, answer_lost: bool = False) -> None:
        assert self.sync is not None
        try:
            body = entry.encoded()
            whole = body if isinstance(body, bytes) else b"".join(body)
            status = self.sync.submit(whole, entry.meta.fragment).status
        except SyncError as e:
            assert e.kind == "stale", e  # the only refusal an honest learner can meet here
            self.refused[entry.meta.fragment] += entry.meta.tokens
            ln.outbox.settle(entry, "refused")
            return
        uid = entry.meta.update_id()
        if status == "accepted":
            assert uid not in self.accepted, f"{uid} accepted twice"
            self.accepted[uid] = entry.meta.tokens
            self.accepted_fragment[uid] = entry.meta.fragment
        else:
            assert uid in self.accepted, f"{uid} called a duplicate but never accepted"
        if not answer_lost:
            ln.outbox.settle(entry, status)
        # else: the learner never heard; the entry stays at the head and goes again as is

    @precondition(lambda self: self.sync is not None)
    @rule(lid=st.sampled_from(LEARNERS))
    def adopt(self, lid: str) -> None:
        assert self.sync is not None
        self.learners[lid].base = self.sync.versions()  # rebase: its counters keep going

    @rule(lid=st.sampled_from(LEARNERS))
    def replace_learner(self, lid: str) -> None:
        """SIGKILL a learner: what it had not handed over, and what the synchronizer never
        accepted from its outbox, dies with it. A replacement joins as a new incarnation."""
        if self.sync is None:
            return
        ln = self.learners[lid]
        for p in range(P):
            self.lost_dead[p] += ln.c_tokens[p]
        for meta in ln.outbox.queued():
            if meta.update_id() not in self.accepted:
                self.lost_dead[meta.fragment] += meta.tokens
        new = Learner(self.sync.join(JoinRequest(learner_id=lid)).incarnation)
        new.base = self.sync.versions()
        self.learners[lid] = new

    # ---- synchronizer --------------------------------------------------------------
    @precondition(lambda self: self.sync is not None)
    @rule(p=st.integers(0, P - 1))
    def merge(self, p: int) -> None:
        assert self.sync is not None
        self.sync.merge(p)

    @precondition(lambda self: self.sync is not None)
    @rule()
    def crash(self) -> None:
        assert self.sync is not None
        self.sync.close()  # the file descriptors a SIGKILL would close
        self.sync = None

    @precondition(lambda self: self.sync is None)
    @rule()
    def restart(self) -> None:
        self.sync = Synchronizer(self.settings)

    # ---- the ledger ------------------------------------------------------------------
    def balance(self, sync: Synchronizer) -> None:
        st_ = sync.status()
        for p in range(P):
            merged = st_.fragments[p].tokens_merged
            pending = st_.fragments[p].tokens_pending
            accepted = sum(t for u, t in self.accepted.items() if self.accepted_fragment[u] == p)
            assert merged + pending == accepted, (p, merged, pending, accepted)
            unsent = sum(ln.c_tokens[p] for ln in self.learners.values())
            queued = sum(
                m.tokens
                for ln in self.learners.values()
                for m in ln.outbox.queued()
                if m.fragment == p and m.update_id() not in self.accepted
            )
            assert self.computed[p] == (
                merged + pending + self.refused[p] + self.lost_dead[p] + unsent + queued
            ), p

    @invariant()
    def ledger_balances_while_up(self) -> None:
        if self.sync is not None:
            self.balance(self.sync)

    def finish(self) -> None:
        if self.sync is None:
            self.restart()
        assert self.sync is not None
        for ln in self.learners.values():
            while (entry := ln.outbox.take(timeout=0)) is not None:
                self.deliver(ln, entry)
        for p in range(P):
            self.sync.merge(p)
        self.balance(self.sync)
        for ln in self.learners.values():
            assert not ln.outbox.queued()


class FinishingMachine(LedgerMachine):
    def teardown(self) -> None:
        try:
            self.finish()
        finally:
            super().teardown()


FinishingMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestLedger = FinishingMachine.TestCase
