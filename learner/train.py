"""One learner's training loop: inner AdamW steps, Decoupled DiLoCo wrapped around them.

    DDILOCO_TOKEN=t ddiloco learner --sync-url http://127.0.0.1:8470 --learner-id l0 --max-steps 500

Reads top to bottom like nanoGPT's train.py: build the task, the optimizer, then loop.
The loop never waits for the network and calls nothing of the wrapper but `report_loss`:
DecoupledDiLoCo hooks the optimizer (diloco.py) and says when to stop, at the step, token or
time budget, or after the step in which SIGTERM came (then every fragment's work is handed
over and the uploads get up to drain_s). Its "stop" record carries the token ledger per
fragment (`ledger_record`): computed, delivered, refused, left unsent.

In a group (`--nproc-per-node N`, learner/launch.py, or torchrun) every rank runs this same
loop on its own batches: DDP (or FSDP2 with parallel=fsdp2) around the model, rank 0 streaming
for the group (learner/group.py). Rank r > 0 logs to `<log stem>.rank<r>.jsonl`.
"""

from __future__ import annotations

import json
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import nn

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.diloco import DecoupledDiLoCo
from ddiloco.learner.group import Group
from ddiloco.learner.launch import init_logging
from ddiloco.learner.schedule import ScheduleError, check, learning_rate
from ddiloco.learner.task import Task, build_task

__all__ = ["ScheduleError", "StepLog", "init_logging", "ledger_record", "pick_device", "train"]

log = logging.getLogger(__name__)


class StepLog:
    """JSON lines of steps and fragment events, or nothing (a null object) without a path."""

    def __init__(self, path: str | None) -> None:
        self.file: TextIO | None = None
        if path:
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            self.file = open(path, "a", buffering=1)  # noqa: SIM115 - closed in close()

    def write(self, record: dict[str, Any]) -> None:
        if self.file is not None:
            self.file.write(json.dumps(record, separators=(",", ":")) + "\n")

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def pick_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def autocast_for(precision: str, device: torch.device) -> AbstractContextManager[Any]:
    """The forward pass's precision: bf16 autocast, or nothing (fp32). `auto`: bf16 on CUDA."""
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.autocast(device.type, dtype=torch.bfloat16)
    return nullcontext()


def micro_batches(model: nn.Module, count: int) -> list[AbstractContextManager[Any]]:
    """One context per micro-batch of a step: every one but the last skips DDP's gradient
    all-reduce (`no_sync`), so a step of `count` micro-batches all-reduces once. FSDP2 and
    a single rank need nothing."""
    no_sync = getattr(model, "no_sync", None)
    if count == 1 or no_sync is None:
        return [nullcontext() for _ in range(count)]
    return [no_sync() for _ in range(count - 1)] + [nullcontext()]


def ledger_record(diloco: DecoupledDiLoCo) -> list[dict[str, Any]]:
    """One row per fragment: the learner's counters (`DecoupledDiLoCo.ledger`) beside the
    outbox's (`Outbox.ledger`), so that for tokens (and steps)
        computed = accepted + duplicate + refused + queued + not_handed_over
                   + dropped_by_overwrite,
    `queued` being what was still unanswered when the learner stopped; `balanced` checks it."""
    rows = []
    assert diloco.streamer is not None, "rank 0 keeps the ledger"
    outbox = diloco.streamer.ledger()
    for p, mine in diloco.ledger().items():
        row: dict[str, Any] = {"fragment": p, **mine, **outbox[p]}
        row["balanced"] = all(
            row[f"computed_{u}"]
            == sum(row[f"{k}_{u}"] for k in ("accepted", "duplicate", "refused", "queued"))
            + row[f"not_handed_over_{u}"]
            + row[f"dropped_by_overwrite_{u}"]
            for u in ("steps", "tokens")
        )
        rows.append(row)
    return rows


def rank_log_path(path: str | None, rank: int) -> str | None:
    """Rank 0 logs to `path`; rank r > 0 of a group to `<stem>.rank<r><suffix>` beside it."""
    if not path or rank == 0:
        return path
    p = Path(path)
    return str(p.with_name(f"{p.stem}.rank{rank}{p.suffix}"))


def make_task(cfg: LearnerConfig, group: Group) -> Task:
    """This rank's Task: every rank of a group draws its own batches (`rank`, `world`)."""
    return build_task(
        preset=cfg.model,
        data=cfg.data,
        model_entry=cfg.model_entry,
        learner_index=cfg.learner_index,
        num_learners=cfg.num_learners,
        batch_size=cfg.batch_size,
        seed=cfg.seed,
        device=str(group.device),
        rank=group.rank,
        world=group.world,
        tokenizer=cfg.tokenizer,
        data_field=cfg.data_field,
        init_from=cfg.init_from,
        seq_len=cfg.seq_len,
    )


