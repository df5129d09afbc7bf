"""Eval loss of the *global* model, as the synchronizer holds it, over a run.

A thread in the launcher fetches every global fragment, loads them into its own copy of
the model and measures the held-out loss; the curve in the report and plot is this one.
The copy is built as the learners build theirs (a GPT preset, an `hf:` config, a model
entry) and measured on the same eval set, the held-out tail or documents every learner
holds out (learner/corpus.py); only that set is read and tokenized here.

    ev = GlobalEvaluator(url, token, preset="hf:llama-tiny", data="docs.jsonl",
                         model_entry=None, seed=0)
    ev.evaluate()      # (loss, global version) now, or None while there is no model
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from ddiloco.learner.task import build_task
from ddiloco.synchronizer.client import ClientTLS, SyncClient, SyncRefused, SyncUnavailable
from ddiloco.synchronizer.shards import ShardClients, split_urls

log = logging.getLogger(__name__)


class GlobalEvaluator:
    """State: the model copy and the history [(t, loss, global_version)]."""

    def __init__(
        self,
        sync_url: str,
        token: str,
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
    ) -> None:
        torch.set_num_threads(1)
        # the learners' batch size, so that task.tokens_per_batch is a learner step's tokens
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
        )
        self.params = dict(self.task.model.named_parameters())
        # a sharded synchronizer (a comma list): each fragment from its owner, status merged
        urls = split_urls(sync_url)
        self.client = (
            SyncClient(sync_url, token, tls=tls)
            if len(urls) == 1
            else ShardClients(urls, token, tls=tls)
        )
        self.every_s = every_s
        self.history: list[tuple[float, float, int]] = []
        # Every learner starts from this same model (version 0 of every fragment): seeded, or
        # the weights of the hf: directory or of init_from.
        self.initial_loss = float(self.task.eval_loss(self.task.model))
        self.lock = threading.Lock()
        self.stop_event = threading.Event()
        self.thread: threading.Thread | None = None

    @torch.no_grad()
    def evaluate(self) -> tuple[float, int] | None:
        """One measurement now, or None while the synchronizer is away or uninitialized."""
        with self.lock:
            try:
                status = self.client.status()
                if not status.initialized:
                    return None
                for f in status.fragments:
                    _, tensors = self.client.fragment(f.index)
                    for name, t in tensors.items():
                        self.params[name].copy_(t.to(self.params[name].dtype))
            except (SyncUnavailable, SyncRefused) as e:
                log.debug("Evaluation skipped: %s", e)
                return None
            loss = float(self.task.eval_loss(self.task.model))
            self.history.append((time.time(), loss, status.global_version))
            return loss, status.global_version

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
