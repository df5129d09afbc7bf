"""Which computed steps reach a merge: the synchronizer's and the learners' rules, replayed.

    from ddiloco.simulator.protocol import Incarnation, Learner, ProtocolConfig, run_protocol
    a = Learner("a", step_s=0.5, incarnations=[Incarnation(0.0, np.arange(0.5, 60.1, 0.5))])
    out = run_protocol([a, b], ProtocolConfig(fragments=4, H=24, quorum=1), horizon=60.0)
    out.merged_work_ratio, out.late_updates, out.refused_updates

Input: when each learner's inner steps completed (the failure model or the replay of a
local run decided that), split into incarnations (a killed process loses its state; its
replacement joins afresh), the tokens behind each step, and stretches in which the process
was frozen (SIGSTOP: no heartbeat). This module decides what becomes of that work.

Synchronizer (synchronizer/service.py `submit` and `merge`, fragment.py; admission.py): the
service's own `ddiloco.synchronizer.rounds.Rounds`, on the event loop's clock. A running
learner process heartbeats (long polls) from its join until it is killed or frozen; before
Rounds is consulted, each learner's latest heartbeat is delivered to `Rounds.heard` at its
own time.
An update based on the current version is fresh and may start p's round; one at most
`max_staleness` versions old is late and waits in p's next round (`add(..., opens=False)`);
an older one is refused and its work lost. A learner's contributions to one round sum.
A round merges when `Rounds.due()` says so (quorum, grace window, every live learner in);
its tokens are merged work; the new version is published `sync_s` later
(`observe_sync(sync_s)`) and reaches the learners `down_s` after that.

Learner (learner/diloco.py, the optimizer post-hook `_after_step`): at a completed step it
hands fragment p over when p falls due, H steps after its previous hand-over of p (first at
offset p*H/P, or H), or when p's round is collecting without it (the heartbeat answer's
`requested`), p is not in flight, and at least H/2 steps stand behind p. The update carries
the progress since the previous hand-over (incremental deltas) and reaches the synchronizer
`up_s` later.
After the step's hand-overs it folds in the newest merged copy that has arrived: `rebase`
(default) keeps the steps since the hand-over, `overwrite` drops them. A killed process
loses what it had not handed over (and uploads still on the way).

Accounting, in tokens x fragments: computed = merged + refused + dropped (overwrite) +
unsent (killed, or not handed over by the end) + waiting (accepted, not merged by
horizon + drain_s). `sample` replays only that many fragments, spread over the offsets
(all follow the same rules on the same timelines), to keep fleet-sized runs fast.

Tests: `tests/unit/test_sim_protocol.py`.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from ddiloco.simulator.engine import Event, EventLoop
from ddiloco.simulator.protocol_io import Incarnation, Learner, ProtocolConfig, ProtocolResult
from ddiloco.synchronizer.rounds import Rounds

__all__ = ["Incarnation", "Learner", "ProtocolConfig", "ProtocolResult", "run_protocol"]


@dataclass
class _Pending:
    """A learner's (summed) contribution to an open round, as service.Pending."""

    tokens: float
    steps: int
    base: int

    def absorb(self, tokens: float, steps: int, base: int) -> None:
        self.tokens += tokens
        self.steps += steps
        self.base = min(self.base, base)


class _State:
    """A learner slot on the loop. State of its current process: steps processed `k`, and
    per fragment the step its next delta starts at, when it falls due, the version it is
    based on, whether it is in flight; `agenda` maps a step to the fragments to look at."""

    def __init__(self, tl: Learner) -> None:
        self.tl = tl
        self.inc = -1
        self.alive = False
        self.k = 0
        self.since: dict[int, int] = {}
        self.next_due: dict[int, int] = {}
        self.base: dict[int, int] = {}
        self.in_flight: set[int] = set()
        self.agenda: dict[int, set[int]] = {}
        self.events: dict[int, Event] = {}
        self.heard_until = -math.inf
        self.steady = len(tl.incarnations) == 1 and tl.incarnations[0].end is None and not tl.silent

    @property
    def cur(self) -> Incarnation:
        return self.tl.incarnations[self.inc]

    def step_from(self, t: float) -> int:
        """The first step completed at or after t and not processed yet (1-based)."""
        return max(bisect.bisect_left(self.cur.at, t) + 1, self.k + 1)

    def heartbeat(self, now: float, horizon: float) -> tuple[float, float | None] | None:
        """Time of the latest heartbeat at or before `now`, and the step time it reports."""
        now = min(now, horizon)
        if self.steady:  # one process, never frozen: heard up to now
            inc = self.tl.incarnations[0]
            if inc.join > now:
                return None
            return now, (self.tl.step_s if inc.at and inc.at[0] <= now else None)
        for inc in reversed(self.tl.incarnations):
            if inc.join > now:
                continue
            t = now if inc.end is None else min(now, inc.end)
            for a, b in self.tl.silent:
                if a <= t < b:
                    t = max(a, inc.join)
            stepped = inc.at and inc.at[0] <= t
            return t, (self.tl.step_s if stepped else None)
        return None

    def cancel(self) -> None:
        for ev in self.events.values():
            EventLoop.cancel(ev)
        self.events.clear()
        self.agenda.clear()


