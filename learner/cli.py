"""`ddiloco learner`: run one learner against a synchronizer.

    DDILOCO_TOKEN=s3cret ddiloco learner --sync-url http://127.0.0.1:8470 \
        --learner-id l0 --learner-index 0 --num-learners 3 --model tiny --max-steps 1000

Every option also reads from the environment (`DDILOCO_SYNC_URL`, `DDILOCO_LEARNER_ID`,
`DDILOCO_H`, `DDILOCO_P`, ...; see config.py), which is how the operator configures pods.
The token comes only from the environment or a file, never from a flag (it would show in
`ps`); with a file (`--token-file`, DDILOCO_TOKEN_FILE) it rotates without a restart. An
https `--sync-url` is verified against `--ca-file` (DDILOCO_CA_FILE; else the system trust
store); `--client-cert` + `--client-key` (DDILOCO_CLIENT_CERT_FILE, DDILOCO_CLIENT_KEY_FILE)
add a client certificate for mutual TLS. A `DDILOCO_*` variable that nothing reads is named
in a warning at startup.
"""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import sys
from collections.abc import Mapping

from ddiloco.cli.errors import RuntimeFailure, UsageError, fail, usage_errors
from ddiloco.learner.config import LearnerConfig

PROG = "ddiloco learner"

# parse() options that are not LearnerConfig fields: main() handles them itself.
NOT_CONFIG = ("log_level", "debug_digests")


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog="ddiloco learner", description="Run one Decoupled DiLoCo learner."
    )
    # --- identity ---
    ap.add_argument("--sync-url", help="synchronizer base URL (http:// h2c, or https://)")
    ap.add_argument("--learner-id", help="stable id of this learner slot")
    ap.add_argument("--learner-index", type=int, help="index of this learner's data part")
    ap.add_argument("--num-learners", type=int, help="M, number of learner slots (data parts)")
    ap.add_argument(
        "--token-file", help="file holding the job token, re-read when it changes (else env)"
    )
    ap.add_argument("--ca-file", help="PEM CA that signed an https synchronizer's certificate")
    ap.add_argument(
        "--client-cert", dest="client_cert_file", help="PEM client certificate (mutual TLS)"
    )
    ap.add_argument("--client-key", dest="client_key_file", help="PEM key of --client-cert")
    # --- model and data ---
    ap.add_argument(
        "--model",
        help="model preset (tiny, small, base, gpt2) or hf:PATH, a local Hugging Face config "
        "or model directory (hf:llama-tiny: the one shipped)",
    )
    ap.add_argument("--model-entry", help="module:function returning a Task (your model and data)")
    ap.add_argument(
        "--init-from",
        help="start the job's model from this model directory's safetensors weights (a "
        "`ddiloco export` or a Hugging Face snapshot) instead of its seeded init",
    )
    ap.add_argument(
        "--data",
        help="text file, folder, uint16 .bin, or a prepared dataset (`ddiloco prepare`: a "
        "directory or URL such as s3://bucket/prefix) (default: Python stdlib sources)",
    )
    ap.add_argument(
        "--tokenizer", help="local tokenizer directory or tokenizer.json (default: the model's)"
    )
    ap.add_argument("--data-field", help="text column of JSONL and Parquet data (default text)")
    ap.add_argument("--batch-size", type=int, help="sequences per micro-batch, per rank")
    ap.add_argument(
        "--grad-accum", type=int, help="micro-batches per inner step (gradient accumulation)"
    )
    ap.add_argument("--seq-len", type=int, help="tokens per sequence (default: the model's)")
    ap.add_argument(
        "--precision",
        choices=["auto", "bf16", "fp32"],
        help="bf16 autocast or fp32 (default auto: bf16 on CUDA)",
    )
    ap.add_argument("--seed", type=int)
    # --- optimization and schedule ---
    ap.add_argument("--inner-lr", type=float, help="peak inner AdamW learning rate")
    ap.add_argument("--weight-decay", type=float, help="AdamW weight decay (default 0.1)")
    ap.add_argument("--warmup-steps", type=int, help="linear warm-up, in the slot's steps")
    ap.add_argument(
        "--lr-schedule",
        choices=["constant", "cosine", "wsd"],
        help="after warm-up: constant, or a cosine / WSD decay over the job's budget",
    )
    ap.add_argument("--min-lr-ratio", type=float, help="where a decay ends, times the peak")
    ap.add_argument(
        "-H", "--h", type=int, dest="h", help="H, inner steps between hand-overs of a fragment"
    )
    ap.add_argument(
        "-P", "--fragments", type=int, dest="num_fragments", help="P, number of fragments"
    )
    ap.add_argument(
        "--adoption",
        choices=["rebase", "overwrite"],
        help="on a merged fragment: keep the steps since the hand-over (rebase, default) "
        "or drop them (overwrite, the paper)",
    )
    ap.add_argument(
        "--mix-alpha", type=float, help="with overwrite: theta <- a*theta + (1-a)*Theta"
    )
    ap.add_argument(
        "--update-encoding",
        choices=["float32", "bfloat16", "int8", "int4"],
        help="how deltas go up: float32, bfloat16 (default), or blockwise int8 / int4 with "
        "error feedback (env DDILOCO_UPDATE_ENCODING; the synchronizer must accept it)",
    )
    ap.add_argument(
        "--update-block", type=int, help="values per scale of int8 / int4 (default 128, even)"
    )
    ap.add_argument(
        "--upload-http2",
        action="store_true",
        default=None,
        help="upload fragments over h2c instead of HTTP/1.1 (see config.py)",
    )
    ap.add_argument(
        "--upload-url",
        help="where updates go: default each shard's upload port (named at join), 'off' the "
        "sync URL, or a URL per shard in shard order (env DDILOCO_UPLOAD_URL)",
    )
    # --- budget and runtime ---
    ap.add_argument("--max-steps", type=int)
    ap.add_argument("--max-seconds", type=float)
    ap.add_argument("--max-tokens", type=int, help="stop after this many training tokens")
    ap.add_argument("--device", help="auto, cpu, cuda, cuda:1 ...")
    ap.add_argument(
        "--nproc-per-node",
        type=int,
        help="ranks of this learner's data-parallel group, one per device (default 1)",
    )
    ap.add_argument(
        "--parallel", choices=["ddp", "fsdp2"], help="how the group's ranks train (default ddp)"
    )
    ap.add_argument("--threads", type=int, help="torch CPU threads")
    ap.add_argument(
        "--slow-factor", type=float, help="chaos: make every step this many times slower"
    )
    ap.add_argument("--log-path", help="append JSON lines of steps and events here")
    ap.add_argument("--log-every", type=int, help="print a step line every N steps")
    ap.add_argument(
        "--metrics-port",
        type=int,
        help="serve Prometheus metrics on this port at /metrics (env DDILOCO_METRICS_PORT; "
        "default off)",
    )
    ap.add_argument("--log-level", default=os.environ.get("DDILOCO_LOG_LEVEL", "INFO"))
    ap.add_argument(
        "--debug-digests",
        action="store_true",
        help="tests: a SHA-256 of each rank's parameters in every adoption record",
    )
    return ap.parse_args(argv)


