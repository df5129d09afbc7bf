"""The learner side's client of a sharded synchronizer: one `SyncClient` per shard.

    urls = split_urls("http://h:8470,http://h:8471")   # DDILOCO_SYNC_URL, in shard order
    clients = ShardClients(urls, token)
    job = clients.status()                            # every shard's status, merged
    version, tensors = clients.fragment(p)            # from p's owner

A learner's own training loop talks to every shard itself (streaming.py); this is for the
callers that want one synchronizer's calls over several: the evaluator, `ddiloco local`'s
launcher, `ddiloco export`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from ddiloco.learner.sync_client import SyncClient
from ddiloco.wire.job_status import merge_statuses
from ddiloco.wire.protocol import Status

if TYPE_CHECKING:
    from ddiloco.wire.tls import ClientTLS

__all__ = ["ShardClients", "split_urls"]


def split_urls(value: str) -> list[str]:
    """A comma-separated list of shard URLs, in shard order (one URL: one synchronizer)."""
    urls = [u.strip().rstrip("/") for u in value.split(",")]
    if not all(urls):
        raise ValueError(f"empty URL in the shard list {value!r}")
    return urls


class ShardClients:
    """A `SyncClient` per shard behind the calls a launcher or a status reader makes:
    `status()` is `merge_statuses` of every shard's (SyncUnavailable if any is away),
    `fragment(p)` and `exact_fragment(p)` ask p's owner (learnt from the last status), `request`
    goes to shard 0.

        clients = ShardClients(["http://h:8470", "http://h:8471"], token)
        job = clients.status()
    """

    def __init__(
        self,
        urls: Sequence[str],
        token: Any,
        *,
        timeout: float = 60.0,
        tls: ClientTLS | None = None,
    ) -> None:
        self.clients = [SyncClient(u, token, timeout=timeout, tls=tls) for u in urls]
        self.owners: dict[int, int] = {}

    @property
    def http_version(self) -> str:
        return self.clients[0].http_version

    @property
    def bytes_up(self) -> int:
        return sum(c.bytes_up for c in self.clients)

    @property
    def bytes_down(self) -> int:
        return sum(c.bytes_down for c in self.clients)

    def statuses(self) -> list[Status]:
        return [c.status() for c in self.clients]

    def status(self) -> Status:
        job = merge_statuses(self.statuses())
        self.owners = {f.index: f.shard for f in job.fragments}
        return job

    def owner(self, p: int) -> SyncClient:
        """The client of p's owner (learnt from the last status)."""
        if p not in self.owners:
            self.status()
        return self.clients[self.owners.get(p, 0)]

    def fragment(self, p: int) -> Any:
        return self.owner(p).fragment(p)

    def exact_fragment(self, p: int) -> Any:
        return self.owner(p).exact_fragment(p)

    def request(self, *args: Any, **kwargs: Any) -> Any:
        return self.clients[0].request(*args, **kwargs)

    def model_spec(self) -> Any:
        """What the job trains (every shard got the same init upload: shard 0's)."""
        return self.clients[0].model_spec()

    def evaluation(self, report: Any) -> Any:
        """Post an evaluation to shard 0, which keeps the job's (`merge_statuses`)."""
        return self.clients[0].evaluation(report)

    def healthy(self) -> bool:
        return all(c.healthy() for c in self.clients)

    def close(self) -> None:
        for c in self.clients:
            c.close()
