"""Decoupled DiLoCo around an ordinary training loop (Douillard et al. 2026), like torchft's DiLoCo.

    with DecoupledDiLoCo(model, cfg, embedding=task.embedding_params) as diloco:
        for step in ...:
            loss.backward(); opt.step(); opt.zero_grad()
            diloco.after_step(tokens)          # never blocks on the network

State: the layout and schedule; for each fragment its anchor (the parameters the next
delta is measured from: the last global copy adopted or, if later, the fragment as it was
last handed over), the version last adopted, and the counters c_steps / c_tokens of the
steps behind the next delta. After each inner step it hands due (or requested) fragments
to the uploader as delta = theta_p - anchor_p, copied first (anchor_p <- theta_p, counters
reset), and folds in every merged fragment that has arrived: `rebase` (default) keeps the
steps taken since the hand-over, theta_p <- Theta_p + (theta_p - anchor_p); `overwrite`
(the paper) drops them, theta_p <- Theta_p (or mixed with alpha), counters reset. Either
way anchor_p <- Theta_p. Successive deltas never overlap, so the synchronizer can merge an
update that missed its round into a later one (max_staleness). Fragment p falls due H
steps after its previous hand-over, so a learner that answered a round's request early
falls into step with the others. The inner optimizer state is left alone. No hand-over is
dropped: the streamer's outbox re-sends an unanswered upload until the synchronizer
answers, and sums the ones that queue up behind an outage. Only a refused upload (4xx)
costs work, that delta's; training goes on. `ledger()` accounts for every token computed
on each fragment: handed over, not yet handed over, or dropped by an `overwrite` adoption.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.fragments import Schedule, partition
from ddiloco.learner.streaming import Streamer
from ddiloco.synchronizer.codec import WIRE_DTYPES
from ddiloco.synchronizer.protocol import Heartbeat, UpdateMeta

log = logging.getLogger(__name__)


class DecoupledDiLoCo:
    """Wraps a model's training loop with fragment streaming to the synchronizer."""

    def __init__(
        self, model: nn.Module, cfg: LearnerConfig, *, embedding: set[str] | None = None
    ) -> None:
        self.model = model
        self.cfg = cfg
        self.params = dict(model.named_parameters())
        self.layout = partition(self.params.items(), cfg.num_fragments, embedding)
        self.schedule = Schedule(cfg.h, len(self.layout.fragments))
        self.names = [[t.name for t in f.tensors] for f in self.layout.fragments]
        n = len(self.layout.fragments)
        self.base: list[dict[str, torch.Tensor]] = [{} for _ in range(n)]
        """anchor_p: the parameters the next delta of fragment p is measured from."""
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
        self.left_at_close: dict[int, dict[str, int]] = {}
        self.in_flight: set[int] = set()
        self.step = 0
        self.tokens_total = 0
        self.compute_seconds = 0.0
        self.step_ema: float | None = None
        self.started = time.monotonic()
        self.loss: float | None = None
        self.stats = {"handovers": 0, "adopted": 0, "refused": 0}
        self.streamer = Streamer(cfg, self.layout, self._initial)
        self.events: list[dict[str, Any]] = []

    def _initial(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().float().cpu() for k, v in self.params.items()}

    def __enter__(self) -> DecoupledDiLoCo:
        for p, version, tensors in self.streamer.fetch_all():
            self._adopt(p, version, tensors, join=True)
        self.streamer.start()
        log.info(
            "Joined with fragment versions %s (P=%d, H=%d)",
            self.base_version,
            len(self.base),
            self.cfg.h,
        )
        return self

    def __exit__(self, *exc: object) -> None:
        self.left_at_close = self.streamer.close(self.cfg.drain_s)

    @torch.no_grad()
    def _adopt(
        self, p: int, version: int, tensors: dict[str, torch.Tensor], join: bool = False
    ) -> None:
        a = self.cfg.mix_alpha
        rebase = self.cfg.adoption == "rebase" and not join
        for name in self.names[p]:
            local = self.params[name]
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
        self.stats["adopted"] += 1
        self.events.append({"event": "adopt", "fragment": p, "version": version, "step": self.step})

    @torch.no_grad()
    def _hand_over(self, p: int) -> None:
        dtype = WIRE_DTYPES[self.cfg.wire_dtype]
        delta = {}
        for n in self.names[p]:
            now = self.params[n].detach()
            d = (now - self.base[p][n]).to(dtype)
            delta[n] = d.cpu()
            # the next delta starts where this one ends, as the synchronizer will see it: the
            # anchor moves by the delta as sent (after rounding to the wire dtype), so rounding
            # error is carried into the next delta instead of lost
            self.base[p][n].add_(d.to(now.dtype))
        meta = UpdateMeta(
            learner_id=self.cfg.learner_id,
            fragment=p,
            base_version=self.base_version[p],
            steps=self.c_steps[p],
            tokens=self.c_tokens[p],
            learner_step=self.step,
            incarnation=self.streamer.incarnation,
        )
        self.streamer.send(meta, delta)
        self.counted["handed_over_steps"][p] += self.c_steps[p]
        self.counted["handed_over_tokens"][p] += self.c_tokens[p]
        self.events.append(
            {
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
        self.stats["handovers"] += 1

    def after_step(self, tokens: int, seconds: float, loss: float | None = None) -> None:
        """Account one inner step, hand over due fragments, fold in arrived ones."""
        self.step += 1
        self.tokens_total += tokens
        self.compute_seconds += seconds
        self.loss = loss
        self.step_ema = seconds if self.step_ema is None else 0.9 * self.step_ema + 0.1 * seconds
        for p in range(len(self.base)):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
            self.counted["computed_steps"][p] += 1
            self.counted["computed_tokens"][p] += tokens
        for p, _, status in self.streamer.results():
            if status not in ("accepted", "duplicate"):
                self.in_flight.discard(p)
                self.stats["refused"] += 1
        due = {p for p, at in enumerate(self.next_due) if self.step >= at}
        due |= {
            p
            for p in self.streamer.requested - self.in_flight
            if self.c_steps[p] >= self.min_request_steps
        }
        for p in sorted(due):
            if self.c_steps[p] > 0:
                self._hand_over(p)
        for p, version, tensors in self.streamer.arrivals():
            if version > self.base_version[p]:
                self._adopt(p, version, tensors)
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
                loss=loss,
            )
        )

    def ledger(self) -> dict[int, dict[str, int]]:
        """Per fragment, since join: computed_* = handed_over_* + not_handed_over_* (c_steps,
        c_tokens) + dropped_by_overwrite_*, for steps and tokens. What was handed over is
        accounted for by the outbox (`Streamer.ledger()`): accepted, duplicate, refused or
        still queued."""
        return {
            p: {k: v[p] for k, v in self.counted.items()}
            | {"not_handed_over_steps": self.c_steps[p], "not_handed_over_tokens": self.c_tokens[p]}
            for p in range(len(self.base))
        }

    def drain_events(self) -> list[dict[str, Any]]:
        out, self.events = self.events, []
        return out
