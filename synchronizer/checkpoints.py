"""Periodic checkpoints of the global model and the outer state, kept outside the job, and
the start of a new job from one.

    DDILOCO_CHECKPOINT_DEST=/ckpt DDILOCO_CHECKPOINT_EVERY_VERSIONS=100 ddiloco synchronizer
    DDILOCO_CHECKPOINT_DEST=s3://bucket/run-7 DDILOCO_CHECKPOINT_EVERY_SECONDS=600 ...
    ddiloco synchronizer --init-from /ckpt/20261207T101500.000000Z-v000000001200   # a new job
    ddiloco synchronizer --init-from s3://bucket/run-7                       # its `latest`

Every `checkpoint_every_versions` global versions and/or `checkpoint_every_seconds` seconds
(synchronizer/config.py), a background thread copies each fragment's served state (its
Theta, outer momentum and counts: served means durable, journal.py) under the fragment's
lock, lets go of the lock, and writes `DEST/<name>/`, name `<UTC time to the microsecond>-v<global
version, 12 digits>` (20261207T101500.000000Z-v000000001200): names sort by time, so the
newest are kept even where a new job's versions start below an old one's in the same DEST:

    config.json, model.safetensors, ...    the model directory (synchronizer/modeldir.py, as
                                           `ddiloco export` writes it): `from_pretrained` and
                                           the learners' `--init-from` load it
    outer/fragment-0003.safetensors        fragment 3's Theta (`param/NAME`) and outer momentum
                                           (`momentum/NAME`), float32, exactly as merged
    ddiloco_checkpoint.json                the manifest (`Manifest`): format version, layout,
                                           model spec, each fragment's version and counts.
                                           Written last: a directory without it is partial
                                           and never read

then `DEST/latest` (the name, one line) once the checkpoint is whole, then deletes all but
the newest `checkpoint_keep` whole checkpoints (with their manifest), deleting older ones,
partial ones older than the newest whole one, and staging directories a killed writer left
(nothing else under DEST is touched: a partial checkpoint never counts toward the number kept). DEST is a local directory (a volume: the
checkpoint is staged in `DEST/.partial-<name>` and renamed into place) or any fsspec URL
(s3:// through s3fs: staged in a local temporary directory, then uploaded file by file,
the manifest last). A write that fails (an unwritable directory, an object store that is
down) is logged and counted (`ddiloco_checkpoints_total{outcome="failed"}`) and tried again
one period later; the synchronizer goes on merging either way.

`--init-from SRC` (`DDILOCO_INIT_FROM`) on a fresh state dir: SRC is a checkpoint (its
manifest), a checkpoint destination (its `latest`), or a plain model directory. From a
checkpoint the synchronizer initializes at startup, layout, model spec, Theta, momentum and
versions, before any learner joins, and learners download the global model from it; a
learner whose layout differs is refused at join naming SRC. From a plain model directory
(no layout in it) it waits for the first learner's init upload and takes the layout and
model spec from it but the parameters from SRC (momentum zero), refusing a model whose
parameter names or shapes differ. A sharded synchronizer (shards.py) neither writes nor
starts from checkpoints: the settings refuse it (a checkpoint is one directory holding every
fragment, and a shard holds only its own).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final, Literal
from urllib.parse import urlsplit, urlunsplit

import torch
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddiloco.cli.errors import UsageError
from ddiloco.synchronizer.modeldir import GlobalModel, write_model_dir
from ddiloco.wire.protocol import Layout, ModelSpec

if TYPE_CHECKING:
    from fsspec import AbstractFileSystem

    from ddiloco.synchronizer.service import Synchronizer

log = logging.getLogger(__name__)

__all__ = [
    "Checkpoint",
    "CheckpointError",
    "Checkpointer",
    "Manifest",
    "read_checkpoint",
    "read_model_params",
    "take_snapshot",
    "write_checkpoint",
]

FORMAT_VERSION: Final = 1
MANIFEST: Final = "ddiloco_checkpoint.json"
LATEST: Final = "latest"
OUTER: Final = "outer"
NAME: Final = re.compile(r"^(\d{8}T\d{6}\.\d{6}Z)-v(\d{12})$")
"""A checkpoint's directory name: UTC time to the microsecond, then the global version."""
PARTIAL: Final = ".partial-"
TICK_S: Final = 0.5
"""How often the checkpoint thread looks at the global version and the clock."""


