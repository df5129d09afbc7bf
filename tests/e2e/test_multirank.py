"""A learner that is a data-parallel group of 2 ranks, as real processes against a real synchronizer.

    .venv/bin/pytest tests/e2e/test_multirank.py

`ddiloco learner --nproc-per-node 2` (learner/launch.py) starts two ranks on gloo; rank 0
streams for both (learner/group.py). With `--debug-digests` every rank writes a SHA-256 of
its own parameters into each adoption record of its step log (rank 1's is l0.rank1.jsonl),
so the test compares what each process really holds.

1. A 2-rank and a 1-rank learner train together (quorum 1): after every adoption the two
   ranks' digests are the same, the synchronizer counts the 2-rank learner's tokens as
   steps x 2 ranks x batch x block, and the merged tokens are the sum of both learners'.
2. A rank SIGKILLed takes its learner down: the launcher and rank 0 exit (non-zero), and
   what the synchronizer holds from the learner is exactly a prefix of the hand-overs rank 0
   logged, none from a step after the one rank 1 died in, none refused.
3. SIGTERM to the launcher (kubelet's to PID 1), DDP and FSDP2: both ranks stop after the
   same step, every fragment's work is handed over and delivered (not_handed_over_tokens and
   queued_tokens 0), the synchronizer holds every token computed, and the exit code is 0.
4. A learner that aborts (SIGABRT, what a rank's std::terminate raises) writes every
   thread's Python stack to its log first (faulthandler): 3. failed once in ~10 CI runs with
   rank 1 aborting in a teardown; the next time, its log says where.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ddiloco.local.processes import Child, terminate_all
from ddiloco.local.report import read_jsonl
from ddiloco.synchronizer.storage.state import StateStore

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(150)]
TOKEN = "e2e-multirank"
H, P = 8, 2
TOKENS_PER_RANK = 8 * 64  # batch 8 x block 64 (tiny)


def steps(path: Path) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path) if "step" in r and "event" not in r]


def last_step(path: Path) -> int:
    return max((r["step"] for r in steps(path)), default=0)


def event(path: Path, name: str) -> list[dict[str, Any]]:
    return [r for r in read_jsonl(path) if r.get("event") == name]


def wait_exit(child: Child, timeout: float) -> int:
    assert child.proc is not None
    code = child.proc.wait(timeout=timeout)
    return code


def tail(child: Child) -> str:
    return child.log_path.read_text()[-4000:]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_two_rank_and_one_rank_learners_train_together(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN, "--no-grace")
    flags = ("-H", str(H), "-P", str(P), "--max-steps", "40")
    group = learner_process(
        tmp_path, proc, 0, 2, *flags, "--nproc-per-node", "2", "--debug-digests"
    )
    solo = learner_process(tmp_path, proc, 1, 2, *flags)
    client = proc.client(timeout=5)
    try:
        proc.start()
        group.start()
        solo.start()
        codes = [wait_exit(group, 100), wait_exit(solo, 100)]
        status = client.status()
    finally:
        terminate_all([group, solo, proc.child])
    assert codes == [0, 0], tail(group) + tail(solo)

    # the two ranks hold the same bits after every adoption (join included)
    mine = [
        (r["step"], r["fragment"], r["version"], r["digest"])
        for r in event(tmp_path / "l0.jsonl", "adopt")
    ]
    theirs = [
        (r["step"], r["fragment"], r["version"], r["digest"])
        for r in event(tmp_path / "l0.rank1.jsonl", "adopt")
    ]
    assert mine == theirs
    merged = [a for a in mine if a[2] >= 1]
    assert len(merged) >= 4, mine  # several merges, each folded in on both ranks
    assert len({a[3] for a in merged}) == len(merged)  # and the parameters did move
    rank_steps = [steps(tmp_path / name) for name in ("l0.jsonl", "l0.rank1.jsonl")]
    assert [r["step"] for r in rank_steps[1]] == list(range(1, 41))
    # each rank trained its own batches (other losses), so equal bits are the group's doing
    assert sum(a["loss"] != b["loss"] for a, b in zip(*rank_steps, strict=True)) >= 30

    # one learner of 2 ranks to the synchronizer: its counters are the tokens of both
    by_id = {s.learner_id: s for s in status.learners}
    assert by_id["l0"].tokens_total == by_id["l0"].step * 2 * TOKENS_PER_RANK > 0
    assert by_id["l1"].tokens_total == by_id["l1"].step * TOKENS_PER_RANK > 0
    stops = [event(tmp_path / f"l{i}.jsonl", "stop")[0] for i in (0, 1)]
    assert stops[0]["tokens"] == 40 * 2 * TOKENS_PER_RANK and stops[0]["world"] == 2
    assert stops[1]["tokens"] == 40 * TOKENS_PER_RANK and stops[1]["world"] == 1
    for p, frag in enumerate(status.fragments):  # merged tokens: the sum over both learners
        rows = [s["ledger"][p] for s in stops]
        assert rows[0]["accepted_tokens"] == rows[0]["accepted_steps"] * 2 * TOKENS_PER_RANK
        delivered = sum(r["accepted_tokens"] for r in rows)
        assert frag.tokens_merged + frag.tokens_pending == delivered > 0
        assert all(r["balanced"] for r in rows), rows
    assert all(s["ledger"][p]["accepted_tokens"] > 0 for s in stops for p in range(P))


def test_a_killed_rank_takes_its_learner_down_and_nothing_partial_reaches_the_synchronizer(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN, "--no-grace")
    learner = learner_process(
        tmp_path,
        proc,
        0,
        1,
        "-H",
        str(H),
        "-P",
        str(P),
        "--max-seconds",
        "100",
        "--nproc-per-node",
        "2",
    )
    rank0_log, rank1_log = tmp_path / "l0.jsonl", tmp_path / "l0.rank1.jsonl"
    client = proc.client(timeout=5)
    try:
        proc.start()
        learner.start()
        deadline = time.time() + 80
        while last_step(rank1_log) < 3 * H + 3:  # mid-cycle, after some merges
            assert learner.alive(), tail(learner)
            assert time.time() < deadline, "the learner did not reach its step"
            time.sleep(0.01)
        pids = [event(log, "start")[0]["pid"] for log in (rank0_log, rank1_log)]
        os.kill(pids[1], signal.SIGKILL)
        killed_at = last_step(rank1_log)  # it can log no further step
        t0 = time.time()
        code = wait_exit(learner, 30)
        down_s = time.time() - t0
        assert not alive(pids[0])  # the surviving rank went with it
        before = client.status()
        time.sleep(1.0)  # nothing of the dead learner arrives late
        after = client.status()
        proc.child.stop(grace_s=10)  # its state on disk is final
    finally:
        terminate_all([learner, proc.child])
    print(f"rank 1 killed after step {killed_at}: learner exited {code} after {down_s:.2f} s")
    assert code != 0, tail(learner)
    assert "Rank 1 exited with code 137" in learner.log_path.read_text()
    assert [f.tokens_merged + f.tokens_pending for f in before.fragments] == [
        f.tokens_merged + f.tokens_pending for f in after.fragments
    ]
    assert after.contributions_rejected == 0, after.refusals  # no torn or bad upload
    # what the synchronizer holds from l0 is a prefix of the complete hand-overs rank 0 logged
    assert max(r["step"] for r in steps(rank0_log)) <= killed_at + 1
    store = StateStore(proc.state)
    for p, frag in enumerate(after.fragments):
        handovers = [r for r in event(rank0_log, "handover") if r["fragment"] == p]
        assert handovers and all(r["step"] <= killed_at + 1 for r in handovers)
        sums = [0]
        for r in handovers:
            sums.append(sums[-1] + r["steps"] * 2 * TOKENS_PER_RANK)
        assert frag.tokens_merged + frag.tokens_pending in sums, (p, frag, sums)
        _, step_mark = store.load_fragment(p).high_water["l0"]
        assert step_mark in [r["step"] for r in handovers]


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_sigterm_to_the_launcher_hands_everything_over_and_exits_0(
    tmp_path: Path,
    synchronizer_process: Callable[..., Any],
    learner_process: Callable[..., Any],
    parallel: str,
) -> None:
    proc = synchronizer_process(tmp_path, TOKEN, "--no-grace")
    learner = learner_process(
        tmp_path,
        proc,
        0,
        1,
        "-H",
        str(H),
        "-P",
        str(P),
        "--max-seconds",
        "100",
        "--nproc-per-node",
        "2",
        "--parallel",
        parallel,
        DDILOCO_DRAIN_S="20",
    )
    rank0_log, rank1_log = tmp_path / "l0.jsonl", tmp_path / "l0.rank1.jsonl"
    client = proc.client(timeout=5)
    try:
        proc.start()
        learner.start()
        deadline = time.time() + 80
        target = 3 * H + H // 2 + 1  # mid-cycle for both fragments
        while last_step(rank0_log) < target:
            assert learner.alive(), tail(learner)
            assert time.time() < deadline, "the learner did not reach its step"
            time.sleep(0.01)
        assert learner.proc is not None
        learner.proc.terminate()  # to the launcher only, as kubelet signals PID 1
        t0 = time.time()
        code = wait_exit(learner, 40)
        exit_s = time.time() - t0
        time.sleep(0.5)  # an upload answered just before the exit is counted by now
        got = [f.tokens_merged + f.tokens_pending for f in client.status().fragments]
    finally:
        terminate_all([learner, proc.child])
    print(f"{parallel}: SIGTERM at step >= {target}: exit {code} after {exit_s:.2f} s")
    assert code == 0, tail(learner)
    stop, stop1 = event(rank0_log, "stop")[0], event(rank1_log, "stop")[0]
    assert stop["stop_reason"] == stop1["stop_reason"] == "preempted"
    assert stop["parallel"] == stop1["parallel"] == parallel  # DDILOCO_PARALLEL was applied
    assert stop["steps"] == stop1["steps"] >= target  # both ranks stopped after the same step
    assert stop["tokens"] == stop["steps"] * 2 * TOKENS_PER_RANK
    for row in stop["ledger"]:
        assert row["balanced"], row
        assert row["not_handed_over_tokens"] == 0 and row["queued_tokens"] == 0, row
        assert row["accepted_tokens"] == stop["tokens"], row
    assert got == [stop["tokens"]] * P  # every token computed reached the synchronizer


def test_a_learner_that_aborts_prints_every_threads_python_stack(
    tmp_path: Path, synchronizer_process: Callable[..., Any], learner_process: Callable[..., Any]
) -> None:
    """SIGABRT (what a std::terminate in a collective's teardown raises) to a training
    learner: before it dies it writes each thread's Python stack to its log (faulthandler,
    learner/cli.py), so a rank that aborts says where it was."""
    proc = synchronizer_process(tmp_path, TOKEN, "--no-grace")
    learner = learner_process(
        tmp_path, proc, 0, 1, "-H", str(H), "-P", str(P), "--max-seconds", "60"
    )
    try:
        proc.start()
        learner.start()
        deadline = time.time() + 60
        while last_step(tmp_path / "l0.jsonl") < 2:
            assert learner.alive(), tail(learner)
            assert time.time() < deadline, "the learner did not step"
            time.sleep(0.01)
        assert learner.proc is not None
        learner.proc.send_signal(signal.SIGABRT)
        code = wait_exit(learner, 30)
    finally:
        terminate_all([learner, proc.child])
    log = tail(learner)
    assert code == -signal.SIGABRT, log
    assert "Fatal Python error: Aborted" in log and "most recent call first" in log, log
