"""Durable synchronizer state: what a restarted synchronizer needs to resume exactly.

    <state_dir>/layout.json                 fragment layout, written once at init
    <state_dir>/model.json                  what the job trains (ModelSpec), written at init
    <state_dir>/evaluation.json             the latest evaluation an evaluator posted
                                            (evaluations.py), with its format version
    <state_dir>/fragment-0003.safetensors   Theta_p, momentum b_p, version, stats, high-water marks
    <state_dir>/pending-0003.000007.log     updates of p accepted since its last merge (the WAL),
                                            in segments; `pending-0003.log` is an older one's
    <state_dir>/merges-0003.log             merges of p its file does not hold yet (journal.py)
    <state_dir>/ledger.db                   learners (incarnations, contributions, data
                                            positions), totals: SQLite, a row per record
                                            (ledgerdb.py)

Whole files are replaced atomically (write a temporary file, fsync, rename, fsync the
directory), so a SIGKILL at any instant leaves the previous or the next version of each,
never a torn one. The pending log is append-only: an accepted update is appended and
fsynced before the synchronizer answers `accepted`. A merge seals the segments that hold
its round's records (new records go to a new segment while it computes and persists) and
deletes them only once the fragment file holds the merge that consumed them; a merge is
durable before that, as a merge journal record of its inputs (journal.py), and a restart
redoes the journaled merges the file lacks, then replays every segment left, skipping
what the high-water marks say is merged. A record torn by a crash (it was never
acknowledged) is cut off when the log is read back.

A fragment file is written from the tensors' own memory (`codec.pieces`: header, then each
tensor's bytes, no serialized copy in between), then fsynced: in the background, up to
`snapshot_lag` merges behind the version served (journal.py), or before it is served.

A fragment file carries, per learner, the highest (incarnation, learner_step) merged into
it: with the pending log's records it tells a restarted synchronizer exactly which
updates it already holds, however long ago they came.
"""

from __future__ import annotations

import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ddiloco.synchronizer.storage.direct_io import write_direct
from ddiloco.synchronizer.storage.ledgerdb import LedgerDB
from ddiloco.synchronizer.storage.pending import _fsync_dir
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.wire import codec
from ddiloco.wire.protocol import EvaluationStatus, Layout, ModelSpec

Tensors = dict[str, torch.Tensor]
EVALUATION_FORMAT: Final = 1
"""The format version of evaluation.json."""
Order = tuple[int, int]
"""(incarnation, learner_step): the position of an update among one learner's of a fragment."""


@dataclass
class FragmentState:
    params: Tensors
    momentum: Tensors
    version: int = 0
    merges: int = 0
    tokens_merged: int = 0
    contributions: int = 0
    high_water: dict[str, Order] = field(default_factory=dict)
    """Per learner, the highest update order merged into this fragment."""
    norms: list[float] = field(default_factory=list)
    """Norms of recently accepted updates (the relative guard's history survives restarts)."""
    theta_norm: float | None = field(default=None, init=False, repr=False, compare=False)
    """The norm of `params`, computed once (`Synchronizer._theta_norm`). Not an init field,
    so `dataclasses.replace` (how a merge makes the next state) never carries it over to
    new params; code that assigns `params` in place must reset it."""


