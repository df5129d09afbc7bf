"""The job's token budget: progress, the time left, and whether the job is finished.

    budget = Budget(total_tokens=10_000_000)
    budget.observe(tokens_merged, now)       # at each status and heartbeat answer
    budget.finished(tokens_merged)           # True once the budget is merged
    budget.remaining_seconds(tokens_merged, now)

The budget counts merged tokens (`Status.tokens_merged`: the tokens behind merged
contributions, averaged over fragments), which the fragments keep durably (their files and
the merge journal): `finished` is a pure function of them and the setting, so a restarted
synchronizer is exactly as finished as before. Only the rate behind the time left lives in
memory: it is the merged tokens' growth over the last `window_s` seconds of samples, and is
unknown (None) until two samples differ, e.g. for a little while after a restart.

What a finished job does (`SyncSettings.total_tokens`): status and heartbeats say
`finished`; learners hand over every fragment with work behind it, let their uploads drain
and exit 0. Updates that arrive after the budget was reached are accepted and merged as
any other: they are work already computed (a learner hears `finished` at most a long poll
after the merge that reached it), refusing them would throw it away, and the pending log's
contract (an update answered `accepted` is merged exactly once) stays the only rule. The
merged tokens may therefore end a little above the budget.

With shards each shard counts its own fragments; since every fragment sees every token each
shard's count estimates the job's, and the job is finished as soon as any shard says so
(`wire/job_status.merge_statuses`; learners stop on the first shard's `finished`).
"""

from __future__ import annotations

from collections import deque

__all__ = ["Budget"]


class Budget:
    """A token budget (0: none) and the recent merged-token rate. Not thread-safe: the
    synchronizer calls it under its lock."""

    def __init__(self, total_tokens: int, window_s: float = 60.0) -> None:
        self.total = int(total_tokens)
        self.window_s = window_s
        self.samples: deque[tuple[float, int]] = deque()
        """(time, tokens merged) when the count changed, oldest first, over `window_s`."""

    def observe(self, tokens: int, now: float) -> None:
        """Record the merged tokens at `now` (a sample only when they moved)."""
        if self.samples and self.samples[-1][1] == tokens:
            return
        self.samples.append((now, tokens))
        while len(self.samples) > 2 and now - self.samples[0][0] > self.window_s:
            self.samples.popleft()

    def rate(self, now: float) -> float | None:
        """Merged tokens per second over the samples kept (counting the time since the last
        one, so a stall lowers it); None before two samples differ."""
        if len(self.samples) < 2:
            return None
        (t0, k0), (t1, k1) = self.samples[0], self.samples[-1]
        span = max(now, t1) - t0
        return (k1 - k0) / span if span > 0 and k1 > k0 else None

    def finished(self, tokens: int) -> bool:
        return self.total > 0 and tokens >= self.total

    def progress(self, tokens: int) -> float | None:
        """Merged / budget, at most 1; None without a budget."""
        if self.total <= 0:
            return None
        return min(1.0, tokens / self.total)

    def remaining_seconds(self, tokens: int, now: float) -> float | None:
        """Seconds until the budget is merged at the recent rate: 0 once finished, None
        without a budget or a rate."""
        if self.total <= 0:
            return None
        if tokens >= self.total:
            return 0.0
        rate = self.rate(now)
        return (self.total - tokens) / rate if rate else None