def train(cfg: LearnerConfig, *, digests: bool = False) -> dict[str, Any]:
    """Train until a budget runs out or SIGTERM; returns the summary in the "stop" record.
    `digests`: a SHA-256 of the parameters in every adoption record (for tests)."""
    group = Group.join(parallel=cfg.parallel, device=cfg.device)
    if group.device.type == "cpu":
        torch.set_num_threads(cfg.threads)
    task = make_task(cfg, group)
    model = group.wrap(task.model)  # DDP / FSDP2 in a group; task.model keeps the names
    opt = torch.optim.AdamW(
        model.parameters(),
        lr=cfg.inner_lr,
        weight_decay=cfg.weight_decay,
        betas=(cfg.beta1, cfg.beta2),
    )
    steplog = StepLog(rank_log_path(cfg.log_path, group.rank))
    batches = task.batches
    # the data position each heartbeat carries: the end of the slot's reservation (data.py)
    position: Callable[[], int] | None = getattr(batches, "reservation", None)
    if position is None and hasattr(batches, "position"):
        position = lambda: batches.position  # type: ignore[attr-defined] # noqa: E731
    diloco = DecoupledDiLoCo(
        task.model,
        opt,
        cfg,
        embedding=task.embedding_params,
        tokens_per_step=group.world * cfg.grad_accum * task.tokens_per_batch,
        position=position,
        group=group,
        steplog=steplog.write,
        digests=digests,
    )
    signal.signal(signal.SIGTERM, lambda *_: diloco.request_stop())
    if group.root:
        log.info("Learner %s starting: device=%s config=%r", cfg.learner_id, group.device, cfg)
    with diloco:
        check(cfg, diloco.job_total_tokens)  # a decay needs a budget: the job's or our own
        steplog.write({"event": "start", "t": time.time(), "pid": os.getpid(), **diloco.stats()})
        at = getattr(batches, "position", None)
        if at is not None and diloco.resume_position > at:  # a replacement: go on from there
            log.info("Resuming the slot's data stream at position %d", diloco.resume_position)
            batches.seek(diloco.resume_position)  # type: ignore[attr-defined]
        if diloco.resume_step and group.root:  # a replacement: no second warm-up
            log.info("Resuming the LR schedule at step %d", diloco.resume_step)
        model.train()
        step = 0
        while not diloco.should_stop:
            lr = learning_rate(cfg, diloco.slot_step, diloco.progress())
            for g in opt.param_groups:
                g["lr"] = lr
            lossf = 0.0
            for sync in micro_batches(model, cfg.grad_accum):
                x, y = next(batches)
                with sync:  # the backward too: DDP all-reduces in it, or not
                    with autocast_for(cfg.precision, group.device):
                        loss = task.loss_fn(model, x, y) / cfg.grad_accum
                    loss.backward()
                lossf += float(loss.detach())
            if cfg.grad_clip > 0:
                torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip)
            if not math.isfinite(lossf):
                raise FloatingPointError(f"inner loss became {lossf} at step {step}")
            diloco.report_loss(lossf)
            opt.step()  # DecoupledDiLoCo's hook: hand-overs, adoptions, the stop decision
            opt.zero_grad(set_to_none=True)
            step += 1
            if cfg.log_every and step % cfg.log_every == 0 and group.root:
                s = diloco.stats()
                log.info(
                    "step %6d | loss %.4f | %7.0f tok/s | versions behind %d",
                    step,
                    lossf,
                    diloco.tokens_per_step / max(s["step_seconds"], 1e-9),
                    s["versions_behind"],
                )
    # after the exit: the outbox has drained (for up to its drain time) and its ledger is final
    summary: dict[str, Any] = {"learner_id": cfg.learner_id, **diloco.stats()}
    if group.root:
        summary["ledger"] = ledger_record(diloco)
    steplog.write({"event": "stop", "t": time.time(), **summary})
    steplog.close()
    group.close()
    if group.root:
        brief = {k: v for k, v in summary.items() if k != "ledger"}
        unsent = sum(r["queued_tokens"] + r["refused_tokens"] for r in summary["ledger"])
        log.info(
            "Learner %s stopped: %s; tokens refused or unsent: %d", cfg.learner_id, brief, unsent
        )
    return summary
