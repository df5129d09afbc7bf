"""A learner as a data-parallel group: N ranks train in lockstep, rank 0 streams for all of them.

    group = Group.join(parallel="ddp", device="auto")   # RANK, WORLD_SIZE, ... from the env
    train_model = group.wrap(model)      # DDP, FSDP2 (fully_shard) or the model itself
    values = [group.full(p) for p in fragment_params]   # rank 0's full values
    group.publish(fragment_params, values)              # rank 0's values on every rank
    plan = group.broadcast(plan)                        # rank 0's decisions on every rank

`ddiloco learner --nproc-per-node N` spawns the ranks (learner/launch.py); under `torchrun` a
rank joins torchrun's group instead. With one rank `Group.solo()` stands in: no
torch.distributed at all, every call a no-op or a plain copy. NCCL on CUDA (rank r on
`cuda:LOCAL_RANK`), gloo on CPU. Gradients are averaged every inner step by DDP (or FSDP2's
reduce-scatter); to the synchronizer the group is one learner (diloco.py).

Rank 0 streams everything; the other ranks never open a connection. After each inner step
rank 0 decides what to hand over, which arrived fragments to fold in and whether to stop, and
broadcasts that as one small int64 tensor; a folded-in fragment's new parameters go from rank 0
to every rank by broadcast (coalesced per dtype), so the ranks stay bit-identical (DDP's
all-reduce gives every rank the same averaged gradient, so they stay so between merges).

Why rank 0 streams rather than each rank streaming its 1/N shard of each fragment:
- Bytes over the learner's link to the synchronizer are the same either way (one delta per
  hand-over, one download per merge); sharding only spreads them over N connections, which
  pays only when one connection is the bottleneck (several nodes with a NIC each).
- It adds one broadcast of |theta|/P inside the group per merge, every H/P steps, against DDP's
  all-reduce of |theta| every step (about 1/(2H) of the group's own traffic), plus the plan, 9
  int64s, every step. Measured (/tmp script, torchrun, 2 ranks, gloo, one thread each, on the
  shared 2-core box, so noisy): `small` (0.84M parameters): inner step 321 ms, a fragment's
  broadcast (0.26M parameters) 2.9-3.7 ms, the plan 1.5 ms; `tiny` (0.12M): step 49 ms,
  fragment 1.6-2.5 ms, plan 1.1 ms. So about 1% of one step per merge and 0.5-2% per step for
  the plan on gloo, where latency dominates (NCCL on one node should do far better; not
  measured here).
- Sharded streaming needs the synchronizer to assemble N partial uploads into one update
  atomically: a new protocol, and a rank dying between its shards would leave a half update,
  the one thing a failed learner must never produce. With rank 0 streaming an update is one
  HTTP body, whole or absent.
With FSDP2 rank 0 has to gather a fragment (`DTensor.full_tensor()`, an all-gather every rank
joins) for each hand-over and merge, and keeps its anchors on the CPU so the full copy never
sits on one device; that gather is the same |theta|/P per event. FSDP2 runs on gloo/CPU in this
torch (2.15) too: tests/e2e/test_multirank.py trains and preempts a 2-rank FSDP2 learner.
"""

from __future__ import annotations

import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Final

import torch
import torch.distributed as dist
from torch import nn

from ddiloco.learner.launch import in_group

log = logging.getLogger(__name__)

GROUP_ENV: Final = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
"""What torchrun (or learner/launch.py) puts in a rank's environment."""
TIMEOUT: Final = timedelta(hours=1)
"""Collective timeout. Generous: the other ranks wait in the join broadcast while rank 0
retries an unreachable synchronizer. A dead rank is found sooner than this by the launcher
(the process exits) and by gloo (its connections close)."""


STOP_REASONS: Final = ("", "preempted", "max_steps", "max_tokens", "max_seconds")
"""Why a learner stops after a step (the empty string: it does not)."""


@dataclass
class Plan:
    """Rank 0's decisions after one inner step, which every rank then carries out alike."""

    stop: str
    """One of STOP_REASONS: stop after this step, and why."""
    handover: list[bool]
    """Per fragment: hand it over now."""
    adopt: list[int]
    """Per fragment: the global version to fold in now (0: none)."""
    tokens_merged: int = 0
    """The job's merged tokens as rank 0 last heard them: every rank's LR schedule follows
    the same budget progress (learner/schedule.py)."""

    def encode(self) -> torch.Tensor:
        codes = [
            STOP_REASONS.index(self.stop),
            self.tokens_merged,
            *map(int, self.handover),
            *self.adopt,
        ]
        return torch.tensor(codes, dtype=torch.int64)

    @classmethod
    def decode(cls, codes: torch.Tensor) -> Plan:
        values = codes.tolist()
        n = (len(values) - 2) // 2
        return cls(
            STOP_REASONS[values[0]],
            [bool(v) for v in values[2 : 2 + n]],
            values[2 + n :],
            tokens_merged=values[1],
        )


