"""A round's merge direction, summed as its contributions arrive, not when the round closes.

The one place the terms of RDA's direction (and of the mean's sum) are formed (`factors`) and
summed (`add_terms`): a round's `RoundSum` as updates are admitted, and `sum_terms` when a merge
sums its contributions at once (merge.py, when no round sum holds exactly them).

RDA's direction (and the mean's sum) is one pass over each contribution, most of what a merge
of many contributions computes; under load each pass also queues for the cores behind the
uploads. The sum does not need the round to be over: with each weight taken relative to the
first one (`merge.relative`), a term is
known when its contribution is admitted (its counters give its weight, admission measured its
norms), and the scale of the sum cancels in RDA's u / ||u|| (the mean multiplies by w_ref / sum w at
the end). So each admitted update queues its term here, and the upload thread that queued it adds it
in (outside the fragment's lock; whichever thread holds the sum adds every term queued), and the
merge only adds what is still queued:

    rs = RoundSum(policy)                         # a fragment's open round
    rs.offer(contribution)                        # as it is admitted (fragment's lock held)
    rs.drain()                                    # after, by the admitting thread
    rs.absorb(contribution, meta, delta, body)    # its learner again (fragment's lock held)
    summed = rs.claim(keys)                       # the merge: the sum, if it holds exactly
                                                  # the terms `keys` names, in that order

A merge that sums its contributions itself (`sum_terms`) forms the same terms, in the same
order, with the same factors, through the same passes: the same bits. A learner's second
update in the round (`absorb`) replaces its term: the old term is queued times -1, then the summed
contribution's (added after the fragment's lock, as any term). From then on the sum is not
the bits the merge would sum from the contributions, but it is a function of the round's
updates in the order they were admitted, which is their order in the fragment's log (both
under the fragment's lock): a journal replay sums the log's records through a `RoundSum`
the same way when the merge's record says it was streamed (replay.py), and serves the
same bits. `claim` returns the sum only if its terms are exactly the merged contributions',
in order (a contribution put back by a refused merge, or a weightless one absorbing another
update: the merge sums from the contributions, with the same bits). A queued bf16 term keeps its
body pinned until added.
"""

from __future__ import annotations

import math
import threading
from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from ddiloco.synchronizer import parallel_passes, update_passes
from ddiloco.synchronizer.buffers import BODIES, POOL
from ddiloco.synchronizer.update_passes import Term
from ddiloco.wire import quant

if TYPE_CHECKING:
    from ddiloco.synchronizer.contribution import Contribution, Tensors
    from ddiloco.synchronizer.merge import MergePolicy
    from ddiloco.wire.protocol import UpdateMeta

EPS = 1e-12
"""A norm at or below which a tensor has no direction."""

Key = tuple[str, ...]
"""A contribution's update ids: what it holds."""
Queued = tuple["Tensors", dict[str, float], "memoryview | bytes | None", bool]
"""A queued term: its tensors, each one's factor, the body it views (pinned until added),
and whether the tensors are the sum's to give back to the pool (a dequantized update's)."""


