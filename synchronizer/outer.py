"""The outer optimizer of Decoupled DiLoCo (paper §6.4): SGD with Nesterov momentum on the
global fragment, one momentum buffer per fragment (out of merge.py, which forms the outer
gradient it steps with).

    opt = OuterNesterov(lr=0.7, momentum=0.9)
    params2, momentum2, ok = opt.step_checked(params, momentum, delta, ways=2)

Speed (memory traffic is the bound): into buffers of `buffers.POOL` (the inputs are only read),
three `torch.add`s per tensor and no temporaries, each large tensor in `ways` pieces on threads of
their own (parallel_passes.py: the same bits), each piece checked for non-finite values while it is in the
cache (one `torch.aminmax`: NaN and Inf survive it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from ddiloco.synchronizer import parallel_passes
from ddiloco.synchronizer.buffers import POOL

__all__ = ["OuterNesterov", "Tensors", "finite"]

Tensors = dict[str, torch.Tensor]


@dataclass(frozen=True, kw_only=True)
class OuterNesterov:
    """SGD with (Nesterov) momentum on the global fragment, one buffer per fragment (§6.4).

        b = mu * b + delta
        Theta = Theta - lr * (delta + mu * b)    (Nesterov)
        Theta = Theta - lr * b                   (heavy ball)

    lr=1, momentum=0 is plain averaging of the learners' fragments.
    """

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    def step_into(
        self, params: Tensors, buffers: Tensors, delta: Tensors, ways: int = 1
    ) -> tuple[Tensors, Tensors]:
        """`step`, into new tensors: (Theta', b'). The inputs are read, never written. Three
        passes per tensor (two with heavy ball), each one `torch.add(x, y, alpha)`, no
        temporaries: b' = delta + mu b;  out = delta + mu b';  Theta' = Theta - lr out;
        a large tensor's in `ways` pieces at once (parallel_passes.py: the same bits)."""
        new_params, new_buffers, _ = self.step_checked(params, buffers, delta, ways, check=False)
        return new_params, new_buffers

    def step_checked(
        self, params: Tensors, buffers: Tensors, delta: Tensors, ways: int = 1, check: bool = True
    ) -> tuple[Tensors, Tensors, bool]:
        """`step_into` and `finite_after` together, each piece checked as it is made (while
        it is in the cache); the third value is True without `check`."""
        new_params: Tensors = {}
        new_buffers: Tensors = {}
        finite_all = True
        for name, p in params.items():
            out, b = POOL.take(p.shape), POOL.take(p.shape)
            flat = [t.reshape(-1) for t in (delta[name], buffers[name], p, out, b)]
            piece = functools.partial(self._piece, *flat, check)
            finite_all &= all(parallel_passes.run(p.numel(), piece, ways))
            new_params[name], new_buffers[name] = out, b
        return new_params, new_buffers, finite_all

    def _piece(
        self,
        delta: torch.Tensor,
        momentum: torch.Tensor,
        params: torch.Tensor,
        out: torch.Tensor,
        buffer: torch.Tensor,
        check: bool,
        s: slice,
    ) -> bool:
        """`step_checked` over one piece `s` of flat tensors; whether it is finite."""
        d, b, o = delta[s], buffer[s], out[s]
        torch.add(d, momentum[s], alpha=self.momentum, out=b)
        if self.nesterov:
            torch.add(d, b, alpha=self.momentum, out=o)
            torch.add(params[s], o, alpha=-self.lr, out=o)
        else:
            torch.add(params[s], b, alpha=-self.lr, out=o)
        if not check:
            return True
        return finite(o) and (self.lr > 0 or finite(b))

    def finite_after(self, params: Tensors, buffers: Tensors) -> bool:
        """Whether a step's results are finite everywhere. With lr > 0, Theta' = Theta - lr
        (delta + mu b') (or Theta - lr b') is NaN or infinite wherever b' is, so Theta'
        alone decides: one reduction pass per tensor, not two."""
        checked = [*params.values()] if self.lr > 0 else [*params.values(), *buffers.values()]
        return all(map(finite, checked))

    def step(self, params: Tensors, buffers: Tensors, delta: Tensors) -> None:
        for name, p in params.items():
            d = delta[name]
            b = buffers[name]
            b.mul_(self.momentum).add_(d)
            if self.nesterov:
                p.sub_(d + self.momentum * b, alpha=self.lr)
            else:
                p.sub_(b, alpha=self.lr)


def finite(t: torch.Tensor) -> bool:
    """Every entry finite, from one reduction pass (NaN and Inf reach the min or the max)."""
    if t.numel() == 0:
        return True
    lo, hi = torch.aminmax(t)
    return bool(torch.isfinite(lo)) and bool(torch.isfinite(hi))