@dataclass
class Group:
    """This process's place in its learner's group; world 1 is a single-process learner."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's training device (and the collectives' device: NCCL needs CUDA tensors)."""
    parallel: str = "ddp"
    """`ddp` (every rank holds all parameters) or `fsdp2` (each rank holds a shard)."""
    wrapped: str = ""
    """What `wrap` did: `ddp`, `fsdp2`, or `none` (one rank); empty before it ran."""

    @classmethod
    def solo(cls, device: torch.device | str = "cpu") -> Group:
        return cls(device=torch.device(device))

    @classmethod
    def join(cls, *, parallel: str = "ddp", device: str = "auto") -> Group:
        """The group this process is a rank of, from the environment (RANK, WORLD_SIZE,
        LOCAL_RANK, MASTER_ADDR, MASTER_PORT); a solo group without WORLD_SIZE > 1."""
        if parallel not in ("ddp", "fsdp2"):
            raise ValueError(f"parallel must be 'ddp' or 'fsdp2', got {parallel!r}")
        cuda = device.startswith("cuda") or (device == "auto" and torch.cuda.is_available())
        if not in_group():
            return cls.solo(("cuda" if cuda else "cpu") if device == "auto" else device)
        missing = [k for k in GROUP_ENV if not os.environ.get(k)]
        if missing:
            raise ValueError(
                f"WORLD_SIZE > 1 but {', '.join(missing)} not set: start the "
                "ranks with torchrun or `ddiloco learner --nproc-per-node N`"
            )
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local_rank = int(os.environ["LOCAL_RANK"])
        if cuda:
            dev = torch.device("cuda", local_rank)
            torch.cuda.set_device(dev)
        else:
            dev = torch.device("cpu")
        backend = "nccl" if cuda else "gloo"
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=TIMEOUT)
        log.info("Rank %d of %d joined (%s on %s, %s)", rank, world, backend, dev, parallel)
        return cls(rank, world, local_rank, dev, parallel)

    @property
    def root(self) -> bool:
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        return self.world > 1 and self.parallel == "fsdp2"

    def close(self) -> None:
        if self.world > 1 and dist.is_initialized():
            dist.destroy_process_group()

    # ---- the model ---------------------------------------------------------------
    def wrap(self, model: nn.Module) -> nn.Module:
        """The module to train: DDP around `model`, or `model` sharded in place by FSDP2
        (each block of every nn.ModuleList, then the root), or `model` itself with one
        rank. Parameter names stay those of `model` (the layout every learner shares)."""
        if self.world == 1:
            self.wrapped = "none"
            return model
        self.wrapped = self.parallel
        if self.parallel == "fsdp2":
            from torch.distributed.fsdp import fully_shard

            for module in list(model.modules()):
                if isinstance(module, nn.ModuleList):
                    for block in module:
                        fully_shard(block)
            fully_shard(model)
            return model
        from torch.nn.parallel import DistributedDataParallel

        ids = [self.device.index] if self.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)

    # ---- rank 0's decisions and values -------------------------------------------
    def broadcast(self, values: torch.Tensor) -> torch.Tensor:
        """Rank 0's `values` (int64, same shape on every rank) on every rank."""
        if self.world == 1:
            return values
        buf = values.to(self.device)
        dist.broadcast(buf, src=0)
        return buf.cpu()

    def share(self, plan: Plan | None, num_fragments: int) -> Plan:
        """Rank 0's plan (None on the other ranks) on every rank."""
        if self.world == 1:
            assert plan is not None
            return plan
        size = 2 + 2 * num_fragments
        codes = plan.encode() if plan is not None else torch.zeros(size, dtype=torch.int64)
        return Plan.decode(self.broadcast(codes))

    def full(self, param: torch.Tensor) -> torch.Tensor:
        """The parameter's whole value for rank 0 to read and change: the parameter itself
        (detached, same storage) unless sharded; with FSDP2 a gathered copy on the CPU, an
        all-gather that every rank must join (the other ranks get a copy too)."""
        if self.sharded:
            return param.detach().full_tensor().cpu()
        return param.detach()

    @torch.no_grad()
    def publish(self, params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> None:
        """Set `params` to rank 0's `values` (from `full`) on every rank: every rank calls
        it with the same params; only rank 0's values count."""
        if self.sharded:
            from torch.distributed.tensor import distribute_tensor

            for param, value in zip(params, values, strict=True):
                src = value.to(device=param.device, dtype=param.dtype)
                shard = distribute_tensor(src, param.device_mesh, param.placements, src_data_rank=0)
                param.to_local().copy_(shard.to_local())
            return
        if self.root:
            for param, value in zip(params, values, strict=True):
                if value.data_ptr() != param.data_ptr():
                    param.copy_(value)
        if self.world == 1:
            return
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for param in params:
            by_dtype.setdefault(param.dtype, []).append(param)
        for same in by_dtype.values():  # one broadcast per dtype, not one per tensor
            flat = torch.cat([p.detach().reshape(-1) for p in same])
            dist.broadcast(flat, src=0)
            if not self.root:
                offset = 0
                for p in same:
                    p.copy_(flat[offset : offset + p.numel()].view_as(p))
                    offset += p.numel()

    def digest(self, named: Sequence[tuple[str, torch.Tensor]]) -> str:
        """SHA-256 of this rank's own parameter bytes in name order (with FSDP2: of the
        gathered values, a collective). Costs a full read of the model to the CPU."""
        h = hashlib.sha256()
        for name, param in sorted(named, key=lambda np_: np_[0]):
            value = self.full(param).cpu().reshape(-1).contiguous()
            h.update(name.encode())
            h.update(value.view(torch.uint8).numpy().tobytes())
        return h.hexdigest()[:16]