class CheckpointError(UsageError, ValueError):
    """A checkpoint that cannot be read or started from (one line naming it and why; exit 2
    from `ddiloco synchronizer`, cli/errors.py)."""


class FragmentEntry(BaseModel):
    """One fragment's outer state in a checkpoint."""

    model_config = ConfigDict(extra="forbid")
    index: int = Field(ge=0)
    version: int = Field(ge=0)
    merges: int = Field(0, ge=0)
    tokens_merged: int = Field(0, ge=0)
    contributions: int = Field(0, ge=0)
    norms: list[float] = Field(default_factory=list)
    file: str = Field(pattern=r"^outer/fragment-\d{4}\.safetensors$")


class Manifest(BaseModel):
    """`ddiloco_checkpoint.json`: what a checkpoint holds. `format_version` changes with any
    change to the layout of a checkpoint directory."""

    model_config = ConfigDict(extra="forbid")
    format_version: Literal[1] = FORMAT_VERSION
    name: str
    created: str
    """UTC, ISO 8601."""
    global_version: int = Field(ge=0)
    layout: Layout
    model: ModelSpec
    fragments: list[FragmentEntry]


@dataclass
class FragmentSnapshot:
    """A copy of one fragment's served state, the synchronizer's locks let go of."""

    index: int
    version: int
    merges: int
    tokens_merged: int
    contributions: int
    norms: list[float]
    params: dict[str, torch.Tensor]
    momentum: dict[str, torch.Tensor]


@dataclass
class Checkpoint:
    """A whole checkpoint, as written or as read back."""

    layout: Layout
    model: ModelSpec
    fragments: list[FragmentSnapshot]
    name: str = ""
    source: str = ""

    @property
    def global_version(self) -> int:
        return sum(f.version for f in self.fragments)


@dataclass
class Outcome:
    """What one attempt did (tests, the log)."""

    name: str | None = None
    error: str | None = None
    deleted: list[str] = field(default_factory=list)


def shown(dest: str) -> str:
    """`dest` for the log: a URL's user and password, if it carries any, left out."""
    parts = urlsplit(dest)
    if parts.scheme and "@" in parts.netloc:
        return urlunsplit(parts._replace(netloc=parts.netloc.rsplit("@", 1)[1]))
    return dest


def _fs(dest: str) -> tuple[AbstractFileSystem, str]:
    from fsspec.core import url_to_fs

    return url_to_fs(dest)


def _is_local(fs: AbstractFileSystem) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


# ---- taking and writing ------------------------------------------------------------
def take_snapshot(sync: Synchronizer) -> Checkpoint | None:
    """A copy of every fragment's served (so durable) state, each copied under its own
    fragment lock and nothing else; None before init."""
    layout = sync.layout
    if layout is None:
        return None
    out = []
    for p in sync.owned:
        spec = layout.fragments[p]
        # the copies' memory made and faulted in first: a fresh buffer's page faults cost
        # several times the copy itself, and uploads and merges of p wait while it is held
        params = {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in spec.tensors}
        momentum = {t.name: torch.zeros(t.shape, dtype=torch.float32) for t in spec.tensors}
        frag = sync.fragments[p]
        with frag.lock:
            fs = frag.state
            for name, t in fs.params.items():
                params[name].copy_(t)
            for name, t in fs.momentum.items():
                momentum[name].copy_(t)
            meta = (fs.version, fs.merges, fs.tokens_merged, fs.contributions, list(fs.norms))
        out.append(FragmentSnapshot(p, *meta, params, momentum))
    return Checkpoint(layout, sync.model or ModelSpec(), out)


def checkpoint_name(global_version: int, now: float) -> str:
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now)) + f".{int(now % 1 * 1e6):06d}Z"
    return f"{stamp}-v{global_version:012d}"


