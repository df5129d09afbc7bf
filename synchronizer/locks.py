"""A merge goes first: a fragment's lock it takes before any waiting upload, and a gate
that holds the upload port's body reads while a merge computes.

    lock = FragmentLock()
    with lock:              # an upload's admission (the pending log's write inside it)
        ...
    with lock.first():      # a merge taking its round, or installing its version
        ...

Each upload of a fragment holds its lock while it writes its record to the pending log (the log's
order is the round's: journal.py), 20-50 ms for a 32 MB record. A plain `threading.Lock` is not
fair: a merge waiting to install its version waited behind one upload after another
(`ddiloco_merge_phase_seconds{phase="install"}`, bench/RESULTS.md, "Figures behind the code"). Here
a merge waits for the holder only: plain acquirers wait while anyone waits in `first`.

    gate = MergeGate()
    with gate:              # a merge computing (fragment.py `Fragment._computed`)
        ...
    gate.wait()             # an upload port's body read, before each chunk (upload_port.py)

On few cores a merge's arithmetic shares them with many connections' socket copies (kernel
time, outside any CPU slot), which stretched its tail many times over. While a merge
computes, the reads wait at their next chunk (TCP holds the senders back) for at most
`max_wait_s` (`TuningSettings.merge_first`; bench/RESULTS.md, "How ingest reached its figure").
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["FragmentLock", "MergeGate"]


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


class MergeGate:
    """Merges computing now (a counter): `wait` returns once none is, or after
    `max_wait_s`; at once when disabled."""

    def __init__(self, enabled: bool = True, max_wait_s: float = 1.0) -> None:
        self.enabled = enabled
        self.max_wait_s = max_wait_s
        self._cv = threading.Condition(threading.Lock())
        self.active = 0

    def __enter__(self) -> MergeGate:
        with self._cv:
            self.active += 1
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cv:
            self.active -= 1
            if not self.active:
                self._cv.notify_all()

    def wait(self) -> None:
        """Return once no merge computes (or `max_wait_s` passed)."""
        if not self.enabled or not self.active:  # the common case: no lock taken
            return
        with self._cv:
            self._cv.wait_for(lambda: not self.active, self.max_wait_s)