class RoundSum:
    """One open round's sum of terms (per tensor, float32 of `POOL`) and its queue."""

    def __init__(self, policy: MergePolicy, rule: str) -> None:
        self.policy = policy
        self.rule = rule
        self.lock = threading.Lock()
        """Held while terms are added: one adder at a time, in queue order."""
        self.queue: deque[Queued] = deque()
        self.keys: list[Key] = []
        self.sum: Tensors = {}
        self.w_ref: float | None = None
        """The weight every term's is relative to: the first term's, as it was offered (the
        merge divides by it too: `merge.relative`)."""
        self.members: dict[int, tuple[int, dict[str, float]]] = {}
        """Per contribution with a term (by `id`): its place in `keys`, its term's factors."""
        self.valid = True
        self.claiming = False
        """A merge is taking the sum: uploaders stop adding (the merge adds the rest)."""

    def offer(self, c: Contribution, dense: Tensors | None = None) -> None:
        """Queue the term of `c`, a contribution new to the round (the caller holds the
        fragment's lock: terms queue in the round's order). `dense`: c's values as float32
        of `POOL` (a quantized update's, dequantized at admission): the term is added from
        them and they go back to the pool, added or not."""
        tensors = dense if dense is not None else dict(c.delta)
        alphas = self._alphas(c)
        if alphas is None:
            if dense is not None:
                POOL.give(dense.values())
            return
        body = None
        if dense is None and c.body is not None:
            body = c.body
            BODIES.pin(body)  # until added: the contribution may let go of it first
        self.queue.append((tensors, alphas, body, dense is not None))
        self.members[id(c)] = (len(self.keys), alphas)
        self.keys.append(tuple(c.ids))

    def absorb(
        self,
        c: Contribution,
        meta: UpdateMeta,
        delta: Tensors,
        body: memoryview | bytes | None = None,
    ) -> None:
        """`c`, its learner's contribution to this round, with that learner's next update
        added in (`Contribution.absorb`: `delta` consumed; into new float32, `detach`: c's old
        tensors kept for the sum) and c's term in the sum replaced by the new sum's: the old
        term queued times -1 (its tensors let go of once added), then the new one, so whoever
        drains adds them in the round's order, after the fragment's lock. The caller holds
        that lock (the order); for RDA, c's norms are measured here (the merge reuses them).
        A contribution with no term (weightless) spoils the sum."""
        member = self.members.pop(id(c), None) if self.valid else None
        if member is None:
            self.spoil()
            c.absorb(meta, delta, body)
            return
        place, before = member
        old = c.detach()  # c's sum goes into new float32; the -1 term reads the old tensors
        c.absorb(meta, delta, body)
        self.queue.append((old.delta, {n: -a for n, a in before.items()}, old.body, old.owned))
        if self.rule != "mean":
            c.norms = {name: update_passes.norm(t) for name, t in c.delta.items()}
        alphas = self._alphas(c)
        if alphas is None:
            self.spoil()
            return
        self.queue.append((c.delta, alphas, None, False))  # c's: not given back when added
        self.members[id(c)] = (place, alphas)
        self.keys[place] = tuple(c.ids)

    def _alphas(self, c: Contribution) -> dict[str, float] | None:
        """Each tensor's factor of `c`'s term (None: no term; the sum is spoiled if its
        norms are unknown)."""
        if not self.valid:
            return None
        w = self.policy.weight(c)[0]
        if w <= 0:
            return None  # weighs nothing: the merge leaves it out of its terms too
        if self.rule != "mean" and c.norms is None:
            self.valid = False
            return None
        if self.w_ref is None:
            self.w_ref = w
        return factors(w / self.w_ref, c.delta, c.norms, self.rule, self.policy.granularity)

    def spoil(self) -> None:
        """The round's contributions changed under the queued terms (a refused merge's put
        back, a weightless contribution's learner again): stop summing."""
        self.valid = False

    def drain(self, wait: bool = False) -> None:
        """Add every queued term. Without `wait`, only if no other thread is adding (that
        one adds what is queued, ours too) and no merge is claiming the sum (the merge adds
        what is left, in pieces: `claim`)."""
        while self.queue and not (self.claiming and not wait):
            if not self.lock.acquire(blocking=wait):
                return
            try:
                while self.queue and not (self.claiming and not wait):
                    self._add_all([self.queue.popleft()])
            finally:
                self.lock.release()

    def _add_all(self, items: list[Queued], ways: int = 1) -> None:
        """Add `items`' terms, in queue order, each tensor's in `ways` pieces (parallel_passes.py:
        each piece adds every term over its values in that order, so the bits are those of
        one term at a time); their bodies and owned tensors are let go of either way."""
        try:
            if self.valid:
                add_terms(self.sum, [(t, a) for t, a, _, _ in items], ways)
        finally:
            for tensors, _, body, owned in items:
                if body is not None:
                    BODIES.unpin(body)  # type: ignore[arg-type]
                if owned:
                    POOL.give(tensors.values())  # type: ignore[arg-type]

    def claim(self, keys: list[Key], policy: MergePolicy, rule: str) -> Tensors | None:
        """The sum, if its terms are exactly the contributions `keys` names, in that order,
        as `policy` and `rule` form them (the sum is then the caller's); else None. Either
        way this round sum is done. Terms still queued (the updates admitted just before
        the round closed, often the one that made the quorum) are added here, in the
        policy's `threads` pieces: an uploader adding a term stops after it."""
        self.claiming = True
        with self.lock:
            if keys != self.keys or (policy, rule) != (self.policy, self.rule):
                self.valid = False  # not this merge's terms: what is queued is only let go of
            items = list(self.queue)
            self.queue.clear()
            self._add_all(items, policy.threads)
            out, self.sum = self.sum, {}
            if self.valid:
                return out
            POOL.give(out.values())
            return None

    def discard(self) -> None:
        """Done without a merge: queued terms let go of their bodies, the sum goes back."""
        self.spoil()
        self.drain(wait=True)
        with self.lock:
            POOL.give(self.sum.values())
            self.sum = {}


