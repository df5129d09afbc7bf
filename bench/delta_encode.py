"""How long the synchronizer takes to encode one merge of a fragment in a delta download
encoding (`served_versions.encode(..., "int8-delta", prev=...)`: the delta Q(Theta_v - S_{v-1})
and S_v whole), the committed code and this tree's side by side.

    .venv/bin/python bench/delta_encode.py                          # this tree only
    git worktree add -f /tmp/old HEAD                               # the committed code
    mkdir -p /tmp/oldpkg/ddiloco && touch /tmp/oldpkg/ddiloco/__init__.py
    for c in synchronizer wire learner local operator cli simulator; do
        ln -s /tmp/old/$c /tmp/oldpkg/ddiloco/$c; done
    .venv/bin/python bench/delta_encode.py --old /tmp/oldpkg --runs 9 --encoding int8-delta,int4-delta

Each arm is a process of its own (`--old PATH`: a folder holding a `ddiloco` package, put
first on its PYTHONPATH), a fresh one per size and encoding, that keeps the fragment as the
synchronizer does: Theta (float32, a fragment's mix of tensors: 4M-value matrices, a vector,
one whose size is no multiple of the block), the version served before, and its `Served`
buffers, retired once superseded. Each run encodes the next version (Theta moving by a
small step) from the last; the arms' runs are interleaved (new, old, old, new, ...) so a
shared machine's load falls on both alike. Torch threads and the merge's pieces are the
synchronizer's defaults for this machine (`TuningSettings`), or `--torch-threads` / `--ways`.

It prints, per size and encoding: the median (and min) wall seconds of a whole encode and
its process CPU seconds per arm, old / new, the peak resident memory each arm grew by over
its encodes (above Theta, S_0 and its buffer), and the stages of the committed code's
arithmetic timed one by one, in the old arm (this tree's without one): subtract, quantize,
apply_delta, isfinite, encode_codes, the whole's encode. Before timing, both arms encode
the same version from the same Theta and must serve the same bytes (each payload's SHA-256
is compared).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

BIG = 1 << 22


def shapes(params: int) -> dict[str, tuple[int, ...]]:
    """A fragment of about `params` values: 2048-wide matrices of up to 4M values, a
    vector, and a tensor whose size is no multiple of any block."""
    out: dict[str, tuple[int, ...]] = {"norm.weight": (2048,), "odd.bias": (1001,)}
    left, i = params - 2048 - 1001, 0
    while left > 0:
        rows = min(BIG, left) // 2048 or 1
        out[f"layer{i}.weight"] = (rows, 2048)
        left -= rows * 2048
        i += 1
    return out


class Fragment:
    """One size's fragment inside a worker: Theta, the served version, its buffers."""

    def __init__(self, params: int, encoding: str, ways: int) -> None:
        import torch

        from ddiloco.synchronizer import served_versions
        from ddiloco.synchronizer.served_buffers import Served

        self.encoding = encoding
        g = torch.Generator().manual_seed(params)
        self.theta = {k: torch.randn(s, generator=g) for k, s in shapes(params).items()}
        self.step = {k: torch.randn(s, generator=g) * 1e-3 for k, s in shapes(params).items()}
        self.served = Served("float32", fragments=1, ways=ways, kinds=2)
        self.version = 0
        self.prev = served_versions.encode(self.served, encoding, 0, 0, self.theta)

    def next_theta(self) -> dict[str, Any]:
        """Theta_v: one step from Theta_{v-1}, the step's sign alternating (bounded)."""
        sign = 1.0 if self.version % 2 == 0 else -1.0
        return {k: v.add(self.step[k], alpha=sign) for k, v in self.theta.items()}

    def encode(self) -> tuple[float, float, list[str]]:
        """One merge's encode: (wall s, process CPU s, the payloads' SHA-256)."""
        from ddiloco.synchronizer import served_versions

        theta = self.next_theta()
        self.version += 1
        t0, c0 = time.perf_counter(), time.process_time()
        b = served_versions.encode(
            self.served, self.encoding, 0, self.version, theta, prev=self.prev
        )
        wall, cpu = time.perf_counter() - t0, time.process_time() - c0
        digests = [hashlib.sha256(v).hexdigest()[:16] for v in b.views()]
        for view in self.prev.views():  # what installing the new version does
            self.served.retire(0, view)
        self.prev, self.theta = b, theta
        return wall, cpu, digests

    def stages(self) -> dict[str, float]:
        """The committed code's arithmetic, each stage timed alone (seconds)."""
        import torch

        from ddiloco.wire import broadcast, quant
        from ddiloco.wire.broadcast import DELTAS

        q_encoding = DELTAS[self.encoding]
        held = self.prev.held
        assert held is not None
        theta = self.next_theta()
        t: dict[str, float] = {}

        def clock(name: str, fn: Any) -> Any:
            t0 = time.perf_counter()
            out = fn()
            t[name] = time.perf_counter() - t0
            return out

        diffs = clock("subtract", lambda: {k: theta[k] - held[k] for k in sorted(theta)})
        deltas = clock(
            "quantize", lambda: {k: quant.quantize(d, q_encoding) for k, d in diffs.items()}
        )
        new = clock(
            "apply_delta",
            lambda: {
                k: broadcast.apply_delta(held[k], q, torch.empty_like(held[k]))
                for k, q in deltas.items()
            },
        )
        clock("isfinite", lambda: all(bool(torch.isfinite(v).all()) for v in new.values()))
        meta = broadcast.quantized_meta(q_encoding, self.encoding, quant.DEFAULT_BLOCK, theta)
        for view in [
            clock("encode_codes", lambda: self.served.encode_codes(0, deltas, meta)),
            clock("encode_whole", lambda: self.served.encode(0, new)),
        ]:
            self.served.retire(0, view)
        return t


