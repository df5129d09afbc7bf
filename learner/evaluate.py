"""`ddiloco evaluate`: measure the global model's held-out loss as a job trains, in a process of
its own, and report every result to the synchronizer, to TensorBoard and to its log.

    DDILOCO_TOKEN_FILE=/var/run/ddiloco/token/token ddiloco evaluate \
        --sync-url http://sync:8470 --model tiny --data corpus.txt \
        --every-versions 20 --every-seconds 300 --tensorboard /runs/tb
    ddiloco evaluate --once ...          # one measurement, reported, then exit (cron, tests)

It builds the model and eval set exactly as the learners do (learner/evaluator.py): give it
the learners' `--model/--model-entry/--data/--tokenizer/--data-field/--init-from/--batch-size/
--seq-len/--seed` (or the same `DDILOCO_*` variables, learner/config.py), and it measures the same
held-out windows every learner holds out. Every `--poll-seconds` it reads the synchronizer's
global version; it measures when the version moved `--every-versions` (N) past the last one
measured, or when `--every-seconds` (T) passed since the last measurement and the version
moved at all (an unchanged model is not measured twice), and once at start. It only reads
fragments (merges never wait for it) and posts the result (POST /v1/evaluations), which the
synchronizer keeps durably and shows in /v1/status and /metrics.

Its credential is an evaluator's, `evaluator:<name>:<mac>` (`ddiloco credential --evaluator
NAME`; the operator mounts one): it may read the model and post evaluations, nothing else. A
credential the synchronizer refuses for this (401, 403) ends the command with one line, exit
2; a synchronizer that is away is waited for. SIGTERM ends it after the measurement in hand.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from ddiloco.cli.errors import UsageError, fail, usage_errors

PROG = "ddiloco evaluate"
log = logging.getLogger(__name__)

# The learner settings the evaluator shares (LearnerConfig fields, flags or DDILOCO_* variables).
SHARED = (
    "sync_url",
    "token_file",
    "ca_file",
    "client_cert_file",
    "client_key_file",
    "model",
    "model_entry",
    "init_from",
    "data",
    "tokenizer",
    "data_field",
    "batch_size",
    "seq_len",
    "seed",
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Measure a job's global model on the held-out set, as it trains."
    )
    # --- the synchronizer ---
    ap.add_argument("--sync-url", help="synchronizer URL (a comma list: its shards, in order)")
    ap.add_argument("--token-file", help="file holding the evaluator's credential (else env)")
    ap.add_argument("--ca-file", help="PEM CA that signed an https synchronizer's certificate")
    ap.add_argument(
        "--client-cert", dest="client_cert_file", help="PEM client certificate (mutual TLS)"
    )
    ap.add_argument("--client-key", dest="client_key_file", help="PEM key of --client-cert")
    # --- the learners' model and data: give theirs ---
    ap.add_argument("--model", help="the learners' model preset or hf:PATH")
    ap.add_argument("--model-entry", help="the learners' module:function")
    ap.add_argument("--init-from", help="the learners' --init-from")
    ap.add_argument("--data", help="the learners' data (its held-out part is measured)")
    ap.add_argument("--tokenizer", help="the learners' tokenizer")
    ap.add_argument("--data-field", help="the learners' text column of JSONL and Parquet data")
    ap.add_argument("--batch-size", type=int, help="the learners' sequences per batch")
    ap.add_argument("--seq-len", type=int, help="the learners' tokens per sequence")
    ap.add_argument("--seed", type=int, help="the learners' seed")
    # --- when and how much ---
    ap.add_argument(
        "--every-versions",
        type=int,
        default=0,
        help="measure when the global version moved this many merges (N; 0: off)",
    )
    ap.add_argument(
        "--every-seconds",
        type=float,
        default=300.0,
        help="measure when this long passed and the version moved (T; 0: off)",
    )
    ap.add_argument("--eval-batches", type=int, help="held-out batches per measurement (default 8)")
    ap.add_argument(
        "--poll-seconds", type=float, default=5.0, help="how often to read the global version"
    )
    ap.add_argument("--once", action="store_true", help="measure once, report, exit")
    # --- where results go besides the synchronizer and the log ---
    ap.add_argument(
        "--tensorboard", help="write eval/loss and eval/perplexity event files in this folder"
    )
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    ap.add_argument("--log-level", default=os.environ.get("DDILOCO_LOG_LEVEL", "INFO"))
    return ap.parse_args(argv)


def check(args: argparse.Namespace) -> None:
    """Refuse, by flag, the schedule settings that cannot work."""
    if args.every_versions < 0 or args.every_seconds < 0:
        raise UsageError("--every-versions and --every-seconds must be >= 0")
    if not args.once and args.every_versions == 0 and args.every_seconds == 0:
        raise UsageError("give --every-versions N, --every-seconds T (or both), or --once")
    if args.eval_batches is not None and not 1 <= args.eval_batches <= 100_000:
        raise UsageError(f"--eval-batches {args.eval_batches}: give 1..100000")
    if not 0.05 <= args.poll_seconds <= 3600:
        raise UsageError(f"--poll-seconds {args.poll_seconds:g}: give 0.05..3600")


def due(
    version: int, now: float, last: tuple[int, float] | None, every_versions: int, every_s: float
) -> bool:
    """Whether to measure at `version` and time `now` after `last` = (version, time) of the
    previous measurement (None: none yet)."""
    if last is None:
        return True
    moved = version - last[0]
    if every_versions and moved >= every_versions:
        return True
    return bool(every_s) and moved > 0 and now - last[1] >= every_s


class Reporter:
    """Where each measurement goes: the synchronizer (POST /v1/evaluations), TensorBoard (the
    `ddiloco local` sink, local/tensorboard.py) and the log."""

    def __init__(self, client: Any, tensorboard: str | None) -> None:
        self.client = client
        self.t0 = time.time()
        self.sink: Any = None
        if tensorboard is not None:
            from ddiloco.local.tensorboard import TensorBoardSink

            self.sink = TensorBoardSink(Path(tensorboard))
            self.sink.start(self.t0, None)

    def report(self, m: Any) -> None:
        from ddiloco.learner.sync_client import SyncRefused, SyncUnavailable

        log.info(
            "Evaluated global version %d: loss %.4f perplexity %.4g over %d tokens (%.1f s)",
            m.global_version,
            m.loss,
            m.perplexity,
            m.tokens,
            m.seconds,
        )
        if self.sink is not None:
            self.sink.eval(time.time() - self.t0, m.loss, m.global_version)
            self.sink.writer.flush()
        try:
            self.client.evaluation(m.report())
        except SyncRefused as e:
            if e.status in (401, 403):  # the wrong credential: no use going on
                raise UsageError(f"the synchronizer refused this credential: {e}") from None
            log.warning("The synchronizer refused the evaluation: %s", e)
        except SyncUnavailable as e:
            log.warning("Could not report the evaluation (the next one will be): %s", e)

    def close(self) -> None:
        if self.sink is not None:
            self.sink.close()


def run(
    args: argparse.Namespace, evaluator: Any, reporter: Reporter, stop: threading.Event
) -> None:
    """Measure on the schedule until `stop` (or once)."""
    from ddiloco.learner.sync_client import SyncRefused, SyncUnavailable

    last: tuple[int, float] | None = None
    while not stop.is_set():
        try:
            status = evaluator.client.status()
        except SyncRefused as e:
            if e.status in (401, 403):
                raise UsageError(f"the synchronizer refused this credential: {e}") from None
            status = None
        except SyncUnavailable as e:
            log.debug("Synchronizer away: %s", e)
            status = None
        now = time.monotonic()
        if (
            status is not None
            and status.initialized
            and due(status.global_version, now, last, args.every_versions, args.every_seconds)
        ):
            m = evaluator.measure()
            if m is not None:
                reporter.report(m)
                last = (m.global_version, now)
                if args.once:
                    return
        stop.wait(args.poll_seconds)


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    logging.basicConfig(
        level=args.log_level,
        stream=sys.stderr,
        format="%(asctime)s evaluator %(levelname)s: %(message)s",
    )
    from ddiloco.learner.cli import check_model_and_data
    from ddiloco.learner.config import LearnerConfig

    with usage_errors(PROG):
        check(args)
        overrides = {k: getattr(args, k) for k in SHARED if getattr(args, k) is not None}
        cfg = LearnerConfig.from_env(**overrides)
        tokens = cfg.token_source()  # refused here, by name, when there is none
        check_model_and_data(cfg.model, cfg.model_entry, cfg.data, cfg.init_from)
        if args.tensorboard is not None:
            from ddiloco.local.tensorboard import missing

            if (why := missing()) is not None:
                raise UsageError(why)
        import torch

        from ddiloco.learner.evaluator import GlobalEvaluator

        torch.set_num_threads(args.threads)
        evaluator = GlobalEvaluator(
            cfg.sync_url,
            tokens,
            tls=cfg.client_tls(),
            preset=cfg.model,
            data=cfg.data,
            model_entry=cfg.model_entry,
            seed=cfg.seed,
            batch_size=cfg.batch_size,
            tokenizer=cfg.tokenizer,
            data_field=cfg.data_field,
            init_from=cfg.init_from,
            seq_len=cfg.seq_len,
            eval_batches=args.eval_batches,
            initial=True,  # the model every learner starts from, measured before any merge
        )
        torch.set_num_threads(args.threads)  # the evaluator sets 1 for `ddiloco local`'s thread
    log.info(
        "Evaluated the starting model (%s): loss %.4f",
        f"init from {cfg.init_from}" if cfg.init_from else cfg.model_entry or cfg.model,
        evaluator.initial_loss,
    )
    log.info(
        "Evaluating %s (model %s, data %s) every %s versions / %s s, %d held-out tokens each",
        cfg.sync_url,
        cfg.model_entry or cfg.model,
        cfg.data or "the stdlib corpus",
        args.every_versions or "-",
        f"{args.every_seconds:g}" if args.every_seconds else "-",
        evaluator.tokens,
    )
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    reporter = Reporter(evaluator.client, args.tensorboard)
    try:
        run(args, evaluator, reporter, stop)
    except UsageError as e:
        fail(PROG, e)
    except KeyboardInterrupt:
        pass
    finally:
        reporter.close()
        evaluator.close()
    return 0