def _write_all(path: Path, parts: list[memoryview | bytes]) -> None:
    """Write `parts` one after the other into a new file (not yet fsynced)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        for part in parts:
            view = memoryview(part).cast("B")
            while view:
                view = view[os.write(fd, view[: 1 << 30]) :]
    finally:
        os.close(fd)


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


class StateStore:
    """Reads and durably writes the files above; one instance per state directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        self.logs: dict[int, FragmentLog] = {}
        self.ledger = LedgerDB(self.root / "ledger.db")
        self.logs_lock = threading.Lock()
        """First posts of a fragment come concurrently: two `FragmentLog`s of one fragment
        would each number segments on their own (one's writes invisible to the other's
        seal and read; a CI run read 23 of 24 accepted records back from the live log)."""

    def _fragment_path(self, p: int) -> Path:
        return self.root / f"fragment-{p:04d}.safetensors"

    def pending(self, p: int) -> FragmentLog:
        with self.logs_lock:
            if p not in self.logs:
                self.logs[p] = FragmentLog(self.root, p)
            return self.logs[p]

    def close(self) -> None:
        for log in self.logs.values():
            log.close()
        self.ledger.close()

    def load_layout(self) -> Layout | None:
        path = self.root / "layout.json"
        return Layout.model_validate_json(path.read_text()) if path.exists() else None

    def save_layout(self, layout: Layout) -> None:
        tmp = self.root / ".layout.json.tmp"
        tmp.write_text(layout.model_dump_json())
        _replace(tmp, self.root / "layout.json")

    def load_model(self) -> ModelSpec | None:
        path = self.root / "model.json"
        return ModelSpec.model_validate_json(path.read_text()) if path.exists() else None

    def save_model(self, model: ModelSpec) -> None:
        tmp = self.root / ".model.json.tmp"
        tmp.write_text(model.model_dump_json())
        _replace(tmp, self.root / "model.json")

    def load_evaluation(self) -> EvaluationStatus | None:
        """The latest evaluation saved, None if none; a file of another format than
        `EVALUATION_FORMAT` is refused (ValueError naming it)."""
        path = self.root / "evaluation.json"
        if not path.exists():
            return None
        saved = json.loads(path.read_text())
        if not isinstance(saved, dict) or saved.get("format") != EVALUATION_FORMAT:
            raise ValueError(
                f"{path} is not an evaluation of format {EVALUATION_FORMAT}: remove it (it "
                "holds only the latest evaluation, which the evaluator sends again)"
            )
        return EvaluationStatus.model_validate(saved["evaluation"])

    def save_evaluation(self, evaluation: EvaluationStatus) -> None:
        tmp = self.root / ".evaluation.json.tmp"
        body = {"format": EVALUATION_FORMAT, "evaluation": evaluation.model_dump(mode="json")}
        tmp.write_text(json.dumps(body, sort_keys=True))
        _replace(tmp, self.root / "evaluation.json")

    def save_fragment(self, p: int, fs: FragmentState) -> None:
        tensors = {f"param/{k}": v for k, v in fs.params.items()}
        tensors |= {f"momentum/{k}": v for k, v in fs.momentum.items()}
        meta = {
            "version": str(fs.version),
            "merges": str(fs.merges),
            "tokens_merged": str(fs.tokens_merged),
            "contributions": str(fs.contributions),
            "high_water": json.dumps({k: list(v) for k, v in fs.high_water.items()}),
            "norms": json.dumps(fs.norms),
        }
        final = self._fragment_path(p)
        tmp = final.with_name(f".{final.name}.tmp")
        parts = codec.pieces(tensors, meta)  # the tensors' own bytes: no serialized copy
        if parts is None:
            save_file(tensors, str(tmp), metadata=meta)
        elif not write_direct(tmp, parts):
            _write_all(tmp, parts)
        _replace(tmp, final)

    def fragment_version(self, p: int) -> int:
        """The version fragment p's file holds (its header only)."""
        with safe_open(str(self._fragment_path(p)), framework="pt") as f:
            return int((f.metadata() or {}).get("version", 0))

    def load_fragment(self, p: int) -> FragmentState:
        params: Tensors = {}
        momentum: Tensors = {}
        with safe_open(str(self._fragment_path(p)), framework="pt") as f:
            meta = f.metadata() or {}
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                kind, _, name = key.partition("/")
                (params if kind == "param" else momentum)[name] = f.get_tensor(key)
        return FragmentState(
            params=params,
            momentum=momentum,
            version=int(meta.get("version", 0)),
            merges=int(meta.get("merges", 0)),
            tokens_merged=int(meta.get("tokens_merged", 0)),
            contributions=int(meta.get("contributions", 0)),
            high_water={
                k: (int(v[0]), int(v[1]))
                for k, v in json.loads(meta.get("high_water", "{}")).items()
            },
            norms=[float(x) for x in json.loads(meta.get("norms", "[]"))],
        )

    def load_fragments(self, layout: Layout) -> list[FragmentState]:
        return [self.load_fragment(f.index) for f in layout.fragments]

    def save_ledger(
        self,
        records: dict[str, dict[str, Any]],
        totals: dict[str, Any],
        drop: list[str] | tuple[str, ...] = (),
    ) -> None:
        """Write the changed learner records and the totals, and delete the dropped
        records' rows: one durable transaction (ledgerdb.py)."""
        self.ledger.save(records, totals, drop)

    def load_ledger(self) -> dict[str, Any]:
        """{"learners": [saved record, ...], "totals": {...}}; empty for a new state dir."""
        rows, totals = self.ledger.load()
        return {"learners": rows, "totals": totals}