def build_config(
    args: argparse.Namespace, environ: Mapping[str, str] | None = None, *, strict: bool = False
) -> LearnerConfig:
    """The config `main` runs with: `environ` (default os.environ), then the flags in `args`."""
    overrides = {k: v for k, v in vars(args).items() if k not in NOT_CONFIG}
    return LearnerConfig.from_env(environ, strict=strict, **overrides)


def check_inputs(cfg: LearnerConfig) -> None:
    """Refuse now, by name, what would otherwise fail inside the run with a traceback: a learner
    id the synchronizer refuses, a sync URL that is not http(s), a data path that does not
    exist, a `--model-entry` that is not module:function, an unknown preset, a missing hf:
    config, weights that are not safetensors or an `--init-from` that is not the job's model
    (`ddiloco local` checks its flags with it too). The model check imports torch."""
    from urllib.parse import urlsplit

    from ddiloco.wire.protocol import JoinRequest

    JoinRequest(learner_id=cfg.learner_id)  # the id rule the join applies
    for one in cfg.sync_urls:  # a sharded synchronizer: its shards' URLs, in shard order
        url = urlsplit(one)
        if url.scheme not in ("http", "https") or not url.hostname:
            raise UsageError(
                f"--sync-url {one!r}: give http://HOST:PORT or https://... (a sharded "
                "synchronizer: its shards' URLs, comma-separated, in shard order)"
            )
    check_model_and_data(
        cfg.model,
        cfg.model_entry,
        cfg.data,
        cfg.init_from,
        cfg.tokenizer,
        num_learners=cfg.num_learners,
    )


