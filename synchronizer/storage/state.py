"""The state directory's whole files and the `StateStore` that reads and writes them.

    <state_dir>/layout.json                 fragment layout, written once at init
    <state_dir>/model.json                  what the job trains (ModelSpec), written at init
    <state_dir>/shard.json                  which shard of how many (shards.py)
    <state_dir>/init-from.json              the `--init-from` source (checkpoints.py)
    <state_dir>/evaluation.json             the latest evaluation an evaluator posted
    <state_dir>/fragment-0003.safetensors   Theta_p, momentum b_p, version, stats, high-water marks
    <state_dir>/pending-0003.000007.log     updates of p accepted since its last merge (the WAL),
                                            in segments (pending.py, segments.py)
    <state_dir>/merges-0003.log             merges of p its file does not hold yet (journal.py)
    <state_dir>/ledger.db                   learners and totals: SQLite (ledgerdb.py)
    <state_dir>/lock                        held by the synchronizer that uses the dir (statedir.py)

docs/storage.md describes each file, its format and its version. Every file carries the
format version (records.py `FORMAT`): the JSON files as `{"format": 1, KIND: body}`, a
fragment file as its `format` metadata; a file of another version is refused.

Whole files are replaced atomically (write a temporary file, fsync, rename, fsync the
directory), so a SIGKILL at any instant leaves the previous or the next version of each,
never a torn one. A fragment file is written from the tensors' own memory (`codec.pieces`:
header, then each tensor's bytes, no serialized copy in between), then fsynced: in the
background, up to `snapshot_lag` merges behind the version served (journal.py), or before
it is served. It carries, per learner, the highest (incarnation, learner_step) merged into
it: with the pending log's records it tells a restarted synchronizer exactly which updates
it already holds, however long ago they came.
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
from ddiloco.synchronizer.storage.records import (
    FORMAT,
    StateFormatError,
    load_json,
    replace,
    save_json,
)
from ddiloco.synchronizer.storage.segments import FragmentLog
from ddiloco.wire import codec
from ddiloco.wire.protocol import EvaluationStatus, Layout, ModelSpec

Tensors = dict[str, torch.Tensor]
JSON_FILES: Final = {
    "layout.json": "layout",
    "model.json": "model",
    "shard.json": "shard",
    "init-from.json": "source",
    "evaluation.json": "evaluation",
}
"""The state directory's JSON files and the key of each one's body (`save_json`)."""
_FRAGMENT_KEYS: Final = (
    "format",
    "version",
    "merges",
    "tokens_merged",
    "contributions",
    "high_water",
    "norms",
)
"""A fragment file's metadata: every key, none optional."""
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

    def load(self, name: str) -> Any:
        """The body of JSON file `name` (`JSON_FILES`), None if there is none;
        `StateFormatError` for a file of another format."""
        path = self.root / name
        return load_json(path, JSON_FILES[name]) if path.exists() else None

    def save(self, name: str, body: Any) -> None:
        """JSON file `name` (`JSON_FILES`) holding `body`, replaced whole."""
        save_json(self.root / name, JSON_FILES[name], body)

    def load_layout(self) -> Layout | None:
        body = self.load("layout.json")
        return None if body is None else Layout.model_validate(body)

    def save_layout(self, layout: Layout) -> None:
        self.save("layout.json", layout.model_dump(mode="json"))

    def load_model(self) -> ModelSpec | None:
        body = self.load("model.json")
        return None if body is None else ModelSpec.model_validate(body)

    def save_model(self, model: ModelSpec) -> None:
        self.save("model.json", model.model_dump(mode="json"))

    def load_evaluation(self) -> EvaluationStatus | None:
        """The latest evaluation saved, None if none."""
        body = self.load("evaluation.json")
        return None if body is None else EvaluationStatus.model_validate(body)

    def save_evaluation(self, evaluation: EvaluationStatus) -> None:
        self.save("evaluation.json", evaluation.model_dump(mode="json"))

    def save_fragment(self, p: int, fs: FragmentState) -> None:
        tensors = {f"param/{k}": v for k, v in fs.params.items()}
        tensors |= {f"momentum/{k}": v for k, v in fs.momentum.items()}
        meta = {
            "format": str(FORMAT),
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
        replace(tmp, final)

    @staticmethod
    def _checked(path: Path, meta: dict[str, str] | None) -> dict[str, str]:
        """A fragment file's metadata, of this format and with every key
        (`StateFormatError` else)."""
        meta = meta or {}
        if meta.get("format") != str(FORMAT):
            raise StateFormatError(path, meta.get("format"))
        missing = [k for k in _FRAGMENT_KEYS if k not in meta]
        if missing:
            raise StateFormatError(path, FORMAT, f"its metadata lacks {missing}")
        return meta

    @classmethod
    def check_fragment(cls, path: Path) -> None:
        """A fragment file of this format (its header only)."""
        with safe_open(str(path), framework="pt") as f:
            cls._checked(path, f.metadata())

    def fragment_version(self, p: int) -> int:
        """The version fragment p's file holds (its header only)."""
        path = self._fragment_path(p)
        with safe_open(str(path), framework="pt") as f:
            return int(self._checked(path, f.metadata())["version"])

    def load_fragment(self, p: int) -> FragmentState:
        params: Tensors = {}
        momentum: Tensors = {}
        path = self._fragment_path(p)
        with safe_open(str(path), framework="pt") as f:
            meta = self._checked(path, f.metadata())
            for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                kind, _, name = key.partition("/")
                (params if kind == "param" else momentum)[name] = f.get_tensor(key)
        return FragmentState(
            params=params,
            momentum=momentum,
            version=int(meta["version"]),
            merges=int(meta["merges"]),
            tokens_merged=int(meta["tokens_merged"]),
            contributions=int(meta["contributions"]),
            high_water={
                k: (int(v[0]), int(v[1])) for k, v in json.loads(meta["high_water"]).items()
            },
            norms=[float(x) for x in json.loads(meta["norms"])],
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
