"""The numbers of bench/quality.py: Student's t interval of paired differences,
written here (no scipy), and the final model's loss per held-out window.

    paired_interval([2.01, 1.98, 2.03], [1.99, 1.97, 2.00])           # Interval(mean=0.02, ...)
    paired_interval(a, b, relative=True)                               # of a_i / b_i - 1
    t_quantile(0.975, 4)                                               # 2.776...
    window_losses(task, model, 4096)                                   # [loss of window 0, ...]
"""

from __future__ import annotations

import functools
import math
import statistics
from dataclasses import dataclass
from typing import Any


def student_t_cdf(x: float, df: int) -> float:
    """P(T <= x) for Student's t with `df` degrees of freedom. With x = sqrt(df) tan(theta)
    the density becomes c cos^(df-1)(phi) on [0, theta), bounded and smooth: Simpson's rule
    on 2000 intervals is exact to ~1e-12."""
    if df < 1:
        raise ValueError(f"df must be >= 1, got {df}")
    theta = math.atan(abs(x) / math.sqrt(df))
    c = math.exp(math.lgamma((df + 1) / 2) - math.lgamma(df / 2)) / math.sqrt(math.pi)
    n = 2000
    h = theta / n
    s = 0.0
    for i in range(n + 1):
        w = 1 if i in (0, n) else (4 if i % 2 else 2)
        s += w * math.cos(i * h) ** (df - 1)
    half = c * s * h / 3
    return 0.5 + half if x >= 0 else 0.5 - half


@functools.lru_cache(maxsize=256)
def t_quantile(p: float, df: int) -> float:
    """The `p` quantile of Student's t (bisection on the CDF); t_quantile(0.975, 4) = 2.776."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"p must be in (0, 1), got {p}")
    if p < 0.5:
        return -t_quantile(1.0 - p, df)
    lo, hi = 0.0, math.pi / 2  # theta; x = sqrt(df) tan(theta)
    for _ in range(60):
        mid = (lo + hi) / 2
        if student_t_cdf(math.sqrt(df) * math.tan(mid), df) < p:
            lo = mid
        else:
            hi = mid
    return math.sqrt(df) * math.tan((lo + hi) / 2)


@dataclass(frozen=True)
class Interval:
    """Mean of paired differences with its t-interval."""

    n: int
    mean: float
    sd: float
    half_width: float
    low: float
    high: float
    values: tuple[float, ...]


def paired_interval(
    a: list[float], b: list[float], level: float = 0.95, relative: bool = False
) -> Interval:
    """The `level` t-interval of the mean of d_i = a_i - b_i (`relative`: a_i / b_i - 1),
    pairs i being seeds. Needs at least two pairs."""
    if len(a) != len(b):
        raise ValueError(f"paired samples need equal lengths, got {len(a)} and {len(b)}")
    if len(a) < 2:
        raise ValueError(f"an interval needs at least 2 pairs, got {len(a)}")
    d = [x / y - 1.0 if relative else x - y for x, y in zip(a, b, strict=True)]
    n = len(d)
    mean, sd = statistics.fmean(d), statistics.stdev(d)
    half = t_quantile(0.5 + level / 2, n - 1) * sd / math.sqrt(n)
    return Interval(n, mean, sd, half, mean - half, mean + half, tuple(d))


def window_losses(task: Any, model: Any, windows: int, batch: int = 32) -> list[float]:
    """Mean token loss of `model` on each of `windows` non-overlapping windows spread evenly
    over `task`'s held-out tokens (fewer if the set holds fewer): for 64 windows, the very
    windows and mean of learner/data.py's `eval_loss` at batch 8 x 8 batches."""
    import numpy as np
    import torch
    import torch.nn.functional as F

    from ddiloco.learner.model import GPT

    ev = task.eval_loss
    if not isinstance(ev, functools.partial) or "tokens" not in ev.keywords:
        raise SystemExit("the quality harness needs a built-in model (its held-out tokens)")
    tokens, block = ev.keywords["tokens"], int(ev.keywords["block_size"])
    n = min(windows, (len(tokens) - 1) // block)
    starts = np.linspace(0, len(tokens) - block - 1, n).round().astype(np.int64)
    was_training = model.training
    model.eval()
    out: list[float] = []
    try:
        with torch.no_grad():
            for i in range(0, n, batch):
                w = np.stack([np.asarray(tokens[s : s + block + 1]) for s in starts[i : i + batch]])
                w = torch.from_numpy(w.astype(np.int64))
                x, y = w[:, :-1], w[:, 1:]
                if isinstance(model, GPT):
                    logits, _ = model(x)
                    ce = F.cross_entropy(
                        logits.float().reshape(-1, logits.size(-1)), y.reshape(-1), reduction="none"
                    )
                    out += ce.view(len(w), -1).mean(1).tolist()
                else:
                    out += [
                        float(task.loss_fn(model, x[j : j + 1], y[j : j + 1]))
                        for j in range(len(w))
                    ]
    finally:
        model.train(was_training)
    return out