def check_model_and_data(
    model: str,
    model_entry: str | None,
    data: str | None,
    init_from: str | None = None,
    tokenizer: str | None = None,
    *,
    num_learners: int = 1,
) -> None:
    """The model and data checks of `check_inputs` (ValueError, FileNotFoundError), then
    the weights' (learner/weights.py `check`: a WeightsError, which is a ValueError). A
    prepared dataset (a URL, or a directory with a manifest) is opened by its manifest and
    refused when its tokenizer is not the model's (`tokenizer`: the job's --tokenizer) or it
    has fewer chunks than `num_learners`; a store that cannot be reached is a
    `RuntimeFailure` naming it."""
    from pathlib import Path

    from ddiloco.learner import prepared

    if data is not None and not prepared.is_url(data) and not Path(data).expanduser().exists():
        raise FileNotFoundError(f"data path {data!r} does not exist")
    if model_entry is None and prepared.is_prepared(data):
        assert data is not None
        try:
            ds = prepared.open_dataset(data)
        except prepared.StoreUnreachable as e:
            raise RuntimeFailure(str(e)) from e
        ds.check_model(_vocab_size(model), _tokenizer_digest(tokenizer))
        prepared.chunks_of(len(ds.manifest.chunks), 0, num_learners)
    if model_entry is not None:
        module, _, fn = model_entry.partition(":")
        if not module or not fn:
            raise ValueError(f"--model-entry {model_entry!r}: give module:function")
    else:
        from ddiloco.learner import hf

        if hf.is_hf(model):
            hf.model_dir(model)  # a missing config is refused by name
        else:
            from ddiloco.learner.model import PRESETS

            if model not in PRESETS:
                raise ValueError(f"unknown model preset {model!r}; allowed: {', '.join(PRESETS)}")
    from ddiloco.learner import weights

    weights.check(model, model_entry, init_from)


def _vocab_size(model: str) -> int:
    """The vocabulary of a preset or an hf: config (read from its config, nothing built)."""
    from ddiloco.learner import hf

    if hf.is_hf(model):
        return int(hf.load_config(model).vocab_size)
    from ddiloco.learner.model import PRESETS

    if model not in PRESETS:
        raise ValueError(f"unknown model preset {model!r}; allowed: {', '.join(PRESETS)}")
    return PRESETS[model].vocab_size


def _tokenizer_digest(tokenizer: str | None) -> str | None:
    from ddiloco.learner.task import tokenizer_digest

    return tokenizer_digest(tokenizer)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from ddiloco.learner import spare
    from ddiloco.learner.launch import init_logging, launch, under_torchrun

    with usage_errors(PROG):  # bad flags, env or files: one line, exit 2 (cli/errors.py)
        cfg = build_config(args)
        if not cfg.token and not cfg.token_file:
            raise UsageError("no token: set DDILOCO_TOKEN or DDILOCO_TOKEN_FILE (--token-file)")
        cfg.token_source()  # a token file that holds no token is refused here, by name
        if not spare.enabled():  # a spare learns its slot (model, data) only later
            check_inputs(cfg)

    if spare.enabled():  # a hot spare (DDILOCO_SPARE=1): warm up, wait for a slot's identity
        init_logging(args.log_level, "spare")
        spare.wait_for_slot(args)
        logging.getLogger().handlers.clear()  # from here on the lines carry the slot's id
        cfg = build_config(args)
    init_logging(args.log_level, cfg.learner_id)
    if unread := LearnerConfig.unread_env(os.environ):
        # not fatal: an older image under a newer operator must still train
        logging.getLogger(__name__).warning(
            "Ignoring environment variables nothing reads: %s", ", ".join(unread)
        )
    if cfg.nproc_per_node > 1 and not under_torchrun():  # a group: spawn its ranks
        return launch(list(sys.argv[1:] if argv is None else argv), cfg.nproc_per_node)
    # a rank that aborts in native code (a collective's teardown, a std::terminate) prints
    # every thread's Python stack to stderr first: what it was doing is in its log
    faulthandler.enable()
    from ddiloco.learner.train import train  # torch is imported only here

    try:
        if args.debug_digests:
            train(cfg, digests=True)
        else:
            train(cfg)
    except UsageError as e:  # refused at join for its configuration (an update encoding)
        fail(PROG, e)
    return 0
