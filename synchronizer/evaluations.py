"""Evaluations of the global model: the latest one an evaluator posted, kept durably.

    POST /v1/evaluations   (an evaluator, learner/evaluate.py)  body EvaluationReport
                           -> EvaluationStatus (what GET /v1/status now shows as `evaluation`)

    book = Evaluations(store)        # the Synchronizer's `evaluations`; routes.py posts to it
    book.check(report, who, versions=[3, 4], shards=1)   # SyncError (403, 409, 422) or None
    book.record(report, who)         # durable, then the latest

An evaluator (`ddiloco evaluate`) fetches the global fragments, measures the held-out loss
and posts it here. The synchronizer keeps the latest one, with its perplexity (e^loss), the
global version it was measured at and when it arrived, in `<state_dir>/evaluation.json`
(state.py; written atomically before the answer), so that a restarted synchronizer still
shows it in /v1/status and as the `ddiloco_eval_*` gauges (metrics.py).

Who may post: the job key and evaluator credentials (`evaluator:<name>:<mac>`, auth.py); a
learner's or a spare's credential is refused (403). A report is refused (422) when its loss is
negative, not finite or above `protocol.MAX_EVAL_LOSS`, or, on a single synchronizer, when it
claims a global version the synchronizer has not reached; before the model is initialized
there is nothing to have measured (409). Nothing refused changes the evaluation kept.
"""

from __future__ import annotations

import logging
import math
import threading
import time

from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire.auth import Principal
from ddiloco.wire.errors import Refusal, SyncError
from ddiloco.wire.protocol import EvaluationReport, EvaluationStatus

log = logging.getLogger(__name__)


class Evaluations:
    """The latest evaluation (`latest`), loaded from the state directory and replaced, on
    disk first, by each accepted report. A failed write leaves the previous one in force
    and raises (the route answers 500, the evaluator posts its next one later)."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.lock = threading.Lock()
        self._latest: EvaluationStatus | None = store.load_evaluation()

    def latest(self) -> EvaluationStatus | None:
        return self._latest

    @staticmethod
    def check(
        report: EvaluationReport, who: Principal, versions: list[int] | None, shards: int
    ) -> None:
        """Refuse a report this synchronizer must not keep: from a credential that is not an
        evaluator's or the job key (403), before the model exists (`versions` None: 409), or
        of a global version beyond the served one on a single synchronizer (422; a shard's
        versions are only its own fragments', so a sharded job's shard cannot tell)."""
        if not who.evaluates():
            raise SyncError(
                Refusal.FORBIDDEN,
                f"{who} may not post evaluations: that takes an evaluator's credential",
            )
        if versions is None:
            raise SyncError(Refusal.NOT_INITIALIZED, "no global model yet: nothing was evaluated")
        current = sum(versions)
        if shards == 1 and report.global_version > current:
            raise SyncError(
                Refusal.INVALID,
                f"global_version {report.global_version} is ahead of this synchronizer's "
                f"({current}): an evaluation reports the version it fetched",
            )

    def record(
        self, report: EvaluationReport, who: Principal, now: float | None = None
    ) -> EvaluationStatus:
        """Keep `report` as the latest evaluation, durably; the caller checked it."""
        evaluation = EvaluationStatus(
            loss=report.loss,
            perplexity=math.exp(report.loss),
            global_version=report.global_version,
            tokens=report.tokens,
            time=time.time() if now is None else now,
            evaluator=who.name if who.kind == "evaluator" else who.kind,
        )
        with self.lock:
            self.store.save_evaluation(evaluation)
            self._latest = evaluation
        log.info(
            "Evaluation of global version %d by %s: loss %.4f, perplexity %.4g",
            evaluation.global_version,
            who,
            evaluation.loss,
            evaluation.perplexity,
        )
        return evaluation
