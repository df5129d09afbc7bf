"""Tokens lost per preemption: SIGTERM against SIGKILL, real processes, both arms in one run.

    .venv/bin/python bench/preemption.py --events 5 --json /tmp/preemption.json
    .venv/bin/python bench/preemption.py --events 8 -H 24 -P 4 --model tiny --seed 3

Each arm has its own real `ddiloco synchronizer` and one learner slot (`ddiloco learner`,
learner id `l0`), so every token the synchronizer counts for the job is that slot's. The two
arms run at the same time, one thread each, and preempt at the same inner steps: incarnation
i of either arm is signalled once its step log shows step `targets[i]` (drawn uniformly from
[2H, 3H) with `--seed`, so a preemption falls anywhere in the H-step cycle of every fragment).
One arm sends SIGTERM (a pod eviction, a node drain, a spot notice; the learner has
`--drain-s` to finish), the other SIGKILL (no notice). After each preemption the next
incarnation of the slot starts (a replacement with the same learner id), and so on.

Tokens lost per preemption, per fragment p:

    lost_p = tokens the incarnation computed
             - tokens of p the synchronizer accepted from it (merged + pending, /v1/status,
               after minus before the incarnation)

and the event's loss is the mean over fragments (each fragment is every step's work on its
share of the parameters), also in inner steps (tokens per inner step from the learner's
heartbeat, /v1/status) and as a fraction of H. "Computed" counts the inner steps the
incarnation's step log (`--log-path`) records as finished. For SIGTERM the learner's own
ledger (its "stop" record) is printed beside the synchronizer's count as a cross-check.
The issue's mark: with SIGTERM at most the current inner step is lost (<= 1 step). Timings
are printed, never asserted.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.local.report import read_jsonl

TOKEN = "bench-preemption"
LEARNER = "l0"


@dataclass
class Event:
    """One preemption of the slot: what its incarnation computed and what reached the job."""

    arm: str
    index: int
    target_step: int
    """The step the signal was due at (the same for both arms)."""
    steps: int = 0
    """Inner steps the incarnation finished (its step log)."""
    tokens_per_step: int = 0
    computed_tokens: int = 0
    accepted_tokens: list[int] = field(default_factory=list)
    """Per fragment: tokens the synchronizer accepted from this incarnation."""
    learner_accepted_tokens: list[int] | None = None
    """Per fragment, the learner's own ledger (accepted + duplicate), when it wrote one."""
    exit_code: int | None = None
    exit_s: float = 0.0
    """Seconds from the signal to the process's exit."""
    stop_to_exit_s: float | None = None
    """Seconds from the learner's "stop" record (training and draining done) to its exit."""

    @property
    def lost_tokens(self) -> float:
        return statistics.fmean(self.computed_tokens - a for a in self.accepted_tokens)

    @property
    def lost_steps(self) -> float:
        return self.lost_tokens / self.tokens_per_step if self.tokens_per_step else 0.0


def counted(client: SyncClient) -> list[int]:
    """Tokens accepted per fragment so far: merged plus pending in the open round."""
    return [f.tokens_merged + f.tokens_pending for f in client.status().fragments]


def settled(client: SyncClient, quiet_s: float = 0.5, timeout_s: float = 10.0) -> list[int]:
    """`counted` once it has not moved for `quiet_s` (an upload on the wire may still land)."""
    last, since = counted(client), time.monotonic()
    deadline = since + timeout_s
    while time.monotonic() < deadline:
        time.sleep(0.1)
        now = counted(client)
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= quiet_s:
            break
    return last


def last_step(records: list[dict[str, Any]]) -> int:
    return max((r["step"] for r in records if "step" in r and "event" not in r), default=0)


def tokens_per_step(client: SyncClient) -> int:
    for rec in client.status().learners:
        if rec.learner_id == LEARNER and rec.step > 0:
            return rec.tokens_total // rec.step
    return 0


