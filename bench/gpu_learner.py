"""The learner on one GPU: a Llama of ~0.5-1B parameters, tokens/s, MFU and streaming overhead.

    bash bench/gpu_learner.sh                        # the whole thing, on a CUDA machine
    .venv/bin/python bench/gpu_learner.py --size 1b --batch-size 8 --seq-len 2048 --json r.json
    .venv/bin/python bench/gpu_learner.py --dry-run  # CPU, a tiny config: checks the script

1. Writes a model directory at run time (a temp dir): the shipped `hf:llama-tiny` config
   (learner/configs/llama-tiny, `ddiloco.learner.hf.SHIPPED`) with its dimensions scaled
   up (`--size`: 0.5b = 16 layers of 1536, 1b = 16 layers of 2048; or `--hidden`,
   `--layers`, `--intermediate`, `--heads`), its context set to `--seq-len`, and its
   tokenizer files beside it.
2. Runs the real learner on it: `ddiloco learner --model hf:DIR --device cuda` (bf16
   autocast, as train.py does on CUDA) against a real `ddiloco synchronizer` on the same
   machine, for `--seconds`; tokens/s from its step log, the first `--skip-s` seconds left
   out (compilation, allocator warm-up).
3. The streaming overhead: bench/wrapper_overhead.py's interleaved measurement on the same
   device, model and batch: the same loop with and without `DecoupledDiLoCo` around it
   (against another synchronizer process), the arms alternating step by step.

MFU = 6 * N * tokens/s / peak, N the parameters without the input embedding (a tied output
head counts once, in N only if untied), peak the device's dense bf16 FLOP/s from `PEAK_BF16`
by device name, or `--peak-tflops`. Attention's own FLOPs (12 * layers * seq * hidden per
token) are left out of 6N, as in the usual convention, and printed beside it. With no CUDA
device the script stops at once with a one-line message (exit 2); `--dry-run` (= `--device
cpu --tiny`) runs every step on a config of a few thousand parameters instead.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

PEAK_BF16: dict[str, float] = {
    "H200": 989e12,
    "H100 PCIe": 756e12,
    "H100 NVL": 835e12,
    "H100": 989e12,
    "H800": 989e12,
    "GH200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "A800": 312e12,
    "L40S": 362e12,
    "L4": 121e12,
    "A10G": 70e12,
    "A10": 125e12,
}
"""Dense bf16 tensor-core peak FLOP/s by a substring of `torch.cuda.get_device_name()`, the
more specific names first (vendor data sheets, without sparsity)."""

SIZES: dict[str, dict[str, int]] = {
    "0.5b": {"hidden": 1536, "layers": 16, "intermediate": 4096, "heads": 12},
    "1b": {"hidden": 2048, "layers": 16, "intermediate": 5632, "heads": 16},
    "tiny": {"hidden": 64, "layers": 2, "intermediate": 128, "heads": 2},
}


def peak_flops(name: str, override_tflops: float | None) -> float | None:
    if override_tflops:
        return override_tflops * 1e12
    return next((v for k, v in PEAK_BF16.items() if k in name), None)


def write_model_dir(
    d: Path, *, hidden: int, layers: int, intermediate: int, heads: int, seq_len: int
) -> dict[str, Any]:
    """The shipped llama-tiny config scaled to these dimensions, and its tokenizer, in `d`."""
    from ddiloco.learner import hf

    shipped = hf.SHIPPED["llama-tiny"]
    config = json.loads((shipped / "config.json").read_text())
    config.update(
        hidden_size=hidden,
        num_hidden_layers=layers,
        intermediate_size=intermediate,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=seq_len,
    )
    config.pop("head_dim", None)  # hidden // heads
    d.mkdir(parents=True, exist_ok=True)
    (d / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for f in hf.TOKENIZER_FILES:
        if (shipped / f).is_file():
            shutil.copy(shipped / f, d / f)
    return config


def count_params(model: Any) -> dict[str, int]:
    total = sum(p.numel() for p in model.parameters())
    emb = model.get_input_embeddings().weight.numel()
    return {"total": total, "non_embedding": total - emb}


def serve_and_learn(model_dir: Path, out: Path, args: argparse.Namespace) -> dict[str, Any]:
    """`ddiloco learner` on the model for `args.seconds` against a synchronizer; tokens/s."""
    from wrapper_overhead import TOKEN, start_synchronizer

    from ddiloco.local.processes import Child, ddiloco_command, env_with, terminate_all

    sync, url = start_synchronizer(out / "sync")
    log = out / "learner.jsonl"
    argv = ddiloco_command(
        "learner",
        "--sync-url",
        url,
        "--learner-id",
        "gpu0",
        "--model",
        f"hf:{model_dir}",
        "--device",
        args.device,
        "--batch-size",
        str(args.batch_size),
        "-H",
        str(args.h),
        "-P",
        str(args.fragments),
        "--threads",
        str(args.threads),
        "--max-seconds",
        str(args.seconds),
        "--log-every",
        "10",
        "--log-path",
        str(log),
    )
    learner = Child("learner", argv, env_with(DDILOCO_TOKEN=TOKEN), out / "learner.log")
    try:
        learner.start()
        assert learner.proc is not None
        code = learner.proc.wait(timeout=args.seconds + 600)
    finally:
        terminate_all([learner, sync])
    if code != 0:
        tail = learner.log_path.read_text()[-3000:]
        raise SystemExit(f"gpu_learner: `ddiloco learner` exited {code}:\n{tail}")
    records = [json.loads(x) for x in log.read_text().splitlines() if x.strip()]
    stop = next(r for r in records if r.get("event") == "stop")
    steps = [r for r in records if "dt" in r and "event" not in r]
    t_first = steps[0]["t"]
    steady = [r for r in steps if r["t"] - t_first >= args.skip_s] or steps
    per_step = stop["tokens"] // stop["steps"]
    if len(steady) > 1:
        tps = per_step * (len(steady) - 1) / (steady[-1]["t"] - steady[0]["t"])
    else:
        tps = per_step / steady[0]["dt"]
    return {
        "tokens_per_s": tps,
        "tokens_per_step": per_step,
        "steps": stop["steps"],
        "steady_steps": len(steady),
        "mean_step_s": statistics.fmean(r["dt"] for r in steady),
        "final_loss": steps[-1]["loss"],
        "stop": {k: v for k, v in stop.items() if k != "ledger"},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size", choices=sorted(SIZES), default="1b")
    ap.add_argument("--hidden", type=int)
    ap.add_argument("--layers", type=int)
    ap.add_argument("--intermediate", type=int)
    ap.add_argument("--heads", type=int)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("-H", "--h", type=int, default=24)
    ap.add_argument("-P", "--fragments", type=int, default=4)
    ap.add_argument("--seconds", type=float, default=120.0, help="the CLI learner's run")
    ap.add_argument("--skip-s", type=float, default=20.0, help="warm-up left out of tokens/s")
    ap.add_argument("--rounds", type=int, default=8, help="overhead: spans of H steps per arm")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--threads", type=int, default=4, help="torch CPU threads")
    ap.add_argument("--peak-tflops", type=float, help="the device's dense bf16 peak, TFLOP/s")
    ap.add_argument("--tiny", action="store_true", help="a tiny config (for a CPU check)")
    ap.add_argument("--dry-run", action="store_true", help="= --device cpu --tiny, short")
    ap.add_argument("--skip-learner", action="store_true", help="only the overhead part")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    if args.dry_run:
        args.device, args.tiny = "cpu", True
        args.seq_len, args.batch_size, args.h, args.fragments = 64, 4, 8, 2
        args.seconds, args.skip_s, args.rounds, args.threads = 8.0, 2.0, 2, 1
    import torch

    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        print(
            "gpu_learner: no CUDA device here (torch.cuda.is_available() is False, torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}); "
            "`--dry-run` checks the script on CPU",
            file=sys.stderr,
        )
        raise SystemExit(2)
    from wrapper_overhead import report, run

    from ddiloco.learner.task import build_task

    torch.set_num_threads(args.threads)
    dims = dict(SIZES["tiny" if args.tiny else args.size])
    for k in dims:
        if getattr(args, k) is not None:
            dims[k] = getattr(args, k)
    out = args.out or Path(tempfile.mkdtemp(prefix="gpu-learner-"))
    model_dir = out / "model"
    config = write_model_dir(model_dir, seq_len=args.seq_len, **dims)
    name = torch.cuda.get_device_name() if cuda else "cpu"
    peak = peak_flops(name, args.peak_tflops)
    t0 = time.monotonic()

    def make_task() -> Any:
        return build_task(
            preset=f"hf:{model_dir}", batch_size=args.batch_size, seed=0, device=args.device
        )

    probe = make_task()
    n = count_params(probe.model)
    seq = probe.tokens_per_batch // args.batch_size
    del probe
    flops_per_token = 6 * n["non_embedding"]
    attn_per_token = 12 * dims["layers"] * seq * dims["hidden"]
    print(
        f"device {name}; model {dims} seq {seq}: {n['total'] / 1e6:.1f} M parameters "
        f"({n['non_embedding'] / 1e6:.1f} M without the input embedding); batch "
        f"{args.batch_size} x {seq} = {args.batch_size * seq} tokens per step; peak "
        f"{'unknown (give --peak-tflops)' if peak is None else f'{peak / 1e12:.0f} TFLOP/s'}",
        flush=True,
    )

    def mfu(tps: float) -> float | None:
        return flops_per_token * tps / peak if peak else None

    result: dict[str, Any] = {
        "device": name,
        "model": dims | {"seq_len": seq, "vocab_size": config.get("vocab_size")},
        "params": n,
        "batch_size": args.batch_size,
        "peak_flops": peak,
        "flops_per_token_6n": flops_per_token,
        "attention_flops_per_token": attn_per_token,
    }
    if not args.skip_learner:
        cli = serve_and_learn(model_dir, out, args)
        cli["mfu"] = mfu(cli["tokens_per_s"])
        result["learner"] = cli
        shown = "n/a" if cli["mfu"] is None else f"{100 * cli['mfu']:.1f}%"
        print(
            f"ddiloco learner: {cli['tokens_per_s']:,.0f} tokens/s over {cli['steady_steps']} "
            f"steady steps ({cli['mean_step_s'] * 1e3:.1f} ms/step), MFU {shown}, "
            f"final loss {cli['final_loss']}",
            flush=True,
        )
    autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if cuda else None
    over = run(
        make_task,
        h=args.h,
        fragments=args.fragments,
        rounds=args.rounds,
        out=out / "overhead",
        autocast=autocast,
    )
    over["plain_mfu"] = mfu(over["plain_tokens_per_s"])
    over["wrapped_mfu"] = mfu(over["wrapped_tokens_per_s"])
    result["overhead"] = over
    report(over)
    if peak and over["wrapped_mfu"] is not None:
        with_attn = (flops_per_token + attn_per_token) / flops_per_token * over["wrapped_mfu"]
        print(
            f"MFU (6N): plain {100 * over['plain_mfu']:.1f}%, wrapped "
            f"{100 * over['wrapped_mfu']:.1f}%; counting attention FLOPs too, "
            f"{100 * with_attn:.1f}% wrapped"
        )
    result["wall_s"] = time.monotonic() - t0
    print(f"wall {result['wall_s']:.0f} s; files in {out}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2, default=str))


if __name__ == "__main__":
    main()
