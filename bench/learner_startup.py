"""A learner's time from process start to its first inner step: raw documents against a
prepared dataset, by corpus size, and the same for a replacement of the slot.

    .venv/bin/python bench/learner_startup.py --json /tmp/startup.json
    .venv/bin/python bench/learner_startup.py --before-mb 20,200 --after-mb 20,2000 --repeat 2

Arms, each with its own real `ddiloco synchronizer` and `ddiloco learner --model tiny`
(byte-level tokens, one thread, learner 0 of `--learners`):

- before: `--data corpus.jsonl`, raw documents the learner tokenizes (its shard and the eval
  set) before its first step, with an empty token cache (a learner on a new node);
- after: `--data <prepared>`, a prepared dataset (learner/prepared.py) the learner opens by
  its manifest and memory-maps. The smallest size is made by `ddiloco prepare` from the same
  JSONL (its throughput is reported); bigger ones are written in the format directly, the
  smallest one's tokens repeated, since what is measured is the learner's start.

A corpus of N MB is N * 10^6 bytes of JSONL (stdlib source paragraphs, repeated); byte-level,
one token per byte of text. Time to first step: from just before the learner process is
spawned to the wall-clock stamp of its first step record (`--log-path`). Then the learner is
SIGKILLed once it has stepped and reported a data position, and a replacement (a new process
with the same learner id) starts: its time to first step is measured the same way, and the
data position it resumed at (the synchronizer's record) is reported. The before arm's
replacement shares the node's token cache (it re-reads, it does not re-tokenize); on a new
node it would pay the first start again. Where a before size is not run, the 2 GB figure is
extrapolated linearly from the two largest measured before sizes, and marked so.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.learner import prepared
from ddiloco.learner.data import stdlib_files
from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import Child, ddiloco_command, env_with, free_port, terminate_all
from ddiloco.local.report import read_jsonl

TOKEN = "bench-startup"
MB = 1_000_000


def make_corpus(path: Path, mb: float) -> int:
    """A JSONL corpus of about ``mb`` MB (stdlib paragraphs, repeated); its size in bytes."""
    paragraphs = [
        json.dumps({"text": p}) + "\n"
        for f in stdlib_files()[:200]
        for p in f.read_text(errors="replace").split("\n\n")
        if p.strip()
    ]
    block = "".join(paragraphs).encode()
    target = int(mb * MB)
    with open(path, "wb") as out:
        written = 0
        while written < target:
            piece = block[: target - written]
            piece = piece[: piece.rfind(b"\n") + 1] or block[: block.find(b"\n") + 1]
            out.write(piece)
            written += len(piece)
    return path.stat().st_size


def run_prepare(source: Path, dest: Path, chunk_tokens: int) -> dict[str, float]:
    """`ddiloco prepare SOURCE --out DEST` as a subprocess: seconds and MB/s of source."""
    start = time.monotonic()
    done = subprocess.run(
        ddiloco_command(
            "prepare",
            str(source),
            "--out",
            str(dest),
            "--quiet",
            "--chunk-tokens",
            str(chunk_tokens),
        ),
        capture_output=True,
        text=True,
        check=False,
    )
    took = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"learner_startup: prepare failed: {done.stderr.strip()[-500:]}")
    mb = source.stat().st_size / MB
    return {"source_mb": mb, "seconds": took, "mb_per_s": mb / took}


def tile_prepared(base: Path, dest: Path, tokens: int, chunk_tokens: int) -> None:
    """A prepared dataset of ``tokens`` training tokens: ``base``'s repeated, its eval set."""
    ds = prepared.open_dataset(base)
    whole = ds.train(0, 1)
    pool = np.asarray(whole.windows(np.array([0]), len(whole))[0], dtype=ds.manifest.np_dtype)
    m = ds.manifest
    out = prepared.DatasetWriter(
        str(dest),
        tokenizer=m.tokenizer,
        eos=m.eos,
        vocab_size=m.vocab_size,
        data_field=m.data_field,
        source=f"{m.source} repeated to {tokens} tokens",
        chunk_tokens=chunk_tokens,
    )
    out.add_eval(np.asarray(ds.eval()), documents=m.eval_documents)
    left, at = tokens, 0
    while left > 0:
        n = min(left, chunk_tokens, len(pool) - at)
        out.add_train(pool[at : at + n])
        at, left = (at + n) % len(pool), left - n
        out.end_document(documents=0)  # closes the chunk once it is full
    out.commit()


