"""A fragment's lock: a merge waiting in `first` goes before every upload waiting.

pytest tests/unit/test_locks.py
"""

from __future__ import annotations

import threading
import time

import pytest

from ddiloco.synchronizer.locks import FragmentLock, MergeGate


def wait_for(cond: object, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < end, "timed out"
        time.sleep(0.001)


@pytest.mark.parametrize("trial", range(20))  # an unfair lock lets `first` win some by luck
def test_first_goes_before_every_plain_waiter(trial: int) -> None:
    lock = FragmentLock()
    order: list[str] = []
    lock.acquire()  # an upload writing its record

    def plain(i: int) -> None:
        with lock:
            order.append(f"plain{i}")

    def first() -> None:
        with lock.first():
            order.append("first")

    plains = [threading.Thread(target=plain, args=(i,)) for i in range(8)]
    for t in plains:
        t.start()
    wait_for(lambda: lock.waiting() == (8, 0))
    merge = threading.Thread(target=first)
    merge.start()
    wait_for(lambda: lock.waiting() == (8, 1))
    lock.release()
    for t in [*plains, merge]:
        t.join(10)
    assert order[0] == "first"
    assert sorted(order[1:]) == sorted(f"plain{i}" for i in range(8))
    assert lock.waiting() == (0, 0) and not lock.locked()


def test_it_excludes_and_refuses_a_release_not_held() -> None:
    lock = FragmentLock()
    inside = 0
    most = 0

    def work() -> None:
        nonlocal inside, most
        for k in range(200):
            with lock.first() if k % 3 == 0 else lock:
                inside += 1
                most = max(most, inside)
                inside -= 1

    threads = [threading.Thread(target=work) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert most == 1 and not lock.locked()
    with pytest.raises(RuntimeError):
        lock.release()


def test_the_merge_gate_holds_reads_while_merges_compute_and_no_longer() -> None:
    gate = MergeGate(max_wait_s=5.0)
    t0 = time.monotonic()
    gate.wait()  # no merge: at once
    assert time.monotonic() - t0 < 0.5
    done = threading.Event()

    def read() -> None:
        gate.wait()
        done.set()

    gate.__enter__()  # two merges compute
    gate.__enter__()
    reader = threading.Thread(target=read)
    reader.start()
    assert not done.wait(0.2)
    gate.__exit__()  # one is done, the other computes on
    assert not done.wait(0.2)
    gate.__exit__()
    assert done.wait(5)  # the last one done: the read goes on
    reader.join(5)


def test_the_merge_gate_waits_at_most_max_wait_and_not_at_all_when_off() -> None:
    with MergeGate(max_wait_s=0.2) as gate:
        t0 = time.monotonic()
        gate.wait()
        assert 0.15 <= time.monotonic() - t0 < 3
    with MergeGate(enabled=False) as off:
        t0 = time.monotonic()
        off.wait()
        assert time.monotonic() - t0 < 0.1