class Arm:
    """One synchronizer and the successive incarnations of one learner slot."""

    def __init__(self, name: str, sig: signal.Signals, out: Path, args: argparse.Namespace) -> None:
        self.name, self.sig, self.out, self.args = name, sig, out, args
        self.port = free_port()
        self.sync = Child(
            f"{name}-synchronizer",
            ddiloco_command(
                "synchronizer", "--port", str(self.port), "--state-dir", str(out / "state")
            ),
            env_with(DDILOCO_TOKEN=TOKEN),
            out / "sync.log",
        )
        self.client = SyncClient(f"http://127.0.0.1:{self.port}", TOKEN, timeout=10)
        self.current: Child | None = None

    def learner(self, i: int) -> Child:
        a = self.args
        argv = ddiloco_command(
            "learner",
            "--sync-url",
            f"http://127.0.0.1:{self.port}",
            "--learner-id",
            LEARNER,
            "--model",
            a.model,
            "-H",
            str(a.h),
            "-P",
            str(a.fragments),
            "--batch-size",
            str(a.batch_size),
            "--threads",
            "1",
            "--log-every",
            "0",
            "--max-seconds",
            str(a.max_seconds),
            "--log-path",
            str(self.out / f"incarnation-{i}.jsonl"),
        )
        env = env_with(DDILOCO_TOKEN=TOKEN, OMP_NUM_THREADS="1", DDILOCO_DRAIN_S=str(a.drain_s))
        return Child(f"{self.name}-l0-{i}", argv, env, self.out / f"incarnation-{i}.log")

    def wait_healthy(self, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while not self.client.healthy():
            if not self.sync.alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: synchronizer did not come up ({self.out})")
            time.sleep(0.1)

    def run(self, targets: list[int]) -> list[Event]:
        self.out.mkdir(parents=True, exist_ok=True)
        self.sync.start()
        self.wait_healthy()
        events = []
        try:
            for i, target in enumerate(targets):
                events.append(self.preempt(i, target))
        finally:
            terminate_all([c for c in (self.current, self.sync) if c is not None])
        return events

    def preempt(self, i: int, target: int) -> Event:
        before = settled(self.client) if i else None  # no fragments before the first init
        child = self.current = self.learner(i)
        log_path = self.out / f"incarnation-{i}.jsonl"
        child.start()
        deadline = time.monotonic() + self.args.max_seconds
        while last_step(read_jsonl(log_path)) < target:
            if not child.alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"{child.name} stopped before step {target}: {child.log_path.read_text()[-2000:]}"
                )
            time.sleep(0.005)
        tps = tokens_per_step(self.client)
        assert child.proc is not None
        t_sig = time.monotonic()
        child.proc.send_signal(self.sig)
        code = child.proc.wait(timeout=self.args.drain_s + 60)
        exit_s, t_exit = time.monotonic() - t_sig, time.time()
        after = settled(self.client)
        before = before or [0] * len(after)
        records = read_jsonl(log_path)
        steps = last_step(records)
        stop = next((r for r in records if r.get("event") == "stop"), None)
        if stop and stop.get("steps"):
            steps = max(steps, stop["steps"])
            tps = stop["tokens"] // stop["steps"]
        event = Event(
            arm=self.name,
            index=i,
            target_step=target,
            steps=steps,
            tokens_per_step=tps,
            computed_tokens=steps * tps,
            accepted_tokens=[a - b for a, b in zip(after, before, strict=True)],
            exit_code=code,
            exit_s=round(exit_s, 3),
            stop_to_exit_s=round(t_exit - stop["t"], 3) if stop else None,
        )
        if stop and "ledger" in stop:
            rows = sorted(stop["ledger"], key=lambda r: r["fragment"])
            event.learner_accepted_tokens = [
                r.get("accepted_tokens", 0) + r.get("duplicate_tokens", 0) for r in rows
            ]
        return event


