"""A fragment's lock, which a merge takes before any waiting upload.

    lock = FragmentLock()
    with lock:              # an upload's admission (the pending log's write inside it)
        ...
    with lock.first():      # a merge taking its round, or installing its version
        ...

Each upload of a fragment holds its lock while it writes its record to the pending log (the
log's order is the round's: journal.py), 20-50 ms for a 32 MB record. A plain
`threading.Lock` is not fair: a merge waiting to install its version waited behind one
upload after another, 0.23 s at p99 (`ddiloco_merge_phase_seconds{phase="install"}`,
bench/RESULTS.md, issue 15). Here a merge waits for the holder only: plain acquirers wait
while anyone waits in `first`.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FragmentLock"]


class FragmentLock:
    """Mutual exclusion; `first()` goes before every plain acquirer waiting."""

    def __init__(self) -> None:
        self._cv = threading.Condition(threading.Lock())
        self._held = False
        self._urgent = 0
        """Threads waiting in `first`."""
        self._plain = 0
        """Threads waiting in `acquire`."""

    def acquire(self) -> None:
        with self._cv:
            self._plain += 1
            try:
                while self._held or self._urgent:
                    self._cv.wait()
            finally:
                self._plain -= 1
            self._held = True

    def release(self) -> None:
        with self._cv:
            if not self._held:
                raise RuntimeError("release of a FragmentLock not held")
            self._held = False
            self._cv.notify_all()

    def __enter__(self) -> FragmentLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    @contextmanager
    def first(self) -> Iterator[None]:
        with self._cv:
            self._urgent += 1
            try:
                while self._held:
                    self._cv.wait()
            except BaseException:
                self._urgent -= 1
                self._cv.notify_all()  # plain waiters may go, if we were the last
                raise
            self._urgent -= 1
            self._held = True
        try:
            yield
        finally:
            self.release()

    def locked(self) -> bool:
        return self._held

    def waiting(self) -> tuple[int, int]:
        """(plain, first) acquirers waiting now."""
        with self._cv:
            return self._plain, self._urgent
