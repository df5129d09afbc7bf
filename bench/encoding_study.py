"""Update encodings study: eval loss at equal tokens and bytes on the wire per token
for bfloat16, int8 and int4 updates, paired by seed, next to data-parallel's; and the block
size of the quantized encodings, measured on real deltas.

    .venv/bin/python bench/encoding_study.py --blocks                   # block size, ~30 s
    .venv/bin/python bench/encoding_study.py --seeds 3                   # the study, ~10 min, 2 cores

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
`broadcast_dtype`), the same for every encoding.
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
    from ddiloco.synchronizer.quant import dequantize, quantize

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
    seed: int, encoding: str, *, learners: int, rounds: int, h: int, block: int = 128
) -> dict[str, Any]:
    """Timing taken out: M learners in one process, synchronous rounds of H AdamW steps, each
    hand-over through the real `wire.encode_update` -> bytes -> `wire.decode_update`, the
    anchor moved by what was decoded (error feedback), the global model moved by the mean of
    the decoded deltas (eta 1, mu 0: `ddiloco local`'s outer step), every learner rebased on
    it (its residual kept). The global model's eval loss after `rounds` rounds."""
    import torch

    from ddiloco.learner.task import build_task
    from ddiloco.synchronizer import codec, passes, wire
    from ddiloco.synchronizer.protocol import FragmentSpec, TensorSpec, UpdateMeta

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
    nbytes = 0
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
            payload, _ = wire.encode_update(delta, meta, encoding, block)
            nbytes += len(payload)
            header = codec.read_header(payload, codes=True)
            got = {  # float32 of what the synchronizer reads (a bf16 update stays bf16 there)
                k: passes.dense(v)
                for k, v in wire.decode_update(payload, header, spec, wire.ALL).items()
            }
            for k in names:
                anchors[m][k] += got[k]
            received.append(got)
        with torch.no_grad():
            for k in names:
                theta[k] += sum(d[k] for d in received) / len(received)
            for m, task in enumerate(tasks):  # rebase: keep what this learner did not send
                for k, p in task.model.named_parameters():
                    p.add_(theta[k] - anchors[m][k])
                    anchors[m][k] = theta[k].clone()
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
        "seed": seed,
        "tokens": tokens,
        "eval_loss": loss,
        "bytes_up_per_token": nbytes / tokens,
        "bytes_down_per_token": 0.0,
    }


def run_diloco(seed: int, encoding: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    from ddiloco.local.launcher import LocalConfig, LocalRun

    cfg = LocalConfig(
        learners=args.learners,
        quorum=args.quorum or args.learners,
        seed=seed,
        max_steps=args.max_steps,
        update_encoding=encoding,
        warm_spares=0,
        eval_every=args.eval_every,
        out=out,
    )
    report = LocalRun(cfg).run()
    tokens = int(report["tokens_computed"])
    return {
        "method": f"diloco_{encoding}",
        "seed": seed,
        "tokens": tokens,
        "eval_loss": float(report["eval_loss_final"]),
        "bytes_up_per_token": report["bytes_up"] / tokens,
        "bytes_down_per_token": report["bytes_down"] / tokens,
        "tokens_merged": int(report["tokens_merged"]),
        "global_version": report["global_version"],
        "wall_seconds": report["wall_seconds"],
    }


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
    args = ap.parse_args()
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