def summary(events: list[Event], h: int) -> dict[str, Any]:
    lost_t = [e.lost_tokens for e in events]
    lost_s = [e.lost_steps for e in events]
    return {
        "events": len(events),
        "mean_lost_tokens": statistics.fmean(lost_t),
        "max_lost_tokens": max(lost_t),
        "mean_lost_steps": statistics.fmean(lost_s),
        "max_lost_steps": max(lost_s),
        "mean_lost_fraction_of_h": statistics.fmean(lost_s) / h,
        "mean_exit_s": statistics.fmean(e.exit_s for e in events),
        "mean_stop_to_exit_s": statistics.fmean(
            [e.stop_to_exit_s for e in events if e.stop_to_exit_s is not None] or [0.0]
        ),
        "exit_codes": sorted({e.exit_code for e in events if e.exit_code is not None}),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--events", type=int, default=5, help="preemptions per arm (>= 5)")
    ap.add_argument("--model", default="tiny")
    ap.add_argument("-H", "--h", type=int, default=24)
    ap.add_argument("-P", "--fragments", type=int, default=4)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--drain-s", type=float, default=20.0, help="the learner's DDILOCO_DRAIN_S")
    ap.add_argument("--max-seconds", type=float, default=300.0, help="per incarnation, a guard")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--arms", default="sigterm,sigkill")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    out = args.out or Path(tempfile.mkdtemp(prefix="preemption-"))
    rng = random.Random(args.seed)
    targets = [rng.randrange(2 * args.h, 3 * args.h) for _ in range(args.events)]
    signals = {"sigterm": signal.SIGTERM, "sigkill": signal.SIGKILL}
    arms = [Arm(n, signals[n], out / n, args) for n in args.arms.split(",")]
    print(f"{len(arms)} arms at once, {args.events} preemptions each at steps {targets}; {out}")
    t0 = time.monotonic()
    lock = threading.Lock()
    results: dict[str, list[Event]] = {}

    def run(arm: Arm) -> None:
        events = arm.run(targets)
        with lock:
            results[arm.name] = events

    with ThreadPoolExecutor(len(arms)) as pool:
        for f in [pool.submit(run, a) for a in arms]:
            f.result()
    wall = time.monotonic() - t0
    report: dict[str, Any] = {"h": args.h, "fragments": args.fragments, "targets": targets}
    for arm in arms:
        events = results[arm.name]
        print(f"\n== {arm.name} (H={args.h}, P={args.fragments})")
        print(
            "  event  step  computed tok  accepted tok per fragment    lost tok  lost steps  /H    exit  s"
        )
        for e in events:
            mine = (
                f"  learner says {e.learner_accepted_tokens}" if e.learner_accepted_tokens else ""
            )
            print(
                f"  {e.index:5d} {e.steps:5d} {e.computed_tokens:13d}  {e.accepted_tokens!s:28}"
                f" {e.lost_tokens:9.0f} {e.lost_steps:10.2f} {e.lost_steps / args.h:5.2f}"
                f" {e.exit_code!s:>5} {e.exit_s:5.2f}"
                f"{'' if e.stop_to_exit_s is None else f' (stop record +{e.stop_to_exit_s:.2f})'}"
                f"{mine}"
            )
        s = summary(events, args.h)
        print(
            f"  mean lost {s['mean_lost_tokens']:.0f} tokens = {s['mean_lost_steps']:.2f} inner "
            f"steps = {s['mean_lost_fraction_of_h']:.3f} H (max {s['max_lost_steps']:.2f} steps); "
            f"exit codes {s['exit_codes']}, mean {s['mean_exit_s']:.2f} s to exit"
        )
        report[arm.name] = {
            **s,
            "per_event": [
                asdict(e) | {"lost_tokens": e.lost_tokens, "lost_steps": e.lost_steps}
                for e in events
            ],
        }
    if len(arms) > 1:
        names = [a.name for a in arms]
        print("\nside by side (same target steps), lost per preemption in tokens / inner steps:")
        print("  event  target  " + "  ".join(f"{n:>20}" for n in names))
        for i, target in enumerate(targets):
            cells = [results[n][i] for n in names]
            print(
                f"  {i:5d} {target:7d}  "
                + "  ".join(f"{e.lost_tokens:9.0f} / {e.lost_steps:6.2f}   " for e in cells)
            )
        print(
            "   mean          "
            + "  ".join(
                f"{report[n]['mean_lost_tokens']:9.0f} / {report[n]['mean_lost_steps']:6.2f}   "
                for n in names
            )
        )
    if "sigterm" in results:
        worst = summary(results["sigterm"], args.h)["max_lost_steps"]
        verdict = "met" if worst <= 1.0 else "missed"
        print(
            f"\nmark (SIGTERM loses at most the current inner step): {verdict}, worst {worst:.2f} steps"
        )
    print(f"wall {wall:.0f} s")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    try:
        main()
    except (SyncUnavailable, SyncRefused) as e:
        raise SystemExit(f"preemption bench: synchronizer: {e}") from None
