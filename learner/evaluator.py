"""Eval loss of the *global* model, as the synchronizer holds it: the one measurement that
`ddiloco local` (a thread of its launcher) and `ddiloco evaluate` (its own process,
learner/evaluate.py) both take.

It fetches every global fragment, loads them into its own copy of the model and measures
the held-out loss. The copy is built as the learners build theirs (a GPT preset, an `hf:`
config, a model entry, `init_from`) and measured on the same eval set, the held-out tail or
documents every learner holds out (learner/corpus.py); only that set is read and tokenized.
It only reads from the synchronizer (status, fragments): merges never wait for it.

    ev = GlobalEvaluator(url, token, preset="hf:llama-tiny", data="docs.jsonl",
                         model_entry=None, seed=0)
    ev.evaluate()      # (loss, global version) now, or None while there is no model
    ev.measure()       # the same as a `Measurement` (perplexity, tokens), not in `history`
"""

from __future__ import annotations

import inspect
import logging
import math
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from ddiloco.learner.shard_clients import ShardClients, split_urls
from ddiloco.learner.sync_client import ClientTLS, SyncClient, SyncRefused, SyncUnavailable
from ddiloco.learner.task import build_task
from ddiloco.wire.protocol import EvaluationReport

log = logging.getLogger(__name__)

EVAL_BATCHES = 8
"""Batches of held-out windows per measurement unless told otherwise (learner/data.py's)."""


@dataclass(frozen=True)
class Measurement:
    """One held-out loss of the global model."""

    loss: float
    """Mean cross-entropy, nats per token."""
    global_version: int
    """The sum of the versions of the fragments measured: the model's exact version."""
    tokens: int
    """Held-out tokens the loss is the mean over (0 when the task does not say)."""
    seconds: float
    """How long fetching and measuring took."""

    @property
    def perplexity(self) -> float:
        return math.exp(min(self.loss, 709.0))  # e^709.8 is the largest finite float

    def report(self) -> EvaluationReport:
        """What POST /v1/evaluations takes."""
        return EvaluationReport(
            loss=self.loss, global_version=self.global_version, tokens=self.tokens
        )


class GlobalEvaluator:
    """State: the model copy, a client (one per shard) and the history
    [(t, loss, global_version)] of `evaluate`. A synchronizer that is away or not yet
    initialized gives None (logged at debug), never an exception."""

    def __init__(
        self,
        sync_url: str,
        token: Any,
        *,
        tls: ClientTLS | None = None,
        preset: str,
        data: str | None,
        model_entry: str | None,
        seed: int,
        batch_size: int = 8,
        every_s: float = 5.0,
        tokenizer: str | None = None,
        data_field: str = "text",
        init_from: str | None = None,
        eval_batches: int | None = None,
        initial: bool = True,
        seq_len: int | None = None,
        post: bool = False,
    ) -> None:
        """`token`: a string or a token source (auth.py). `eval_batches`: held-out batches per
        measurement (default `EVAL_BATCHES`); a model entry's eval_loss must take `batches`
        for it. `initial`: measure the seeded model (version 0) now, as `initial_loss`.
        `post`: `evaluate` also posts each measurement to the synchronizer (POST
        /v1/evaluations, as `ddiloco local` does with the job key); a refusal is logged."""
        torch.set_num_threads(1)
        # the learners' batch size and sequence length, so that task.tokens_per_batch is a
        # learner step's tokens and the eval windows are the learners' own
        self.task = build_task(
            preset=preset,
            data=data,
            model_entry=model_entry,
            seed=seed,
            batch_size=batch_size,
            tokenizer=tokenizer,
            data_field=data_field,
            eval_only=True,
            init_from=init_from,
            seq_len=seq_len,
        )
        takes_batches = _takes(self.task.eval_loss, "batches")
        if eval_batches is not None and not takes_batches:
            raise ValueError(
                f"eval batches {eval_batches}: the model entry's eval_loss takes no `batches`"
            )
        self.eval_batches = (eval_batches or EVAL_BATCHES) if takes_batches else None
        self.params = dict(self.task.model.named_parameters())
        # a sharded synchronizer (a comma list): each fragment from its owner, status merged
        urls = split_urls(sync_url)
        self.client: Any = (
            SyncClient(sync_url, token, tls=tls)
            if len(urls) == 1
            else ShardClients(urls, token, tls=tls)
        )
        self.every_s = every_s
        self.post = post
        self.history: list[tuple[float, float, int]] = []
        # Every learner starts from this same model (version 0 of every fragment): seeded, or
        # the weights of the hf: directory or of init_from.
        self.initial_loss = self._loss() if initial else None
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    def _loss(self) -> float:
        if self.eval_batches is None:
            return float(self.task.eval_loss(self.task.model))
        return float(self.task.eval_loss(self.task.model, batches=self.eval_batches))

    @property
    def tokens(self) -> int:
        """Held-out tokens behind one measurement (0 when the task's eval_loss fixes them)."""
        return (self.eval_batches or 0) * int(self.task.tokens_per_batch)

    @torch.no_grad()
    def measure(self) -> Measurement | None:
        """Fetch the global model and measure it now; None while the synchronizer is away or
        uninitialized."""
        with self.lock:
            t0 = time.monotonic()
            try:
                status = self.client.status()
                if not status.initialized:
                    return None
                version = 0
                for f in status.fragments:
                    v, tensors = self.client.fragment(f.index)
                    version += v
                    for name, t in tensors.items():
                        self.params[name].copy_(t.to(self.params[name].dtype))
            except (SyncUnavailable, SyncRefused) as e:
                log.debug("Evaluation skipped: %s", e)
                return None
            loss = self._loss()
            return Measurement(loss, version, self.tokens, time.monotonic() - t0)

    def evaluate(self) -> tuple[float, int] | None:
        """One measurement now, kept in `history`, or None while there is no model."""
        m = self.measure()
        if m is None:
            return None
        self.history.append((time.time(), m.loss, m.global_version))
        if self.post:
            try:
                self.client.evaluation(m.report())
            except (SyncUnavailable, SyncRefused) as e:
                log.warning("Could not post the evaluation of version %d: %s", m.global_version, e)
        return m.loss, m.global_version

    def _loop(self) -> None:
        while not self.stop_event.wait(self.every_s):
            self.evaluate()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._loop, name="ddiloco-eval", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        self.stop_event.set()
        if self.thread is not None:
            self.thread.join(timeout=10)

    def close(self) -> None:
        self.client.close()


def _takes(fn: Any, name: str) -> bool:
    """Whether `fn` can be called with the keyword `name` (a partial's too)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return False
    return name in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
