"""Each fragment's file written from its served state, off the merge's path (journal.py
says why the merge does not write it: its journal record makes it durable)."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

__all__ = ["Snapshots"]


class Snapshots:
    """Writes each fragment's latest state to its file, off the merge's path, one thread.

    `request(p)` after a journaled merge; `write(p)` is also called by a merge that must
    write synchronously, by `flush`, and at close. Per fragment a lock orders the writes,
    so an older state never replaces a newer file."""

    def __init__(
        self, write: Callable[[int], None], n: int, lag: Callable[[int], int] = lambda p: 0
    ) -> None:
        self._write = write
        self._lag = lag
        """How many merges fragment p's file trails its served version."""
        self.locks = [threading.Lock() for _ in range(n)]
        self._want: dict[int, None] = {}
        """Fragments whose file is behind, in the order asked. The writer takes the one
        that trails most, the first asked among equals: taking the lowest-numbered starved
        the others at saturation, whose merges then hit `snapshot_lag` and wrote their
        128 MB files themselves (bench/RESULTS.md, "Figures behind the code")."""
        self._cv = threading.Condition()
        self._stop = False
        self._busy = False
        self._thread = threading.Thread(target=self._run, name="ddiloco-snapshots", daemon=True)
        self._thread.start()

    def request(self, p: int) -> None:
        with self._cv:
            self._want.setdefault(p)
            self._cv.notify_all()

    def write(self, p: int) -> None:
        with self.locks[p]:
            self._write(p)

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._want and not self._stop:
                    self._cv.wait()
                if self._stop and not self._want:
                    return
                p = max(self._want, key=self._lag)
                del self._want[p]
                self._busy = True
            try:
                self.write(p)
            except Exception:  # a full disk: the journal still holds it; try again
                log.exception("writing the file of fragment %d failed; retrying in 1 s", p)
                time.sleep(1.0)
                with self._cv:
                    self._want.setdefault(p)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def flush(self, timeout: float = 60.0) -> None:
        """Return once every requested file is written (or `timeout` passed)."""
        end = time.monotonic() + timeout
        with self._cv:
            while (self._want or self._busy) and time.monotonic() < end:
                self._cv.wait(0.05)

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        self._thread.join(timeout=120)

    def abandon(self) -> None:
        """Stop without writing what is requested: what a SIGKILL leaves (tests); a write
        under way finishes first."""
        with self._cv:
            self._stop = True
            self._want.clear()
            self._cv.notify_all()
        self._thread.join(timeout=120)