def factors(
    rel: float,
    names: Iterable[str],
    norms: Mapping[str, float] | None,
    rule: str,
    granularity: str,
) -> dict[str, float] | None:
    """Each tensor's factor in the term of a contribution of relative weight `rel`:
    the mean's `rel` (sum w Delta), or RDA's `rel / ||Delta||` (sum w u(Delta)): per tensor,
    a tensor of norm ~0 left out (no direction: it counts in the radius only), or the whole
    fragment's norm for every tensor. None: RDA and `norms` unknown."""
    if rule == "mean":
        return dict.fromkeys(names, rel)
    if norms is None:
        return None
    if granularity == "fragment":
        whole = math.hypot(*norms.values())
        return dict.fromkeys(names, rel / whole) if whole > EPS else {}
    return {n: rel / norms[n] for n in names if norms[n] > EPS}


def add_terms(
    into: dict[str, torch.Tensor],
    items: Sequence[tuple[Mapping[str, Term], Mapping[str, float]]],
    ways: int = 1,
) -> None:
    """Add each item's terms (its tensors times their factors) into `into`, per tensor in
    the items' order; a tensor's first term is written into a new buffer of `POOL`."""
    names = dict.fromkeys(name for _, alphas in items for name in alphas)
    for name in names:
        terms = [(t[name], a[name]) for t, a in items if name in a]
        dst = into.get(name)
        fresh = dst is None
        if dst is None:
            into[name] = dst = POOL.take(terms[0][0].shape)
        accumulate(dst, terms, fresh, ways)


def sum_terms(
    deltas: Sequence[Mapping[str, Term]],
    weights: Sequence[float],
    norms: Sequence[Mapping[str, float] | None],
    rule: str,
    granularity: str,
    ways: int = 1,
) -> tuple[dict[str, torch.Tensor], float]:
    """What a `RoundSum` of these contributions sums (weightless ones left out), formed at
    once, and the weight the terms are relative to (the first positive one)."""
    ref = next((w for w in weights if w > 0), 0.0)
    if ref <= 0.0:
        raise ValueError("merge needs at least one contribution with a positive weight")
    items = []
    for d, w, k in zip(deltas, weights, norms, strict=True):
        alphas = factors(w / ref, d, k, rule, granularity) if w > 0 else {}
        if alphas is None:
            raise ValueError("RDA needs every contribution's norms")
        items.append((d, alphas))
    out: dict[str, torch.Tensor] = {}
    add_terms(out, items, ways)
    return out, ref


def accumulate(
    dst: torch.Tensor, terms: Sequence[tuple[Term, float]], fresh: bool, ways: int = 1
) -> None:
    """dst (+)= each alpha * t in order (`fresh`: the first written, not added: no zeroed
    pass before it; update_passes.py: a bf16 term is read once, in cache-sized chunks), in `ways`
    pieces (parallel_passes.py: each piece adds every term over its values, the same bits; a
    quantized term's whole blocks dequantized in each; one piece when a term's blocks do
    not divide the pieces' stride)."""
    if not all(splits(t) for t, _ in terms):
        ways = 1  # one piece: the whole of every term
    d = dst.view(-1)
    flats = [(t.reshape(-1) if isinstance(t, torch.Tensor) else t, a) for t, a in terms]

    def piece(s: slice) -> None:
        for k, (t, a) in enumerate(flats):
            (update_passes.scale_into if k == 0 and fresh else update_passes.axpy)(
                d[s], piece_of(t, s), a
            )

    parallel_passes.run(d.numel(), piece, ways)


def splits(t: Term) -> bool:
    """Whether a term can be summed in pieces: a tensor, or codes whose blocks divide the
    pieces' stride (a piece then holds whole blocks)."""
    return isinstance(t, torch.Tensor) or parallel_passes.STRIDE % t.block == 0


def piece_of(t: Term, s: slice) -> Term:
    return t[s] if isinstance(t, torch.Tensor) else quant.values(t, s.start, s.stop)
