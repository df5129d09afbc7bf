"""Update encodings study: eval loss at equal tokens and bytes on the wire per token
for bfloat16, int8 and int4 updates, paired by seed, next to data-parallel's; and the block
size of the quantized encodings, measured on real deltas.

    .venv/bin/python bench/encoding_study.py --blocks                   # block size, ~30 s
    .venv/bin/python bench/encoding_study.py --seeds 3                   # the study, ~10 min, 2 cores
    .venv/bin/python bench/encoding_study.py --downloads --seeds 3       # downloads, ~20 min

`--blocks`: the tiny model trains H = 24 AdamW steps (the learners' optimizer and lr) from its
initial weights, three times in a row; each window's delta (what one hand-over of the whole
model would send) is quantized with blocks of 32..512 values, giving the relative error
||dequant(q(d)) - d|| / ||d|| and the bytes per value (codes and float32 scales).

The study: for each seed, one `ddiloco local` run per encoding (2 learners, K = M by default,
the same seed, data and step budget `--max-steps`, so the same tokens: "equal tokens" by
construction; the final eval loss is the global model's after the last merges), and one
data-parallel run of the same learners and batch (local/dp_run.py, a wall-clock budget: its
eval loss is interpolated at the DiLoCo runs' token count, its bytes are what its ring
all-reduce moves per rank and step, as local/dp.py counts them). Printed as a table, with
the paired difference of each encoding's eval loss from bfloat16's (mean and worst over
seeds); `--json PATH` writes every run's figures. Bytes up are learner -> synchronizer
updates (what the encoding changes); down is the synchronizer's broadcasts (float32 here,
`broadcast_encoding`), the same for every encoding.

`--downloads`: the same runs for pairs of update and broadcast encodings (`DOWNLOAD_ARMS`:
wire/broadcast.py's float32, bfloat16, int8, int8-delta, int4-delta downloads, with
bfloat16 and int4 uploads; `--arms` picks some), paired by seed against the first arm
(bfloat16 up / float32 down unless `--arms` says otherwise), with the bytes
per token up, down and in all against data-parallel's (one run: its bytes do not depend on
the seed). Down is what the learners downloaded (their final stats); the synchronizer's count,
which adds the run's evaluator reading the whole model every `--eval-every` seconds, is
given beside it.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

ENCODINGS = ("bfloat16", "int8", "int4")


def block_study(blocks: list[int], windows: int = 3, h: int = 24) -> list[dict[str, Any]]:
    import torch

    from ddiloco.learner.task import build_task
    from ddiloco.wire.quant import dequantize, quantize

    torch.manual_seed(0)
    torch.set_num_threads(2)
    task = build_task(preset="tiny", batch_size=8, seed=0)
    model = task.model
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
    deltas = []
    for _ in range(windows):
        before = {k: v.detach().clone() for k, v in model.named_parameters()}
        for _ in range(h):
            x, y = next(task.batches)
            task.loss_fn(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        deltas.append({k: v.detach() - before[k] for k, v in model.named_parameters()})
    rows = []
    for encoding in ("int8", "int4"):
        for block in blocks:
            errs, nbytes, n = [], 0, 0
            for d in deltas:
                sq_err = sq = 0.0
                for t in d.values():
                    q = quantize(t, encoding, block)  # type: ignore[arg-type]
                    sq_err += float((dequantize(q) - t).pow(2).sum())
                    sq += float(t.pow(2).sum())
                    nbytes += q.nbytes
                    n += t.numel()
                errs.append((sq_err / sq) ** 0.5)
            rows.append(
                {
                    "encoding": encoding,
                    "block": block,
                    "rel_error": statistics.fmean(errs),
                    "bytes_per_value": nbytes / n,
                }
            )
    return rows


def controlled(
    seed: int,
    encoding: str,
    *,
    learners: int,
    rounds: int,
    h: int,
    block: int = 128,
    download: str = "float32",
) -> dict[str, Any]:
    """Timing taken out: M learners in one process, synchronous rounds of H AdamW steps, each
    hand-over through the real `encodings.encode_update` -> bytes -> `encodings.decode_update`, the
    anchor moved by what was decoded (error feedback), the global model moved by the mean of
    the decoded deltas (eta 1, mu 0: `ddiloco local`'s outer step), every learner rebased on
    it (its residual kept). The global model's eval loss after `rounds` rounds.
    `download`: the learners rebase on the copy the synchronizer serves in that broadcast
    encoding (wire/broadcast.py, encoded and read back through the real code: for a
    delta encoding the copy S the deltas build, version 0 named by its content), not on the
    global model itself; its bytes are what each learner downloads after each round."""
    import torch

    from ddiloco.learner.task import build_task
    from ddiloco.synchronizer import served_versions, update_passes
    from ddiloco.synchronizer.served_buffers import Served
    from ddiloco.wire import broadcast, codec, encodings
    from ddiloco.wire.protocol import FragmentSpec, TensorSpec, UpdateMeta

    torch.set_num_threads(2)
    tasks = [
        build_task(preset="tiny", batch_size=8, seed=seed, learner_index=i, num_learners=learners)
        for i in range(learners)
    ]
    opts = [
        torch.optim.AdamW(t.model.parameters(), lr=3e-3, weight_decay=0.1, betas=(0.9, 0.95))
        for t in tasks
    ]
    names = [k for k, _ in tasks[0].model.named_parameters()]
    spec = FragmentSpec(
        index=0,
        tensors=[
            TensorSpec(name=k, shape=list(v.shape)) for k, v in tasks[0].model.named_parameters()
        ],
    )
    theta = {k: v.detach().clone() for k, v in tasks[0].model.named_parameters()}
    anchors = [{k: v.clone() for k, v in theta.items()} for _ in tasks]
    nbytes = down = 0
    payloads = Served(broadcast.whole_dtype(download), 1, kinds=2)
    served = served_versions.encode(payloads, download, 0, 0, theta)
    held = (
        broadcast.Held(broadcast.initial_token(theta), {k: v.clone() for k, v in theta.items()})
        if download in broadcast.DELTAS
        else None
    )
    for r in range(rounds):
        received = []
        for m, (task, opt) in enumerate(zip(tasks, opts, strict=True)):
            for step in range(h):
                for g in opt.param_groups:  # ddiloco's warm-up: linear over 20 steps
                    g["lr"] = 3e-3 * min(1.0, (r * h + step + 1) / 20)
                x, y = next(task.batches)
                task.loss_fn(task.model, x, y).backward()
                torch.nn.utils.clip_grad_norm_(task.model.parameters(), 1.0)
                opt.step()
                opt.zero_grad(set_to_none=True)
            params = dict(task.model.named_parameters())
            delta = {k: params[k].detach() - anchors[m][k] for k in names}
            meta = UpdateMeta(
                learner_id=f"l{m}", fragment=0, base_version=r, steps=h, tokens=1, learner_step=h
            )
            payload, _ = encodings.encode_update(delta, meta, encoding, block)
            nbytes += len(payload)
            header = codec.read_header(payload, codes=True)
            got = {  # float32 of what the synchronizer reads (a bf16 update stays bf16 there)
                k: update_passes.dense(v)
                for k, v in encodings.decode_update(payload, header, spec, encodings.ALL).items()
            }
            for k in names:
                anchors[m][k] += got[k]
            received.append(got)
        with torch.no_grad():
            for k in names:
                theta[k] += sum(d[k] for d in received) / len(received)
            served = served_versions.encode(payloads, download, 0, r + 1, theta, prev=served)
            body, _ = served.body(held.token if held is not None else None)
            down += learners * len(body)
            got = broadcast.read(bytes(body), held)
            held = broadcast.Held(got.token, got.tensors) if got.token is not None else None
            copy = {k: v.float() for k, v in got.tensors.items()}
            for m, task in enumerate(tasks):  # rebase: keep what this learner did not send
                for k, p in task.model.named_parameters():
                    p.add_(copy[k] - anchors[m][k])
                    anchors[m][k] = copy[k].clone()
    model = tasks[0].model
    with torch.no_grad():
        saved = {k: p.detach().clone() for k, p in model.named_parameters()}
        for k, p in model.named_parameters():
            p.copy_(theta[k])
        loss = float(tasks[0].eval_loss(model))
        for k, p in model.named_parameters():
            p.copy_(saved[k])
    tokens = learners * rounds * h * tasks[0].tokens_per_batch
    return {
        "method": f"controlled_{encoding}",
        "up": encoding,
        "down": download,
        "seed": seed,
        "tokens": tokens,
        "eval_loss": loss,
        "bytes_up_per_token": nbytes / tokens,
        "bytes_down_per_token": down / tokens,
        "learner_bytes_down_per_token": down / tokens,
        "global_version": rounds,
    }


def run_diloco(
    seed: int, encoding: str, args: argparse.Namespace, out: Path, download: str = "float32"
) -> dict[str, Any]:
    from ddiloco.local.launcher import LocalConfig, LocalRun

    cfg = LocalConfig(
        learners=args.learners,
        quorum=args.quorum or args.learners,
        seed=seed,
        max_steps=args.max_steps,
        update_encoding=encoding,
        broadcast_encoding=download,
        hot_spares=0,
        eval_every=args.eval_every,
        out=out,
    )
    report = LocalRun(cfg).run()
    tokens = int(report["tokens_computed"])
    return {
        "method": f"diloco_{encoding}",
        "up": encoding,
        "down": download,
        "seed": seed,
        "tokens": tokens,
        "eval_loss": float(report["eval_loss_final"]),
        "bytes_up_per_token": report["bytes_up"] / tokens,
        "bytes_down_per_token": report["bytes_down"] / tokens,
        "learner_bytes_down_per_token": learners_down(out) / tokens,
        "tokens_merged": int(report["tokens_merged"]),
        "global_version": report["global_version"],
        "wall_seconds": report["wall_seconds"],
    }


def learners_down(out: Path) -> int:
    """Bytes the learners downloaded (each one's final stats, learner/diloco.py): the
    synchronizer's own count adds the run's evaluator, which reads the whole model."""
    total = 0
    for path in sorted((out / "learners").glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if '"stop"' in line:
                event = json.loads(line)
                if event.get("event") == "stop":
                    total += int(event.get("bytes_down", 0))
    return total


def at_tokens(history: list[tuple[Any, ...]], tokens: int) -> float | None:
    """A data-parallel eval curve [(t, loss, step, tokens)] interpolated at `tokens`."""
    points = sorted((int(tok), float(loss)) for _, loss, _, tok in history)
    for (t0, l0), (t1, l1) in itertools.pairwise(points):
        if t0 <= tokens <= t1:
            return l0 if t1 == t0 else l0 + (l1 - l0) * (tokens - t0) / (t1 - t0)
    return None


def run_dp(seed: int, tokens: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from ddiloco.local.dp_run import DPConfig, DPRun

    cfg = DPConfig(
        learners=args.learners,
        seed=seed,
        max_seconds=args.dp_seconds,
        eval_every=args.eval_every,
        out=out,
    )
    report = DPRun(cfg).run()
    done = int(report["tokens_computed"])
    return {
        "method": "data_parallel",
        "seed": seed,
        "tokens": done,
        "eval_loss": at_tokens(report["eval_history"], tokens),
        "bytes_up_per_token": report["bytes_up"] / done if done else 0.0,
        "bytes_down_per_token": 0.0,
        "wall_seconds": report["wall_seconds"],
    }


def table(rows: list[dict[str, Any]], prefix: str = "diloco_") -> str:
    methods = [f"{prefix}{e}" for e in ENCODINGS] + ["data_parallel"]
    base = {r["seed"]: r["eval_loss"] for r in rows if r["method"] == f"{prefix}bfloat16"}
    lines = [
        "| method | seeds | eval loss at equal tokens (mean) | vs bfloat16, paired (mean / worst) "
        "| bytes up / token | bytes down / token | merges (mean) |",
        "|---|---|---|---|---|---|---|",
    ]
    for m in methods:
        mine = [r for r in rows if r["method"] == m]
        if not mine:
            continue
        losses = [r["eval_loss"] for r in mine if r["eval_loss"] is not None]
        diffs = [
            r["eval_loss"] / base[r["seed"]] - 1
            for r in mine
            if r["eval_loss"] is not None and r["seed"] in base
        ]
        paired = (
            f"{100 * statistics.fmean(diffs):+.2f}% / {100 * max(diffs, key=abs):+.2f}%"
            if diffs and m != f"{prefix}bfloat16"
            else "-"
        )
        loss = f"{statistics.fmean(losses):.4f}" if losses else "n/a (tokens not reached)"
        up = statistics.fmean(r["bytes_up_per_token"] for r in mine)
        down = statistics.fmean(r["bytes_down_per_token"] for r in mine)
        merges = [r["global_version"] for r in mine if "global_version" in r]
        versions = f"{statistics.fmean(merges):.1f}" if merges else "-"
        lines.append(
            f"| {m} | {len(mine)} | {loss} | {paired} | {up:.1f} | {down:.1f} | {versions} |"
        )
    return "\n".join(lines)


DOWNLOAD_ARMS = (
    ("bfloat16", "float32"),
    ("bfloat16", "bfloat16"),
    ("bfloat16", "int8-delta"),
    ("int4", "float32"),
    ("int4", "bfloat16"),
    ("int4", "int8"),
    ("int4", "int8-delta"),
    ("int4", "int4-delta"),
)
"""--downloads: (update encoding, broadcast encoding) per arm; the first is the baseline."""


def download_arms(spec: str | None) -> tuple[tuple[str, str], ...]:
    """--arms "up/down,up/down": the chosen arms in the given order (the first is the
    baseline the others are paired against); all of `DOWNLOAD_ARMS` when not given."""
    if not spec:
        return DOWNLOAD_ARMS
    arms = []
    for item in spec.split(","):
        up, sep, down = item.strip().partition("/")
        if not sep or (up, down) not in DOWNLOAD_ARMS:
            known = ", ".join(f"{u}/{d}" for u, d in DOWNLOAD_ARMS)
            raise SystemExit(f"--arms: unknown arm {item!r} (known: {known})")
        arms.append((up, down))
    return tuple(arms)


def downloads_table(rows: list[dict[str, Any]]) -> str:
    """--downloads: each arm's eval loss, paired by seed against the first arm's, and its
    bytes per token up, down and in all, against data-parallel's."""
    arms = [r for r in rows if r["method"] != "data_parallel"]
    dp = [r["bytes_up_per_token"] for r in rows if r["method"] == "data_parallel"]
    dp_bytes = statistics.fmean(dp) if dp else 0.0
    first = (arms[0]["up"], arms[0]["down"]) if arms else None
    base = {r["seed"]: r["eval_loss"] for r in arms if (r["up"], r["down"]) == first}
    lines = [
        f"| up | down | seeds | eval loss (mean) | vs {first[0] if first else '-'} up / "
        f"{first[1] if first else '-'} down, paired (mean / worst) | bytes up / token | "
        "bytes down / token (learners) | up + down | data-parallel / (up + down) | "
        "down / token with the evaluator's | merges (mean) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    seen: list[tuple[str, str]] = []
    for r in arms:
        if (r["up"], r["down"]) not in seen:
            seen.append((r["up"], r["down"]))
    for up, down in seen:
        mine = [r for r in arms if (r["up"], r["down"]) == (up, down)]
        diffs = [r["eval_loss"] / base[r["seed"]] - 1 for r in mine if r["seed"] in base]
        paired = (
            f"{100 * statistics.fmean(diffs):+.2f}% / {100 * max(diffs, key=abs):+.2f}%"
            if diffs and (up, down) != first
            else "-"
        )
        b_up = statistics.fmean(r["bytes_up_per_token"] for r in mine)
        b_down = statistics.fmean(r["learner_bytes_down_per_token"] for r in mine)
        b_all = statistics.fmean(r["bytes_down_per_token"] for r in mine)
        ratio = f"{dp_bytes / (b_up + b_down):.1f}x" if dp_bytes else "-"
        loss = statistics.fmean(r["eval_loss"] for r in mine)
        merges = statistics.fmean(r["global_version"] for r in mine)
        lines.append(
            f"| {up} | {down} | {len(mine)} | {loss:.4f} | {paired} | {b_up:.1f} | "
            f"{b_down:.1f} | {b_up + b_down:.1f} | {ratio} | {b_all:.1f} | {merges:.1f} |"
        )
    if dp_bytes:
        lines.append(f"\ndata-parallel: {dp_bytes:.1f} bytes per token ({len(dp)} run(s))")
    return "\n".join(lines)


def downloads(args: argparse.Namespace) -> None:
    """--downloads: one `ddiloco local` run per arm and seed (equal tokens), and one
    data-parallel run of seed 0 for its bytes per token (what its all-reduce moves does
    not depend on the seed)."""
    out = args.out or Path(tempfile.mkdtemp(prefix="downloads-"))
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for seed in range(args.seeds):
        for up, down in download_arms(args.arms):
            r = run_diloco(seed, up, args, out / f"s{seed}-{up}-{down}", download=down)
            rows.append(r)
            print(json.dumps(r), flush=True)
        if not args.no_dp and seed == 0:
            r = run_dp(seed, rows[-1]["tokens"], args, out / f"s{seed}-dp")
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(downloads_table(rows))
    print(f"({time.time() - t0:.0f} s, runs under {out})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", action="store_true", help="the block size study only")
    ap.add_argument(
        "--controlled",
        action="store_true",
        help="in one process, synchronous rounds: the encoding's effect without timing noise",
    )
    ap.add_argument("--rounds", type=int, default=8, help="--controlled: outer rounds")
    ap.add_argument("-H", "--h", type=int, default=12, help="--controlled: inner steps a round")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--max-steps", type=int, default=144, help="inner steps per learner")
    ap.add_argument(
        "--quorum",
        type=int,
        default=0,
        help="K (default M: every round merges every learner, so the runs of a seed merge the "
        "same work; K = 1 lets timing decide how many merges land, which swamps the encoding)",
    )
    ap.add_argument("--dp-seconds", type=float, default=45.0, help="data-parallel wall budget")
    ap.add_argument("--no-dp", action="store_true", help="skip the data-parallel runs")
    ap.add_argument("--eval-every", type=float, default=5.0)
    ap.add_argument("--out", type=Path, help="run directories (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write every run's figures here")
    ap.add_argument(
        "--downloads",
        action="store_true",
        help="broadcast encodings: float32 / bfloat16 / int8 / int8-delta / int4-delta downloads "
        "with bf16 and int4 uploads, and data-parallel's bytes",
    )
    ap.add_argument(
        "--arms",
        help='--downloads: the arms to run, "up/down" comma-separated (e.g. '
        '"bfloat16/float32,bfloat16/bfloat16"; the first is the baseline); default: all',
    )
    args = ap.parse_args()
    if args.downloads and args.controlled:
        rows = []
        for seed in range(args.seeds):
            for up, down in download_arms(args.arms):
                r = controlled(
                    seed, up, learners=args.learners, rounds=args.rounds, h=args.h, download=down
                )
                rows.append(r)
                print(json.dumps(r), flush=True)
        print(downloads_table(rows))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    if args.downloads:
        downloads(args)
        return
    if args.controlled:
        rows = []
        for seed in range(args.seeds):
            for encoding in ENCODINGS:
                r = controlled(seed, encoding, learners=args.learners, rounds=args.rounds, h=args.h)
                rows.append(r)
                print(json.dumps(r), flush=True)
        print(table(rows, prefix="controlled_"))
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    if args.blocks:
        rows = block_study([32, 64, 128, 256, 512])
        print("| encoding | block | relative error | bytes per value |")
        print("|---|---|---|---|")
        for r in rows:
            print(
                f"| {r['encoding']} | {r['block']} | {r['rel_error']:.4f} | "
                f"{r['bytes_per_value']:.4f} |"
            )
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
        return
    out = args.out or Path(tempfile.mkdtemp(prefix="encodings-"))
    rows: list[dict[str, Any]] = []
    t0 = time.time()
    for seed in range(args.seeds):
        for encoding in ENCODINGS:
            r = run_diloco(seed, encoding, args, out / f"s{seed}-{encoding}")
            rows.append(r)
            print(json.dumps(r), flush=True)
        if not args.no_dp:
            tokens = rows[-1]["tokens"]
            r = run_dp(seed, tokens, args, out / f"s{seed}-dp")
            rows.append(r)
            print(json.dumps(r), flush=True)
    print(table(rows))
    print(f"({time.time() - t0:.0f} s, runs under {out})")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
