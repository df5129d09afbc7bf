"""TensorBoard event files of a `ddiloco local` run, written as it goes.

    ddiloco local --tensorboard runs/tb        # then: tensorboard --logdir runs/tb
    sink = TensorBoardSink(Path("runs/tb/local-20260101-120000"))   # what the launcher does

Each run writes into its own folder under the given directory (named after the run's output
folder), so runs sit side by side in TensorBoard. Scalars, every one with the wall-clock time it
was measured and, as its step, the global version (merges so far) at that moment:

- `eval/loss`, `eval/perplexity`: the global model's held-out loss and e^loss, as the evaluator
  measures them (learner/evaluator.py), from the initial model (version 0) on; `ddiloco evaluate
  --tensorboard DIR` (learner/evaluate.py) writes these alone, through this same sink;
- `train/loss/<learner>`: each learner's last training loss, step = that learner's inner step;
- `sync/tokens_merged`, `sync/bytes_up`, `sync/bytes_down`: the synchronizer's counts, every second;
- `run/goodput`, `run/merged_work_ratio`, `run/tokens_computed`: the report's definitions over
  time (local/samples.py), written when the run ends (they need the learners' step logs);
- `summary/goodput`, `summary/merged_work_ratio`, `summary/eval_loss_final`: the headline figures;
  and the run's config as text.

The writer is tensorboardX (4.5 MiB with protobuf; the `tensorboard` package itself is ~80 MiB
of server): `pip install 'decoupled-diloco[tensorboard]'`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

INSTALL_HINT = "pip install 'decoupled-diloco[tensorboard]' (tensorboardX)"


def missing() -> str | None:
    """None when the writer can be imported, else a one-line reason."""
    try:
        import tensorboardX  # noqa: F401
    except ImportError:
        return f"--tensorboard needs the tensorboardX package: {INSTALL_HINT}"
    return None


class TensorBoardSink:
    """A local/samples.py Sink that writes scalars with tensorboardX's SummaryWriter."""

    def __init__(self, logdir: Path) -> None:
        from tensorboardX import SummaryWriter

        self.logdir = Path(logdir)
        self.writer = SummaryWriter(logdir=str(self.logdir), flush_secs=5)
        self.t0 = 0.0
        self.version = 0

    def _scalar(self, tag: str, value: float, step: int, t: float) -> None:
        self.writer.add_scalar(tag, float(value), global_step=int(step), walltime=self.t0 + t)

    def start(self, t0: float, initial_loss: float | None) -> None:
        self.t0 = t0
        if initial_loss is not None:
            self.eval(0.0, initial_loss, 0)

    def eval(self, t: float, loss: float, version: int) -> None:
        self._scalar("eval/loss", loss, version, t)
        self._scalar("eval/perplexity", math.exp(min(loss, 709.0)), version, t)

    def sample(self, sample: dict[str, Any]) -> None:
        t, self.version = sample["t"], sample["version"]
        for key in ("tokens_merged", "bytes_up", "bytes_down"):
            self._scalar(f"sync/{key}", sample[key], self.version, t)
        for lid, loss in sorted(sample["loss"].items()):
            self._scalar(f"train/loss/{lid}", loss, sample["step"].get(lid, 0), t)

    def finish(self, report: dict[str, Any]) -> None:
        for row in report.get("timeseries", []):
            for key in ("goodput", "merged_work_ratio", "tokens_computed"):
                self._scalar(f"run/{key}", row[key], row["version"], row["t"])
        wall, version = report["wall_seconds"], report["global_version"]
        for key in ("goodput", "merged_work_ratio", "eval_loss_final"):
            if report.get(key) is not None:
                self._scalar(f"summary/{key}", report[key], version, wall)
        config = json.dumps(report.get("config", {}), indent=2, sort_keys=True)
        self.writer.add_text("config", f"```\n{config}\n```", global_step=version)

    def close(self) -> None:
        self.writer.close()