def _stage(ckpt: Checkpoint, staging: Path, name: str, now: float) -> bytes:
    """Write the model directory and the outer state into `staging`; return the manifest
    (not written: the caller writes it last)."""
    from safetensors.torch import save_file

    params = {k: v for f in ckpt.fragments for k, v in f.params.items()}
    versions = [0] * len(ckpt.layout.fragments)
    for f in ckpt.fragments:
        versions[f.index] = f.version
    model = GlobalModel(params, versions, ckpt.model, name, ckpt.layout)
    write_model_dir(model, staging, need_tokenizer=False)
    (staging / OUTER).mkdir(exist_ok=True)
    entries = []
    for f in ckpt.fragments:
        rel = f"{OUTER}/fragment-{f.index:04d}.safetensors"
        tensors = {f"param/{k}": v.contiguous() for k, v in f.params.items()}
        tensors |= {f"momentum/{k}": v.contiguous() for k, v in f.momentum.items()}
        save_file(tensors, str(staging / rel), metadata={"format": "pt"})
        entries.append(
            FragmentEntry(
                index=f.index,
                version=f.version,
                merges=f.merges,
                tokens_merged=f.tokens_merged,
                contributions=f.contributions,
                norms=f.norms,
                file=rel,
            )
        )
    manifest = Manifest(
        name=name,
        created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(now)),
        global_version=ckpt.global_version,
        layout=ckpt.layout,
        model=ckpt.model,
        fragments=entries,
    )
    return (manifest.model_dump_json(indent=1) + "\n").encode()


def _fsync_tree(root: Path) -> None:
    for path in sorted(root.rglob("*")):
        if path.is_file():
            with open(path, "rb+") as f:
                os.fsync(f.fileno())
    for d in sorted({p.parent for p in root.rglob("*")} | {root}):
        _fsync_dir(d)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_local(ckpt: Checkpoint, root: Path, name: str, now: float) -> None:
    root.mkdir(parents=True, exist_ok=True)
    staging = root / f"{PARTIAL}{name}"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        manifest = _stage(ckpt, staging, name, now)
        (staging / MANIFEST).write_bytes(manifest)
        _fsync_tree(staging)
        os.replace(staging, root / name)  # whole, or not there
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    tmp = root / f".{LATEST}.tmp"
    tmp.write_text(name + "\n")
    with open(tmp, "rb+") as f:
        os.fsync(f.fileno())
    os.replace(tmp, root / LATEST)
    _fsync_dir(root)


