"""A learner's contribution to an open round: what admission decoded, until its merge.

    c = Contribution.of(meta, delta, norms, body)   # views of `body` (pinned) or POOL float32
    c.absorb(meta2, delta2, body2)                   # the same learner again: summed in place
    c.release()                                      # merged: buffers back, body unpinned

Split from merge.py (its math reads contributions; this is their bookkeeping).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ddiloco.synchronizer import update_passes
from ddiloco.synchronizer.buffers import BODIES, POOL
from ddiloco.wire.protocol import UpdateMeta

Tensors = dict[str, update_passes.Term]


@dataclass
class Contribution:
    """One learner's contribution to an open round: the sum of its updates since the last
    merge (they carry progress since the previous hand-over, so deltas and counters add),
    the oldest base among them, and the highest order (incarnation, learner_step).

    One update's `delta` is what admission decoded: views of its body (bf16 or float32
    tensors, or int8/int4 `quant.Quantized`; the body's `BODIES` buffer is pinned until
    `release`). A sum is always float32 of `POOL` (`owned`), written in place by the next
    `add`."""

    delta: Tensors
    steps: int
    tokens: int
    base_version: int
    order: tuple[int, int] = (0, 0)
    ids: list[str] = field(default_factory=list)
    norms: dict[str, float] | None = None
    """Each tensor's norm of `delta`, when admission measured it (one update; None once
    another is absorbed, unless the round's sum measured the sum's: `RoundSum.absorb`):
    the merge's `rda` then needs no norm pass of its own."""
    body: memoryview | bytes | None = None
    """The payload `delta` views, pinned in `BODIES` (None once `delta` is `owned`)."""
    owned: bool = False
    """`delta` is float32 of `POOL`, this contribution's to write and to give back."""

    @classmethod
    def of(
        cls,
        meta: UpdateMeta,
        delta: Tensors,
        norms: dict[str, float] | None = None,
        body: memoryview | bytes | None = None,
    ) -> Contribution:
        """`delta` as decoded: float32 of `POOL` if `body` is None, else views of `body`
        (pinned here until `release`)."""
        if body is not None:
            BODIES.pin(body)
        return cls(
            dict(delta),
            meta.steps,
            meta.tokens,
            meta.base_version,
            meta.order(),
            [meta.update_id()],
            norms,
            body,
            owned=body is None,
        )

    def absorb(
        self, meta: UpdateMeta, delta: Tensors, body: memoryview | bytes | None = None
    ) -> None:
        """Add another update of the same learner (in place). `delta` is consumed: its
        `POOL` buffers go back, its body is let go."""
        self.add(Contribution.of(meta, delta, body=body))

    def detach(self) -> Contribution:
        """`delta` copied into new float32 of `POOL`, this contribution's from now on; what
        it was (its tensors, its body's pin, its buffers) returned as a contribution of its
        own, the caller's to release (a round's sum may still read it: stream.py)."""
        old = Contribution(self.delta, 0, 0, 0, body=self.body, owned=self.owned)
        copy: Tensors = {}
        for k, v in self.delta.items():
            copy[k] = POOL.take(v.shape)
            update_passes.scale_into(copy[k], v, 1.0)
        self.delta, self.body, self.owned = copy, None, True
        return old

    def add(self, newer: Contribution) -> Contribution:
        """This contribution with a newer one of the same learner added in (in place;
        `newer`'s buffers go back): another update, or a refused merge's contribution put
        back beside the one its learner sent while the merge ran."""
        if not self.owned:  # views of a body: the sum goes into float32 of our own
            self.detach().release()
        for k, v in newer.delta.items():
            update_passes.axpy(self.delta[k], v, 1.0)
        newer.release()
        self.steps += newer.steps
        self.tokens += newer.tokens
        self.base_version = min(self.base_version, newer.base_version)
        self.order = max(self.order, newer.order)
        self.ids.extend(newer.ids)
        self.norms = None  # the sum's norms are not the parts'
        return self

    def release(self) -> None:
        """Done with `delta`: `POOL` buffers go back, the body is unpinned."""
        if self.owned:
            POOL.give(self.delta.values())
        if self.body is not None:
            BODIES.unpin(self.body)
            self.body = None
        self.delta = {}