def worker(args: argparse.Namespace) -> None:
    """Answer the driver's commands, a line each: `encode SIZE ENC`, `stages SIZE ENC`,
    `rss` (peak resident KiB so far)."""
    import torch

    from ddiloco.synchronizer.config import TuningSettings

    tuning = TuningSettings()
    torch.set_num_threads(args.torch_threads or tuning.op_threads())
    ways = args.ways or tuning.merge_ways()
    frags: dict[tuple[int, str], Fragment] = {}
    from ddiloco.synchronizer import served_versions

    where = os.path.dirname(os.path.dirname(os.path.realpath(served_versions.__file__)))
    print(json.dumps({"ways": ways, "threads": torch.get_num_threads(), "code": where}))
    sys.stdout.flush()
    for line in sys.stdin:
        cmd, *rest = line.split()
        if cmd == "rss":
            out: Any = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        elif cmd == "setup":
            key = (int(rest[0]), rest[1])
            frags[key] = Fragment(key[0], key[1], ways)
            out = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        elif cmd == "encode":
            out = frags[(int(rest[0]), rest[1])].encode()
        else:
            out = frags[(int(rest[0]), rest[1])].stages()
        print(json.dumps(out))
        sys.stdout.flush()


class Arm:
    def __init__(self, name: str, pythonpath: str | None, args: argparse.Namespace) -> None:
        env = dict(os.environ)
        if pythonpath:
            env["PYTHONPATH"] = pythonpath + os.pathsep + env.get("PYTHONPATH", "")
        cmd = [sys.executable, os.path.abspath(__file__), "--worker"]
        cmd += ["--ways", str(args.ways), "--torch-threads", str(args.torch_threads)]
        self.name = name
        self.proc = subprocess.Popen(
            cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
        )
        self.hello = self.ask(None)

    def ask(self, line: str | None) -> Any:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        if line is not None:
            self.proc.stdin.write(line + "\n")
            self.proc.stdin.flush()
        answer = self.proc.stdout.readline()
        if not answer:
            raise SystemExit(f"arm {self.name} exited ({self.proc.wait()})")
        return json.loads(answer)

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--params", default="16e6,4e6", help="fragment sizes (comma-separated)")
    ap.add_argument("--encoding", default="int8-delta", help="int8-delta, int4-delta (comma)")
    ap.add_argument("--runs", type=int, default=7, help="timed encodes per arm and size")
    ap.add_argument("--old", default="", help="a folder holding the committed ddiloco package")
    ap.add_argument("--ways", type=int, default=0, help="merge pieces (0: the default)")
    ap.add_argument("--torch-threads", type=int, default=0, help="0: the default")
    ap.add_argument("--no-stages", action="store_true", help="skip the stage breakdown")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        worker(args)
        return
    sizes = [int(float(s)) for s in args.params.split(",")]
    encs = args.encoding.split(",")
    print(f"load {os.getloadavg()}")
    for size in sizes:
        for enc in encs:
            key = f"{size} {enc}"
            arms = [Arm("new", None, args)]  # fresh processes: each one's peak is this case's
            if args.old:
                arms.append(Arm("old", args.old, args))
            if size == sizes[0] and enc == encs[0]:
                print(f"arms {[(a.name, a.hello) for a in arms]}")
            base = {a.name: a.ask(f"setup {key}") for a in arms}
            same = {a.name: a.ask(f"encode {key}")[2] for a in arms}  # also a warm-up
            if len({json.dumps(d) for d in same.values()}) != 1:
                raise SystemExit(f"{key}: the arms served different bytes: {same}")
            walls: dict[str, list[float]] = {a.name: [] for a in arms}
            cpus: dict[str, list[float]] = {a.name: [] for a in arms}
            for r in range(args.runs):
                for a in arms if r % 2 == 0 else arms[::-1]:
                    wall, cpu, _ = a.ask(f"encode {key}")
                    walls[a.name].append(wall)
                    cpus[a.name].append(cpu)
            grew = {a.name: (a.ask("rss") - base[a.name]) / 1024 for a in arms}
            print(f"\n{size / 1e6:g}M params, {enc}, {args.runs} runs, same bytes: yes")
            for a in arms:
                w, c = walls[a.name], cpus[a.name]
                print(
                    f"  {a.name}: encode median {statistics.median(w):.3f} s (min {min(w):.3f}),"
                    f" CPU {statistics.median(c):.3f} s, peak RSS +{grew[a.name]:.0f} MB"
                )
            if args.old:
                ratio = statistics.median(walls["old"]) / statistics.median(walls["new"])
                print(f"  old / new: {ratio:.1f}x wall")
            if not args.no_stages:  # in the last arm: the committed code's when --old
                st = arms[-1].ask(f"stages {key}")
                print(f"  stages of the committed code's arithmetic ({arms[-1].name}): " + ", ".join(
                    f"{k} {v:.3f}" for k, v in st.items()
                ) + f"; sum {sum(st.values()):.3f} s")  # fmt: skip
            for a in arms:
                a.close()
    print(f"\nload {os.getloadavg()}")


if __name__ == "__main__":
    main()