def _write_remote(
    ckpt: Checkpoint, fs: AbstractFileSystem, root: str, name: str, now: float
) -> None:
    with tempfile.TemporaryDirectory(prefix="ddiloco-checkpoint-") as tmp:
        staging = Path(tmp)
        manifest = _stage(ckpt, staging, name, now)
        target = f"{root.rstrip('/')}/{name}"
        for path in sorted(staging.rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{target}/{path.relative_to(staging).as_posix()}")
    fs.pipe_file(f"{target}/{MANIFEST}", manifest)  # last: now the checkpoint is whole
    fs.pipe_file(f"{root.rstrip('/')}/{LATEST}", (name + "\n").encode())


def write_checkpoint(ckpt: Checkpoint, dest: str, keep: int, now: float | None = None) -> Outcome:
    """Write `ckpt` under `dest` (a directory or an fsspec URL), point `latest` at it, keep
    the newest `keep` checkpoints. Raises what the filesystem raised."""
    now = time.time() if now is None else now
    name = checkpoint_name(ckpt.global_version, now)
    fs, root = _fs(dest)
    if _is_local(fs):
        _write_local(ckpt, Path(root), name, now)
    else:
        _write_remote(ckpt, fs, root, name, now)
    return Outcome(name=name, deleted=prune(dest, keep))


def listed(dest: str) -> list[str]:
    """The checkpoint names under `dest`, oldest first (partial ones too)."""
    fs, root = _fs(dest)
    try:
        entries = fs.ls(root, detail=False, refresh=True) if not _is_local(fs) else None
    except FileNotFoundError:
        return []
    if entries is None:
        path = Path(root)
        names = [p.name for p in path.iterdir()] if path.is_dir() else []
    else:
        names = [str(e).rstrip("/").rsplit("/", 1)[-1] for e in entries]
    return sorted(n for n in names if NAME.match(n))


def prune(dest: str, keep: int) -> list[str]:
    """Keep the newest `keep` *whole* checkpoints under `dest` (those with a manifest) and
    delete the older ones, and every partial one older than the newest whole one (a failed
    upload never pushes out a checkpoint that can be read); return the names deleted. Only
    directories named like a checkpoint go."""
    names = listed(dest)
    fs, root = _fs(dest)
    whole = [n for n in names if fs.isfile(_join(root, f"{n}/{MANIFEST}"))]
    kept = set(whole[-keep:]) if keep > 0 else set()
    newest = whole[-1] if whole else None
    gone = [n for n in names if n not in kept and (n in whole or (newest and n < newest))]
    for name in gone:
        fs.rm(f"{root.rstrip('/')}/{name}", recursive=True)
    if _is_local(fs):  # a writer killed while staging (this one is done with its own)
        for staged in Path(root).glob(f"{PARTIAL}*"):
            shutil.rmtree(staged, ignore_errors=True)
    return gone


# ---- reading ---------------------------------------------------------------------------
def _join(root: str, name: str) -> str:
    return f"{root.rstrip('/')}/{name}"


def resolve(source: str) -> tuple[AbstractFileSystem, str, bool]:
    """(filesystem, path, is a checkpoint) of `source`: a checkpoint directory, a
    destination whose `latest` names one, or (False) a plain model directory."""
    try:
        fs, root = _fs(source)
    except (ValueError, ImportError) as e:
        raise CheckpointError(f"--init-from {source!r}: {e}") from None
    try:
        if fs.isfile(_join(root, MANIFEST)):
            return fs, root, True
        if fs.isfile(_join(root, LATEST)):
            name = fs.cat_file(_join(root, LATEST)).decode().strip()
            if not NAME.match(name):
                raise CheckpointError(
                    f"--init-from {source!r}: its {LATEST} names {name[:80]!r}, not a checkpoint"
                )
            return fs, _join(root, name), True
        if not fs.isdir(root):
            raise CheckpointError(f"--init-from {source!r} does not exist")
    except OSError as e:
        raise CheckpointError(f"--init-from {source!r} cannot be read: {e}") from None
    return fs, root, False


def _load_tensors(fs: AbstractFileSystem, path: str, what: str) -> dict[str, torch.Tensor]:
    from safetensors.torch import load

    try:
        return load(fs.cat_file(path))  # safetensors: no code runs
    except Exception as e:
        raise CheckpointError(f"{what}: {path} is not a readable safetensors file ({e})") from None


def check_source(source: str) -> None:
    """Refuse (`CheckpointError`) an `--init-from` that is not there, or a checkpoint whose
    manifest does not read, before the synchronizer starts (its tensors are read then)."""
    fs, path, is_checkpoint = resolve(source)
    if is_checkpoint:
        _manifest(fs, path, source)


def _manifest(fs: AbstractFileSystem, path: str, source: str) -> Manifest:
    try:
        return Manifest.model_validate_json(fs.cat_file(_join(path, MANIFEST)))
    except ValidationError as e:
        first = e.errors()[0]
        where = ".".join(str(x) for x in first.get("loc", ()))
        raise CheckpointError(
            f"--init-from {source!r}: {MANIFEST} is not a version-{FORMAT_VERSION} manifest "
            f"({where}: {first.get('msg')})"
        ) from None
    except OSError as e:
        raise CheckpointError(f"--init-from {source!r} cannot be read: {e}") from None


def read_checkpoint(source: str) -> Checkpoint:
    """The checkpoint at `source` (see `resolve`), checked against its own layout."""
    fs, path, is_checkpoint = resolve(source)
    if not is_checkpoint:
        raise CheckpointError(f"--init-from {source!r} holds no {MANIFEST}")
    manifest = _manifest(fs, path, source)
    specs = manifest.layout.fragments
    if sorted(f.index for f in manifest.fragments) != list(range(len(specs))):
        raise CheckpointError(f"--init-from {source!r}: its manifest lacks fragments")
    fragments = []
    for entry in sorted(manifest.fragments, key=lambda f: f.index):
        tensors = _load_tensors(fs, _join(path, entry.file), f"--init-from {source!r}")
        params = {k[6:]: v for k, v in tensors.items() if k.startswith("param/")}
        momentum = {k[9:]: v for k, v in tensors.items() if k.startswith("momentum/")}
        spec = specs[entry.index]
        for name, kind in ((params, "Theta"), (momentum, "momentum")):
            want = {t.name: tuple(t.shape) for t in spec.tensors}
            got = {k: tuple(v.shape) for k, v in name.items()}
            if got != want:
                raise CheckpointError(
                    f"--init-from {source!r}: fragment {entry.index}'s {kind} does not match "
                    "its layout"
                )
        fragments.append(
            FragmentSnapshot(
                entry.index,
                entry.version,
                entry.merges,
                entry.tokens_merged,
                entry.contributions,
                entry.norms,
                {k: v.float() for k, v in params.items()},
                {k: v.float() for k, v in momentum.items()},
            )
        )
    return Checkpoint(manifest.layout, manifest.model, fragments, manifest.name, source)


def read_model_params(source: str) -> dict[str, torch.Tensor]:
    """The tensors of the plain model directory `source` (model.safetensors, or the shards
    its model.safetensors.index.json names; never a pickle), by name."""
    from ddiloco.learner.weights import SAFETENSORS, SAFETENSORS_INDEX, WeightsError, find, tensors

    fs, root, _ = resolve(source)
    if _is_local(fs):
        try:
            weights = find(root)
        except WeightsError as e:
            raise CheckpointError(f"--init-from {source!r}: {e}") from None
        if weights is None:
            raise CheckpointError(f"--init-from {source!r} holds no weights ({SAFETENSORS})")
        return tensors(weights)
    what = f"--init-from {source!r}"
    if fs.isfile(_join(root, SAFETENSORS)):
        return _load_tensors(fs, _join(root, SAFETENSORS), what)
    if not fs.isfile(_join(root, SAFETENSORS_INDEX)):
        raise CheckpointError(f"{what} holds neither {MANIFEST} nor {SAFETENSORS}")
    try:
        files = sorted(set(json.loads(fs.cat_file(_join(root, SAFETENSORS_INDEX)))["weight_map"]))
    except (ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{what}: not a safetensors index ({e})") from None
    out: dict[str, torch.Tensor] = {}
    for name in files:
        if "/" in name or not name.endswith(".safetensors"):
            raise CheckpointError(f"{what}: its index names {name!r}, not a file beside it")
        out |= _load_tensors(fs, _join(root, name), what)
    return out


def check_params(params: dict[str, torch.Tensor], layout: Layout, source: str) -> str | None:
    """Why the learners' `layout` cannot start from `params` (None: it can)."""
    want = {t.name: tuple(t.shape) for f in layout.fragments for t in f.tensors}
    missing = sorted(set(want) - set(params))
    extra = sorted(set(params) - set(want))
    if missing or extra:
        return (
            f"the learners' model does not match --init-from {source}: it lacks {missing[:5]}"
            f" and has {extra[:5]} the learners' model does not"
        )
    for name, shape in want.items():
        if tuple(params[name].shape) != shape:
            return (
                f"the learners' model does not match --init-from {source}: {name} is "
                f"{list(params[name].shape)} there, {list(shape)} in the learners' model"
            )
    return None


# ---- the periodic writer ---------------------------------------------------------------
class Checkpointer:
    """The background thread that writes checkpoints when due (see the module docstring).

    `version()` is the global version now, `snapshot()` the copy to write (None before
    init); `written`/`failed` count attempts (the metric counts them too)."""

    def __init__(
        self,
        dest: str,
        *,
        every_versions: int,
        every_seconds: float,
        keep: int,
        version: Callable[[], int],
        snapshot: Callable[[], Checkpoint | None],
        counted: Callable[[str], None] = lambda outcome: None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.dest = dest
        self.every_versions = every_versions
        self.every_seconds = every_seconds
        self.keep = keep
        self._version = version
        self._snapshot = snapshot
        self._counted = counted
        self._clock = clock
        self.last_version = version()
        """The global version at the last attempt (or at start: the state we began from
        is not written again)."""
        self.last_time = clock()
        self.written = 0
        self.failed = 0
        self.last: Outcome | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddiloco-checkpoints", daemon=True)

    def start(self) -> Checkpointer:
        self._thread.start()
        return self

    def due(self) -> bool:
        """A period has passed since the last attempt, and something was merged since."""
        moved = self._version() - self.last_version
        if moved <= 0:
            return False
        if self.every_versions and moved >= self.every_versions:
            return True
        return bool(self.every_seconds) and self._clock() - self.last_time >= self.every_seconds

    def attempt(self) -> Outcome:
        """Write one checkpoint now; never raises (a failure is logged and counted)."""
        self.last_time = self._clock()
        try:
            ckpt = self._snapshot()
            if ckpt is None:
                return Outcome(error="not initialized")
            self.last_version = ckpt.global_version
            t0 = time.monotonic()
            out = write_checkpoint(ckpt, self.dest, self.keep)
        except Exception as e:  # any filesystem's error: the merges go on, retried later
            self.failed += 1
            self._counted("failed")
            first = (str(e).splitlines() or [""])[0][:500]
            log.error(
                "Checkpoint to %s failed (retried in the next period): %s: %s",
                shown(self.dest),
                type(e).__name__,
                first,
            )
            self.last = Outcome(error=f"{type(e).__name__}: {first}")
            return self.last
        self.written += 1
        self._counted("written")
        log.info(
            "Checkpoint %s written to %s in %.1fs (global version %d)%s",
            out.name,
            shown(self.dest),
            time.monotonic() - t0,
            ckpt.global_version,
            f"; deleted {', '.join(out.deleted)}" if out.deleted else "",
        )
        self.last = out
        return out

    def _run(self) -> None:
        while not self._stop.wait(TICK_S):
            if self.due():
                self.attempt()

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()


def counted_by(metrics: Any) -> Callable[[str], None]:
    """The `Checkpointer`'s `counted` for a `SyncMetrics`."""
    return lambda outcome: metrics.checkpoints.labels(outcome).inc()


# ---- starting a job from a checkpoint ----------------------------------------------------
ORIGIN: Final = "init-from.json"
"""In the state dir: the `--init-from` the job started from, written before layout.json (a
refusal at join names it, after restarts too)."""


def origin(state_dir: Path) -> str | None:
    """The `--init-from` this state dir started from (None: a learner's init upload)."""
    from ddiloco.synchronizer.storage.records import load_json

    path = Path(state_dir) / ORIGIN
    return str(load_json(path, "source")) if path.is_file() else None


def save_origin(state_dir: Path, source: str) -> None:
    from ddiloco.synchronizer.storage.records import save_json

    save_json(Path(state_dir) / ORIGIN, "source", shown(source))


def start_from(sync: Synchronizer, source: str) -> None:
    """A fresh state dir and `--init-from source`: initialize from a checkpoint now, or keep
    a plain model directory's parameters for the first init upload (`seeded`)."""
    from ddiloco.synchronizer.storage.state import FragmentState

    _, _, is_checkpoint = resolve(source)
    if not is_checkpoint:
        sync.seed = read_model_params(source)
        log.info(
            "Waiting for the first learner's layout to start from the model directory %s "
            "(%d tensors)",
            shown(source),
            len(sync.seed),
        )
        return
    ckpt = read_checkpoint(source)
    fragments = [
        FragmentState(
            params=f.params,
            momentum=f.momentum,
            version=f.version,
            merges=f.merges,
            tokens_merged=f.tokens_merged,
            contributions=f.contributions,
            norms=list(f.norms),  # not the high-water marks: those are the old job's learners
        )
        for f in ckpt.fragments
    ]
    save_origin(sync.store.root, source)
    sync.initialize(ckpt.layout, ckpt.model, fragments)
    log.info(
        "Started from checkpoint %s of %s: versions %s",
        ckpt.name,
        shown(source),
        [f.version for f in ckpt.fragments],
    )


def seeded(sync: Synchronizer, layout: Layout) -> list[Any]:
    """The version-0 fragments of the first learner's `layout` holding the parameters of
    `--init-from`'s model directory (momentum zero); a `SyncError` (409) naming the
    directory if the learners' model is not its model."""
    from ddiloco.synchronizer import admission
    from ddiloco.wire.errors import Refusal, SyncError

    assert sync.seed is not None and sync.settings.init_from is not None
    why = check_params(sync.seed, layout, shown(sync.settings.init_from))
    if why is not None:
        raise SyncError(Refusal.CONFLICT, why)
    save_origin(sync.store.root, sync.settings.init_from)
    return admission.initial_fragments(layout, sync.seed)
