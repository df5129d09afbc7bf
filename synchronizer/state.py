"""Durable synchronizer state: what a restarted synchronizer needs to resume exactly.

    <state_dir>/layout.json                 fragment layout, written once at init
    <state_dir>/fragment-0003.safetensors   Theta_p, momentum b_p, version and stats of p
    <state_dir>/ledger.json                 learners (incarnations, contributions), totals

Every file is replaced atomically (write a temporary file, fsync, rename, fsync the
directory), so a SIGKILL at any instant leaves the previous or the next version of each
file, never a torn one. A fragment file carries its own version and the ids of the updates
merged into it, so a fragment and its duplicate filter can never disagree.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from ddiloco.synchronizer.protocol import Layout

Tensors = dict[str, torch.Tensor]
APPLIED_KEEP = 512  # ids of recently merged updates kept per fragment, for idempotence


@dataclass
class FragmentState:
    params: Tensors
    momentum: Tensors
    version: int = 0
    merges: int = 0
    tokens_merged: int = 0
    contributions: int = 0
    applied: list[str] = field(default_factory=list)

    def remember(self, update_ids: list[str]) -> None:
        self.applied = (self.applied + update_ids)[-APPLIED_KEEP:]


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _replace(tmp: Path, final: Path) -> None:
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, final)
    _fsync_dir(final.parent)


class StateStore:
    """Reads and atomically writes the files above; one instance per state directory."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _fragment_path(self, p: int) -> Path:
        return self.root / f"fragment-{p:04d}.safetensors"

    def load_layout(self) -> Layout | None:
        path = self.root / "layout.json"
        return Layout.model_validate_json(path.read_text()) if path.exists() else None

    def save_layout(self, layout: Layout) -> None:
        tmp = self.root / ".layout.json.tmp"
        tmp.write_text(layout.model_dump_json())
        _replace(tmp, self.root / "layout.json")

    def save_fragment(self, p: int, fs: FragmentState) -> None:
        tensors = {f"param/{k}": v for k, v in fs.params.items()}
        tensors |= {f"momentum/{k}": v for k, v in fs.momentum.items()}
        meta = {
            "version": str(fs.version),
            "merges": str(fs.merges),
            "tokens_merged": str(fs.tokens_merged),
            "contributions": str(fs.contributions),
            "applied": json.dumps(fs.applied),
        }
        final = self._fragment_path(p)
        tmp = final.with_name(f".{final.name}.tmp")
        save_file(tensors, str(tmp), metadata=meta)
        _replace(tmp, final)

    def load_fragment(self, p: int) -> FragmentState:
        path = self._fragment_path(p)
        tensors = load_file(str(path))
        from safetensors import safe_open

        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
        params = {k.removeprefix("param/"): v for k, v in tensors.items() if k.startswith("param/")}
        momentum = {
            k.removeprefix("momentum/"): v for k, v in tensors.items() if k.startswith("momentum/")
        }
        return FragmentState(
            params=params,
            momentum=momentum,
            version=int(meta.get("version", 0)),
            merges=int(meta.get("merges", 0)),
            tokens_merged=int(meta.get("tokens_merged", 0)),
            contributions=int(meta.get("contributions", 0)),
            applied=json.loads(meta.get("applied", "[]")),
        )

    def load_fragments(self, layout: Layout) -> list[FragmentState]:
        return [self.load_fragment(f.index) for f in layout.fragments]

    def save_ledger(self, ledger: dict[str, Any]) -> None:
        tmp = self.root / ".ledger.json.tmp"
        tmp.write_text(json.dumps(ledger, sort_keys=True))
        _replace(tmp, self.root / "ledger.json")

    def load_ledger(self) -> dict[str, Any]:
        path = self.root / "ledger.json"
        return json.loads(path.read_text()) if path.exists() else {}