class Slot:
    """One synchronizer and the processes that play learner slot l0 in turn."""

    def __init__(self, out: Path, data: Path, learners: int) -> None:
        self.out, self.data, self.learners = out, data, learners
        self.port = free_port()
        self.sync = Child(
            "synchronizer",
            ddiloco_command(
                "synchronizer", "--port", str(self.port), "--state-dir", str(out / "state")
            ),
            env_with(DDILOCO_TOKEN=TOKEN),
            out / "sync.log",
        )
        self.client = SyncClient(f"http://127.0.0.1:{self.port}", TOKEN, timeout=10)
        self.children: list[Child] = []

    def start_sync(self) -> None:
        self.sync.start()
        deadline = time.monotonic() + 60
        while not self.client.healthy():
            if not self.sync.alive() or time.monotonic() > deadline:
                raise SystemExit(f"learner_startup: synchronizer did not start ({self.out})")
            time.sleep(0.1)

    def learner(self, i: int) -> Child:
        argv = ddiloco_command(
            "learner",
            "--sync-url",
            f"http://127.0.0.1:{self.port}",
            "--learner-id",
            "l0",
            "--learner-index",
            "0",
            "--num-learners",
            str(self.learners),
            "--model",
            "tiny",
            "--data",
            str(self.data),
            "--batch-size",
            "8",
            "--threads",
            "1",
            "--log-every",
            "0",
            "--max-steps",
            "1000000",
            "--log-path",
            str(self.out / f"l0-{i}.jsonl"),
        )
        env = env_with(
            DDILOCO_TOKEN=TOKEN, OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(self.out / "cache")
        )
        child = Child(f"l0-{i}", argv, env, self.out / f"l0-{i}.log")
        self.children.append(child)
        return child

    def first_step(self, child: Child, log: Path, timeout_s: float) -> float:
        """Start ``child``; seconds from just before its spawn to its first step record."""
        t0 = time.time()
        child.start()
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if log.exists():
                steps = [r for r in read_jsonl(log) if "dt" in r]
                if steps:
                    return float(steps[0]["t"]) - t0
            if not child.alive():
                tail = child.log_path.read_text(errors="replace")[-1500:]
                raise SystemExit(f"learner_startup: {child.name} died:\n{tail}")
            time.sleep(0.02)
        raise SystemExit(f"learner_startup: no first step in {timeout_s} s ({child.log_path})")

    @staticmethod
    def steps(log: Path) -> int:
        return sum(1 for r in read_jsonl(log) if "dt" in r)

    def recorded(self) -> int:
        rows = [r for r in self.client.status().learners if r.learner_id == "l0"]
        return rows[0].data_position if rows else 0

    def measure(self, timeout_s: float) -> dict[str, Any]:
        try:
            self.start_sync()
            first = self.learner(0)
            t_first = self.first_step(first, self.out / "l0-0.jsonl", timeout_s)
            deadline = time.monotonic() + 60
            while self.recorded() == 0 or self.steps(self.out / "l0-0.jsonl") < 10:
                if time.monotonic() > deadline or not first.alive():
                    raise SystemExit(f"learner_startup: no data position recorded ({self.out})")
                time.sleep(0.1)
            first.kill()
            position = self.recorded()
            second = self.learner(1)
            t_second = self.first_step(second, self.out / "l0-1.jsonl", timeout_s)
            second.kill()
        finally:
            self.client.close()
            terminate_all([*self.children, self.sync])
        return {
            "first_step_s": t_first,
            "replacement_first_step_s": t_second,
            "resumed_at": position,
        }


