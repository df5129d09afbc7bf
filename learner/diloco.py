"""Decoupled DiLoCo around an ordinary training loop (Douillard et al. 2026), like torchft's DiLoCo.

    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    with DecoupledDiLoCo(model, opt, cfg, embedding=task.embedding_params,
                         tokens_per_step=task.tokens_per_batch) as diloco:
        while not diloco.should_stop:
            loss = task.loss_fn(model, *next(task.batches))
            loss.backward()
            diloco.report_loss(loss.item())    # optional: the loss the heartbeat carries
            opt.step()                         # the wrapper runs here, never blocking
            opt.zero_grad()
        print(diloco.stats())

The wrapper hooks the optimizer (`register_step_post_hook`): after every `opt.step()` it
accounts the step (its time is measured from the end of the previous hook), hands due (or
requested) fragments to the uploader and folds in every merged fragment that has arrived.
The loop calls nothing else per step; it stops when `should_stop` says so: after the step at
which a budget of `cfg` (max_steps, max_tokens, max_seconds) ran out, after the step in
which `request_stop()` was called (SIGTERM, a preemption notice), or once the synchronizer
says the job's token budget is merged (`finished`, synchronizer/budget.py). A preempted or
finished learner hands over every fragment with steps behind it at once, due or not, and
`__exit__` waits up to `cfg.drain_s` for the uploads. `stats()` is what the loop reports;
`ledger()` the per-fragment token account for its stop record. With `cfg.metrics_port` set, rank 0 serves Prometheus
metrics of the same events (learner/metrics.py) while in the `with` block.

State: the layout and schedule; for each fragment its anchor (the parameters the next
delta is measured from: the last global copy adopted or, if later, the fragment as it was
last handed over), the version last adopted, and the counters c_steps / c_tokens of the
steps behind the next delta. A hand-over sends delta = theta_p - anchor_p, copied first
(anchor_p <- theta_p, counters reset). A merged fragment is folded in by `rebase` (default),
keeping the steps taken since the hand-over, theta_p <- Theta_p + (theta_p - anchor_p), or by
`overwrite` (the paper), dropping them, theta_p <- Theta_p (or mixed with alpha), counters
reset. Either way anchor_p <- Theta_p. Successive deltas never overlap, so the synchronizer
can merge an update that missed its round into a later one (max_staleness). Fragment p falls
due H steps after its previous hand-over, so a learner that answered a round's request early
falls into step with the others. The inner optimizer state is left alone. No hand-over is
dropped: the streamer's outbox re-sends an unanswered upload until the synchronizer answers,
and sums the ones that queue up behind an outage. Only a refused upload (4xx) costs work,
that delta's; training goes on. `ledger()` accounts for every token computed on each
fragment: handed over, not yet handed over, or dropped by an `overwrite` adoption.

In a data-parallel group (`group`, learner/group.py) rank 0 holds all of that state and alone
talks to the synchronizer; after each step it broadcasts its plan (stop, hand-overs, fragments
to fold in) and then the folded-in parameters, so every rank stops after the same step and the
ranks stay bit-identical. `tokens_per_step` is then the whole group's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any, Final

import torch
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.fragments import Schedule, partition
from ddiloco.learner.group import Group, Plan
from ddiloco.learner.metrics import LearnerMetrics
from ddiloco.learner.schedule import budget_progress
from ddiloco.learner.streaming import Streamer
from ddiloco.wire import encodings
from ddiloco.wire.protocol import Heartbeat, UpdateMeta

log = logging.getLogger(__name__)

_POSITION_FIELD: Final = "data_position" in Heartbeat.model_fields

Tensors = dict[str, torch.Tensor]


class DecoupledDiLoCo:
    """Fragment streaming to the synchronizer, hooked onto `optimizer` (see the module
    docstring). `position` returns the data position (windows of this slot's stream consumed)
    sent in every heartbeat; `steplog` receives one record per step and per fragment event;
    `digests` adds a SHA-256 of the rank's parameters to every adoption event, and on rank 0
    one of the global copy adopted (a full read of the model: for tests)."""

    def __init__(
        self,
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        cfg: LearnerConfig,
        *,
        embedding: set[str] | None = None,
        tokens_per_step: int = 0,
        position: Callable[[], int] | None = None,
        group: Group | None = None,
        steplog: Callable[[dict[str, Any]], None] | None = None,
        digests: bool = False,
    ) -> None:
        if tokens_per_step < 0:
            raise ValueError(f"tokens_per_step must be >= 0, got {tokens_per_step}")
        self.model = model
        self.optimizer = optimizer
        self.cfg = cfg
        self.tokens_per_step = tokens_per_step
        self.position = position
        self.group = group if group is not None else Group.solo()
        self.sink = steplog
        self.digests = digests
        self.params = dict(model.named_parameters())
        self.layout = partition(self.params.items(), cfg.num_fragments, embedding)
        self.schedule = Schedule(cfg.h, len(self.layout.fragments))
        self.names = [[t.name for t in f.tensors] for f in self.layout.fragments]
        n = len(self.layout.fragments)
        self.base: list[Tensors] = [{} for _ in range(n)]
        """anchor_p: the parameters the next delta of fragment p is measured from (rank 0)."""
        self.base_version = [0] * n
        self.next_due = [self.schedule.offset(p) or cfg.h for p in range(n)]
        self.min_request_steps = max(1, cfg.h // 2)
        """A round's request is answered once this many steps stand behind the fragment: a
        smaller delta would only dilute the merge and cost an upload."""
        self.c_steps = [0] * n
        self.c_tokens = [0] * n
        kinds = ("computed", "handed_over", "dropped_by_overwrite")
        self.counted = {f"{k}_{u}": [0] * n for k in kinds for u in ("steps", "tokens")}
        """Since join, per fragment: steps and tokens computed, handed over, and dropped by
        an `overwrite` adoption (reset without being sent); see `ledger()`."""
        self.counts = {"handovers": 0, "adopted": 0, "refused": 0, "deferred": 0}
        self.left_at_close: dict[int, dict[str, int]] = {}
        self.in_flight: set[int] = set()
        self.step = 0
        self.tokens_total = 0
        self.compute_seconds = 0.0
        self.step_ema: float | None = None
        self.loss: float | None = None
        self.resume_position = 0
        """The synchronizer's data position for this slot at join (every rank knows it)."""
        self.resume_step = 0
        """The slot's LR-schedule step at join (`JoinResponse.slot_steps`, every rank knows
        it): the loop's schedule runs at `resume_step + step` (`slot_step`)."""
        self.job_total_tokens = 0
        """The job's token budget in merged tokens (0: none), heard at join (every rank)."""
        self.job_tokens_merged = 0
        """The job's merged tokens, as rank 0 last heard them (every rank, with each plan)."""
        self.should_stop = False
        self.stop_reason = ""
        self.started = time.monotonic()
        self.streamer: Streamer | None = None
        self.metrics = LearnerMetrics(
            cfg.learner_id, enabled=cfg.metrics_port is not None and self.group.root
        )
        """Prometheus instruments, served by rank 0 on cfg.metrics_port (learner/metrics.py)."""
        if self.group.root:
            self.streamer = Streamer(
                cfg,
                self.layout,
                self._initial,
                metrics=self.metrics,
                tokens_per_step=tokens_per_step,
            )
        self._initial_values: Tensors | None = None
        self._preempted = False
        self._arrived: dict[int, list[tuple[int, Tensors]]] = {}
        self._hooks: list[Any] = []
        self._mark = 0.0
        self._t_start = 0.0

    # ---- the loop's side ---------------------------------------------------------
    def report_loss(self, loss: float) -> None:
        """The loss of the step about to be taken, for the step log and the heartbeat."""
        self.loss = float(loss)

    def request_stop(self) -> None:
        """Preemption notice (safe in a signal handler): stop after the current step, handing
        over every fragment's work first. In a group only rank 0's notice counts."""
        self._preempted = True

    def stats(self) -> dict[str, Any]:
        """What the loop reports and logs: steps, tokens (the whole group's), compute seconds,
        step time (moving average), versions behind, hand-overs, adoptions, refusals, bytes
        up and down, the incarnation, this rank, the group's size and how it was wrapped."""
        s = self.streamer
        known = s.versions if s is not None else self.base_version
        behind = sum(max(0, v - b) for v, b in zip(known, self.base_version, strict=False))
        return {
            "steps": self.step,
            "tokens": self.tokens_total,
            "compute_seconds": round(self.compute_seconds, 3),
            "step_seconds": self.step_ema or 0.0,
            "versions_behind": behind,
            **self.counts,
            "bytes_up": s.bytes_up if s is not None else 0,
            "bytes_down": s.bytes_down if s is not None else 0,
            "incarnation": s.incarnation if s is not None else 0,
            "rank": self.group.rank,
            "world": self.group.world,
            "parallel": self.group.wrapped,
            "loss": self.loss,
            "stop_reason": self.stop_reason,
            "slot_step": self.slot_step,
        }

    def progress(self) -> float | None:
        """The fraction of the budget done, which the LR schedule's decay follows
        (learner/schedule.py `budget_progress`); None without a budget."""
        return budget_progress(
            self.cfg,
            job_total_tokens=self.job_total_tokens,
            job_tokens_merged=self.job_tokens_merged,
            steps=self.step,
            tokens=self.tokens_total,
        )

    @property
    def slot_step(self) -> int:
        """The slot's position in its inner LR schedule: where it resumed plus this
        incarnation's steps (a replacement does not warm up again)."""
        return self.resume_step + self.step

    def ledger(self) -> dict[int, dict[str, int]]:
        """Per fragment, since join: computed_* = handed_over_* + not_handed_over_* (c_steps,
        c_tokens) + dropped_by_overwrite_*, for steps and tokens. What was handed over is
        accounted for by the outbox (`Streamer.ledger()`): accepted, duplicate, refused or
        still queued. Rank 0's account (the other ranks keep none)."""
        return {
            p: {k: v[p] for k, v in self.counted.items()}
            | {"not_handed_over_steps": self.c_steps[p], "not_handed_over_tokens": self.c_tokens[p]}
            for p in range(len(self.base))
        }

    # ---- join and leave ----------------------------------------------------------
    def _initial(self) -> Tensors:
        if self._initial_values is not None:
            return self._initial_values
        return {k: v.detach().float().cpu() for k, v in self.params.items()}

    def __enter__(self) -> DecoupledDiLoCo:
        g, n = self.group, len(self.base)
        if g.sharded:  # the initial upload needs whole tensors: gather them while all ranks can
            values = {k: g.full(v).float() for k, v in self.params.items()}
            self._initial_values = values if g.root else None
        got: dict[int, tuple[int, Tensors]] = {}
        position = slot_steps = finished = total = merged = 0
        if self.streamer is not None and self.cfg.metrics_port is not None:
            self.metrics.serve(self.cfg.metrics_port, self.cfg.metrics_host)
            self.metrics.queue(self.streamer.outbox.depth)
        if self.streamer is not None:
            got = {p: (v, t) for p, v, t in self.streamer.fetch_all()}
            position = self.streamer.resume_position
            slot_steps, finished = self.streamer.slot_steps, int(self.streamer.finished)
            total, merged = self.streamer.total_tokens, self.streamer.tokens_merged
        self._initial_values = None
        head = [position, slot_steps, finished, total, merged]
        header = torch.tensor(head + [got[p][0] if p in got else 0 for p in range(n)])
        header = g.broadcast(header).tolist()
        self.resume_position, self.resume_step = int(header[0]), int(header[1])
        self.job_total_tokens, self.job_tokens_merged = int(header[3]), int(header[4])
        if header[2]:  # joined a finished job: nothing to train
            self.should_stop, self.stop_reason = True, "finished"
            if g.root:
                log.info("The job is finished (its token budget is merged): stopping")
        for p in range(n):
            self._fold_in(p, int(header[len(head) + p]), [got[p]] if p in got else [], join=True)
        if self.streamer is not None:
            self.streamer.start()
            log.info(
                "Joined with fragment versions %s (P=%d, H=%d, ranks=%d)",
                self.base_version,
                n,
                self.cfg.h,
                g.world,
            )
        self._hooks.append(self.optimizer.register_step_post_hook(self._after_step))
        self._t_start = self._mark = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()
        if self.streamer is not None:
            self.left_at_close = self.streamer.close(self.cfg.drain_s)
        self.metrics.close()

    # ---- one step ----------------------------------------------------------------
    def _after_step(self, *_: object) -> None:
        """The optimizer's step post-hook: account, plan (rank 0), hand over, fold in."""
        g = self.group
        dt = time.perf_counter() - self._mark
        if self.cfg.slow_factor > 1.0:  # chaos: a slower accelerator
            time.sleep(dt * (self.cfg.slow_factor - 1.0))
            dt = time.perf_counter() - self._mark
        t_hook = self._mark + dt
        self.step += 1
        self.tokens_total += self.tokens_per_step
        self.compute_seconds += dt
        self.step_ema = dt if self.step_ema is None else 0.9 * self.step_ema + 0.1 * dt
        self.metrics.step(
            seconds=dt,
            tokens=self.tokens_per_step,
            tokens_per_second=self.tokens_per_step / max(self.step_ema, 1e-9),
            loss=self.loss,
        )
        plan = g.share(self._plan() if g.root else None, len(self.base))
        self.job_tokens_merged = plan.tokens_merged
        for p, now in enumerate(plan.handover):
            if now:
                self._hand_over(p)
        for p, version in enumerate(plan.adopt):
            if version:
                self._fold_in(p, version, self._arrived.pop(p, []))
        if self.streamer is not None:
            self._report()
        loss = None if self.loss is None else round(self.loss, 4)
        lr = self.optimizer.param_groups[0].get("lr") if self.optimizer.param_groups else None
        self._write(
            {
                "t": time.time(),
                "step": self.step,
                "dt": round(dt, 6),
                "loss": loss,
                "lr": None if lr is None else float(lr),
                "slot_step": self.slot_step,
            }
        )
        if plan.stop:
            self.should_stop, self.stop_reason = True, plan.stop
        self._mark = time.perf_counter()
        self.metrics.sync_wait.inc(self._mark - t_hook)  # the hook's time: the loop waited

    def _plan(self) -> Plan:
        """Rank 0: account the step per fragment, then decide what to hand over, what to fold
        in and whether to stop."""
        assert self.streamer is not None
        n = len(self.base)
        for p in range(n):
            self.c_steps[p] += 1
            self.c_tokens[p] += self.tokens_per_step
            self.counted["computed_steps"][p] += 1
            self.counted["computed_tokens"][p] += self.tokens_per_step
        for p, _, status in self.streamer.results():
            if status not in ("accepted", "duplicate"):
                self.in_flight.discard(p)
                self.counts["refused"] += 1
        stop = self._stop_reason()
        if stop == "finished":
            log.info(
                "The job is finished (its token budget is merged): handing over pending work "
                "and stopping at step %d",
                self.step,
            )
        if stop in ("preempted", "finished"):  # hand everything over before leaving
            due = set(range(n))
        else:
            due = {p for p, at in enumerate(self.next_due) if self.step >= at}
            due |= {
                p
                for p in self.streamer.requested - self.in_flight
                if self.c_steps[p] >= self.min_request_steps
            }
            if self.cfg.update_encoding not in encodings.FLOAT_ENCODINGS:
                # a quantized update is encoded at its hand-over (its error feedback is the
                # anchor) so the outbox cannot sum it: while one of p's is still queued
                # unsent (an outage), the work stays in the parameters and goes out with the
                # next hand-over instead; the outbox holds at most p's in-flight update and
                # one queued (a float one behind an outage is summed in the outbox)
                waiting = {p for p in due if self.streamer.outbox.waiting(p)}
                self.counts["deferred"] += len(waiting)
                due -= waiting
        newest = list(self.base_version)
        for p, version, tensors in self.streamer.arrivals():
            arrived_at = self.streamer.arrival_steps.pop((p, version), self.step - 1)
            if version > newest[p]:
                newest[p] = version
                self._arrived.setdefault(p, []).append((version, tensors))
                # folded in by this very step's hook: the steps it waited since it arrived
                self.metrics.adoption_lag.observe(max(0, self.step - 1 - arrived_at))
        handover = [p in due and self.c_steps[p] > 0 for p in range(n)]
        adopt = [newest[p] if p in self._arrived else 0 for p in range(n)]
        return Plan(stop, handover, adopt, tokens_merged=self.streamer.tokens_merged)

    def _stop_reason(self) -> str:
        cfg = self.cfg
        if self._preempted:
            return "preempted"
        if self.streamer is not None and self.streamer.finished:
            return "finished"
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_tokens and self.tokens_total >= cfg.max_tokens:
            return "max_tokens"
        if cfg.max_seconds and time.perf_counter() - self._t_start >= cfg.max_seconds:
            return "max_seconds"
        return ""

    @torch.no_grad()
    def _fold_in(
        self, p: int, version: int, arrived: list[tuple[int, Tensors]], join: bool = False
    ) -> None:
        """Fold rank 0's `arrived` global copies of p (oldest first) into p on every rank."""
        g = self.group
        params = [self.params[name] for name in self.names[p]]
        values = [g.full(t) for t in params] if g.root or g.sharded else params
        if g.root:
            for v, tensors in arrived:
                self._merge(p, v, tensors, values, join)
        g.publish(params, values)
        self.base_version[p] = version
        self.counts["adopted"] += len(arrived) if g.root else 1
        event: dict[str, Any] = {"event": "adopt", "fragment": p, "version": version}
        if self.digests:
            event["digest"] = g.digest(list(self.params.items()))
            if g.root and self.base[p]:  # the global copy adopted (wire/broadcast.py's S_v)
                event["global_digest"] = g.digest(list(self.base[p].items()))
        self._write({"t": time.time(), **event, "step": self.step})

    def _merge(
        self, p: int, version: int, tensors: Tensors, values: list[torch.Tensor], join: bool
    ) -> None:
        """Rank 0: fold one global copy of p into `values`, p's whole current parameters."""
        a = self.cfg.mix_alpha
        rebase = self.cfg.adoption == "rebase" and not join
        for name, local in zip(self.names[p], values, strict=True):
            glob = tensors[name].to(device=local.device, dtype=local.dtype)
            anchor = self.base[p].get(name)
            if rebase and anchor is not None:
                local.add_(glob - anchor)
            elif a > 0 and not join:  # a joiner takes the global copy as it is
                local.mul_(a).add_(glob, alpha=1 - a)
            else:
                local.copy_(glob)
            self.base[p][name] = glob.clone()
        self.base_version[p] = version
        if not rebase:
            self.counted["dropped_by_overwrite_steps"][p] += self.c_steps[p]
            self.counted["dropped_by_overwrite_tokens"][p] += self.c_tokens[p]
            self.c_steps[p] = self.c_tokens[p] = 0
        self.in_flight.discard(p)

    @torch.no_grad()
    def _hand_over(self, p: int) -> None:
        g = self.group
        if self.streamer is None:  # not rank 0: only join the gathers FSDP2 needs
            if g.sharded:
                for name in self.names[p]:
                    g.full(self.params[name])
            return
        encoding = self.cfg.update_encoding
        meta = UpdateMeta(
            learner_id=self.cfg.learner_id,
            fragment=p,
            base_version=self.base_version[p],
            steps=self.c_steps[p],
            tokens=self.c_tokens[p],
            learner_step=self.step,
            incarnation=self.streamer.incarnation,
            encoding=encoding,
        )
        nows = {name: g.full(self.params[name]) for name in self.names[p]}
        delta = {name: now - self.base[p][name] for name, now in nows.items()}
        payload = None
        if encoding in encodings.FLOAT_ENCODINGS:  # the outbox encodes it (and may sum it)
            delta = {k: d.to(encodings.FLOAT_ENCODINGS[encoding]).cpu() for k, d in delta.items()}
            sent = delta
        else:  # int8 / int4: quantized now, so the anchor can move by what was sent
            payload, sent = encodings.encode_update(delta, meta, encoding, self.cfg.update_block)
        for name, now in nows.items():
            # the next delta starts where this one ends, as the synchronizer will see it: the
            # anchor moves by the delta as sent (rounded to bfloat16, or quantized), so what
            # the encoding dropped is carried into the next delta instead of lost (error
            # feedback)
            self.base[p][name].add_(sent[name].to(device=now.device, dtype=now.dtype))
        self.streamer.send(meta, delta if payload is None else {}, payload=payload)
        self.counted["handed_over_steps"][p] += self.c_steps[p]
        self.counted["handed_over_tokens"][p] += self.c_tokens[p]
        self._write(
            {
                "t": time.time(),
                "event": "handover",
                "fragment": p,
                "base": self.base_version[p],
                "steps": self.c_steps[p],
                "step": self.step,
            }
        )
        self.c_steps[p] = self.c_tokens[p] = 0
        self.next_due[p] = self.step + self.cfg.h
        self.in_flight.add(p)
        self.counts["handovers"] += 1
        self.metrics.handovers.inc()

    def _report(self) -> None:
        assert self.streamer is not None
        extra: dict[str, int] = {}
        if self.position is not None and _POSITION_FIELD:
            extra["data_position"] = int(self.position())
        self.streamer.report(
            Heartbeat(
                learner_id=self.cfg.learner_id,
                step=self.step,
                steps=list(self.c_steps),
                tokens=list(self.c_tokens),
                base_versions=list(self.base_version),
                step_seconds=self.step_ema or 0.0,
                compute_seconds=self.compute_seconds,
                uptime_seconds=time.monotonic() - self.started,
                tokens_total=self.tokens_total,
                loss=self.loss,
                slot_step=self.slot_step,
                **extra,
            )
        )

    def _write(self, record: dict[str, Any]) -> None:
        if self.sink is not None:
            self.sink(record)