class _Protocol:
    def __init__(self, learners: list[Learner], cfg: ProtocolConfig, horizon: float) -> None:
        self.cfg, self.horizon = cfg, horizon
        self.loop = EventLoop()
        self.frags = cfg.replayed()
        self._t: float | None = None
        self._refreshed_at = -math.inf
        self.rounds: Rounds[_Pending] = Rounds(
            cfg.fragments,
            quorum=cfg.quorum,
            grace=cfg.grace_policy(),
            ema_alpha=cfg.ema_alpha,
            liveness_s=cfg.liveness_s,
            clock=self._clock,
        )
        self.version = [0] * cfg.fragments
        self.available: list[list[float]] = [[] for _ in range(cfg.fragments)]
        """available[p][v - 1]: when version v of p reaches the learners."""
        self.checks: dict[int, Event] = {}
        self.in_transit = 0.0
        self.res = ProtocolResult()
        self.ls = [_State(tl) for tl in learners]
        for m, st in enumerate(self.ls):
            for i, inc in enumerate(st.tl.incarnations):
                self.res.computed += float(inc.cum[-1]) * len(self.frags)
                self.loop.at(max(inc.join, 0.0), self._join, m, i)
                if inc.end is not None:
                    self.loop.at(max(inc.end, inc.join, 0.0), self._kill, m, i)

    def _clock(self) -> float:
        return self.loop.now if self._t is None else self._t

    def _refresh(self) -> None:
        """Deliver every learner's latest heartbeat to Rounds, at the time it was sent."""
        if self._refreshed_at == self.loop.now:
            return
        self._refreshed_at = self.loop.now
        for st in self.ls:
            hb = st.heartbeat(self.loop.now, self.horizon)
            if hb is None or hb[0] <= st.heard_until:
                continue
            self._t = hb[0]
            self.rounds.heard(st.tl.id, hb[1])
            st.heard_until = hb[0]
        self._t = None

    # ---- learner side -----------------------------------------------------------
    def _join(self, m: int, i: int) -> None:
        st = self.ls[m]
        st.cancel()
        st.inc, st.alive, st.k = i, True, 0
        now = self.loop.now
        for p in self.frags:
            st.since[p] = 0
            st.next_due[p] = self.cfg.offset(p)
            st.base[p] = bisect.bisect_right(self.available[p], now)  # fetches every fragment
        st.in_flight = set()
        for p in self.frags:
            self._plan(m, p)

    def _kill(self, m: int, i: int) -> None:
        st = self.ls[m]
        if st.inc != i or not st.alive:
            return
        self._lose_unsent(st, bisect.bisect_right(st.cur.at, self.loop.now))
        st.alive = False
        st.cancel()

    def _lose_unsent(self, st: _State, k: int) -> None:
        cum = st.cur.cum
        self.res.unsent += sum(float(cum[k] - cum[min(st.since[p], k)]) for p in self.frags)

    def _requested(self, st: _State, p: int) -> bool:
        """p is in the heartbeat answer's `requested` (service.poll: p in Rounds.collecting(),
        which lists the rounds with a start, and the learner not in it)."""
        r = self.rounds.rounds[p]
        return r.started_at is not None and st.tl.id not in r.contributions

    def _plan(self, m: int, p: int) -> None:
        """Put p on the learner's agenda at the next step where something may happen to it."""
        st = self.ls[m]
        if not st.alive:
            return
        ks = [max(st.next_due[p], st.k + 1)]
        if p not in st.in_flight and self._requested(st, p):
            ks.append(max(st.since[p] + self.cfg.min_request_steps, st.k + 1))
        avail = self.available[p]
        if len(avail) > st.base[p]:
            ks.append(st.step_from(avail[st.base[p]]))
        k = max(min(ks), st.step_from(self.loop.now))
        times = st.cur.at
        if k > len(times):
            return
        if k in st.agenda:
            st.agenda[k].add(p)
        else:
            st.agenda[k] = {p}
            st.events[k] = self.loop.at(times[k - 1], self._wake, m, st.inc, k)

    def _wake(self, m: int, i: int, k: int) -> None:
        """after_step of step k: hand-overs, then arrivals, for the fragments on the agenda."""
        st = self.ls[m]
        if st.inc != i or not st.alive:
            return
        frags = sorted(st.agenda.pop(k, ()))
        st.events.pop(k, None)
        st.k = k
        for p in frags:
            self._maybe_hand_over(m, p, k)
        for p in frags:
            self._maybe_adopt(st, p, k)
        for p in frags:
            self._plan(m, p)

    def _maybe_hand_over(self, m: int, p: int, k: int) -> None:
        st, cfg = self.ls[m], self.cfg
        steps = k - st.since[p]
        if steps <= 0:
            return
        due = k >= st.next_due[p]
        asked = p not in st.in_flight and steps >= cfg.min_request_steps and self._requested(st, p)
        if not (due or asked):
            return
        cum = st.cur.cum
        tokens = float(cum[k] - cum[st.since[p]])
        st.since[p], st.next_due[p] = k, k + cfg.H
        st.in_flight.add(p)
        self.res.handed_over += 1
        self.in_transit += tokens
        self.loop.after(cfg.up_s, self._submit, m, st.inc, p, st.base[p], steps, tokens)

    def _maybe_adopt(self, st: _State, p: int, k: int) -> None:
        version = bisect.bisect_right(self.available[p], self.loop.now)
        if version <= st.base[p]:
            return
        if self.cfg.adoption == "overwrite":
            cum = st.cur.cum
            self.res.dropped += float(cum[k] - cum[st.since[p]])
            st.since[p] = k
        st.base[p] = version
        st.in_flight.discard(p)

    # ---- synchronizer side --------------------------------------------------------
    def _submit(self, m: int, i: int, p: int, base: int, steps: int, tokens: float) -> None:
        st, res = self.ls[m], self.res
        self.in_transit -= tokens
        if st.inc != i or not st.alive:  # the process died with the upload in its outbox
            res.unsent += tokens
            return
        version = self.version[p]
        assert base <= version, "a learner cannot be based on an unpublished version"
        if base < version - self.cfg.max_staleness:  # admission.admit: stale, refused
            res.refused += tokens
            res.refused_updates += 1
            st.in_flight.discard(p)
            self._plan(m, p)
            return
        fresh = base == version
        res.fresh_updates += fresh
        res.late_updates += not fresh
        self._refresh()
        lid = st.tl.id
        pending = self.rounds.rounds[p].contributions.get(lid)
        if pending is None:
            pending = _Pending(tokens, steps, base)
        else:
            pending.absorb(tokens, steps, base)
        opened = p in self.rounds.collecting()
        self.rounds.add(p, lid, pending, opens=fresh)
        self.rounds.heard(lid)
        st.heard_until = self.loop.now
        if not opened and p in self.rounds.collecting():  # learners are asked for p now
            for other in range(len(self.ls)):
                self._plan(other, p)
        self._check(p)

    def _on_check(self, p: int) -> None:
        self.checks.pop(p, None)
        self._check(p)

    def _check(self, p: int) -> None:
        """The merge loop's look at p (app.merge_loop): merge if due, else look again when
        the grace window ends or a live learner not in the round falls silent."""
        self._refresh()
        if p in self.rounds.due():
            self._merge(p)
            return
        r = self.rounds.rounds[p]
        if r.deadline is None:
            return
        at = r.deadline
        for lid in self.rounds.live() - set(r.contributions):  # falls silent: not waited for
            at = min(at, math.nextafter(self.rounds.last_heard[lid] + self.cfg.liveness_s, 1e300))
        ev = self.checks.get(p)
        if ev is not None and ev.time <= at:
            return
        EventLoop.cancel(ev)
        self.checks[p] = self.loop.at(max(at, self.loop.now), self._on_check, p)

    def _merge(self, p: int) -> None:
        EventLoop.cancel(self.checks.pop(p, None))
        taken = self.rounds.take(p)
        res, now = self.res, self.loop.now
        res.merged += sum(c.tokens for c in taken.values())
        res.merges += 1
        res.contributions += len(taken)
        res.staleness_sum += sum(self.version[p] - c.base for c in taken.values())
        self.version[p] += 1
        self.rounds.observe_sync(self.cfg.sync_s)
        self.available[p].append(now + self.cfg.sync_s + self.cfg.down_s)
        for m in range(len(self.ls)):
            self._plan(m, p)

    def run(self) -> ProtocolResult:
        self.loop.run(until=self.horizon + self.cfg.drain_s)
        res = self.res
        for st in self.ls:
            if st.alive:
                self._lose_unsent(st, len(st.cur.times))
        res.waiting = self.in_transit + sum(
            c.tokens for r in self.rounds.rounds for c in r.contributions.values()
        )
        return res


def run_protocol(learners: list[Learner], cfg: ProtocolConfig, horizon: float) -> ProtocolResult:
    """Replay the protocol on `learners`' steps up to `horizon` (see the module docstring)."""
    return _Protocol(learners, cfg, horizon).run()