def arm(
    work: Path, path: str, mb: float, data: Path, learners: int, repeat: int, timeout_s: float
) -> dict[str, Any]:
    runs = [
        Slot(work / f"{path}-{mb:g}mb-{r}", data, learners).measure(timeout_s)
        for r in range(repeat)
    ]
    res: dict[str, Any] = {"path": path, "corpus_mb": mb, "runs": runs}
    for key in ("first_step_s", "replacement_first_step_s"):
        res[key] = statistics.median(r[key] for r in runs)
    print(
        f"{path:6} {mb:8g} MB: first step {res['first_step_s']:7.2f} s, replacement "
        f"{res['replacement_first_step_s']:6.2f} s (resumed at {runs[-1]['resumed_at']})",
        flush=True,
    )
    return res


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--before-mb", default="20,200", help="raw-corpus sizes, MB, comma-separated")
    ap.add_argument(
        "--after-mb",
        default="20,2000",
        help="prepared sizes, MB (the first: made "
        "by `ddiloco prepare`; the others: its tokens repeated)",
    )
    ap.add_argument("--learners", type=int, default=2, help="M: the job's learner slots")
    ap.add_argument(
        "--chunk-tokens",
        type=int,
        default=prepared.DEFAULT_CHUNK_TOKENS,
        help="tokens per chunk of the prepared datasets",
    )
    ap.add_argument("--repeat", type=int, default=1, help="runs per arm (the median is shown)")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="per process, to first step")
    ap.add_argument("--work", type=Path, help="where corpora and runs go (default: a temp dir)")
    ap.add_argument("--json", type=Path, help="write the results here")
    args = ap.parse_args(argv)
    before = [float(x) for x in args.before_mb.split(",") if x]
    after = [float(x) for x in args.after_mb.split(",") if x]
    if not after:
        raise SystemExit("learner_startup: --after-mb needs at least one size")
    with tempfile.TemporaryDirectory(prefix="learner-startup-") as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        results: dict[str, Any] = {"learners": args.learners, "arms": []}
        corpora = {}
        for mb in sorted({*before, after[0]}):
            corpora[mb] = work / f"corpus-{mb:g}mb.jsonl"
            make_corpus(corpora[mb], mb)
        base = work / f"prepared-{after[0]:g}mb"
        results["prepare"] = run_prepare(corpora[after[0]], base, args.chunk_tokens)
        print(
            f"prepare: {results['prepare']['source_mb']:.1f} MB in "
            f"{results['prepare']['seconds']:.1f} s = {results['prepare']['mb_per_s']:.2f} MB/s",
            flush=True,
        )
        for mb in before:
            results["arms"].append(
                arm(work, "before", mb, corpora[mb], args.learners, args.repeat, args.timeout_s)
            )
        for mb in after:
            data = base
            if mb != after[0]:
                data = work / f"prepared-{mb:g}mb"
                tile_prepared(base, data, int(mb * MB), args.chunk_tokens)
            results["arms"].append(
                arm(work, "after", mb, data, args.learners, args.repeat, args.timeout_s)
            )
            if mb != after[0]:
                for f in data.iterdir():  # gigabytes: gone as soon as measured
                    f.unlink()
        by = {(a["path"], a["corpus_mb"]): a["first_step_s"] for a in results["arms"]}
        small, big = after[0], max(after)
        results["after_ratio_biggest_over_smallest"] = by[("after", big)] / by[("after", small)]
        measured = sorted(mb for mb in before)
        if len(measured) >= 2 and big not in measured:
            (x0, x1) = measured[-2:]
            y0, y1 = by[("before", x0)], by[("before", x1)]
            results["before_extrapolated"] = {
                "corpus_mb": big,
                "first_step_s": y1 + (y1 - y0) * (big - x1) / (x1 - x0),
                "from_mb": [x0, x1],
            }
            print(
                f"before {big:8g} MB: first step {results['before_extrapolated']['first_step_s']:7.1f}"
                f" s (extrapolated from {x0:g} and {x1:g} MB)"
            )
        print(
            f"after: {big:g} MB / {small:g} MB time to first step = "
            f"{results['after_ratio_biggest_over_smallest']:.2f}x"
        )
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
