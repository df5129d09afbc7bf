"""`ddiloco export`: the trained global model out of a job, as safetensors.

    ddiloco export --state-dir runs/local-x/state --out model/
    DDILOCO_TOKEN=s3cret ddiloco export --sync-url http://127.0.0.1:8470 --out model/
    AutoModelForCausalLM.from_pretrained("model/")      # the export of an hf: job

The job's model is what its first learner said at init: the init upload's metadata carries a
`ModelSpec` (learner/hf.py `model_spec`: the preset, or the hf config.json and tokenizer
files), which the synchronizer keeps as model.json in its state dir and serves at
`GET /v1/model`. What is written into OUT, by the spec's kind (synchronizer/modeldir.py,
which the synchronizer's checkpoints write with too):

- hf: `save_pretrained` of the config's model holding the global parameters (config.json,
  generation_config.json, model.safetensors with exactly the names `from_pretrained`
  expects: a tied output head is not written twice), then the tokenizer files the spec
  carried (or `--tokenizer PATH`'s), so `AutoTokenizer.from_pretrained(OUT)` loads too.
- gpt (a preset): model.safetensors of `GPT.state_dict()` (the tied head once, as
  wte.weight) and config.json naming the preset (`ddiloco_model`) with its GPTConfig fields:
  `GPT(GPTConfig(**fields)).load_state_dict(safetensors.torch.load_file(...))`.
- a model entry, or a job whose init said nothing: model.safetensors of the parameters by
  name, and config.json naming the entry.

Every export also writes ddiloco_export.json: its source, the fragment versions and the
spec's name. From a state dir it reads layout.json and fragment-NNNN.safetensors (the
`param/` tensors, float32); a running synchronizer replaces those atomically, so a live
state dir reads fine. From `--sync-url` (the job key, from DDILOCO_TOKEN or `--token-file`)
it GETs /v1/status, /v1/model and each fragment's Theta in float32 in turn
(`GET /v1/fragments/{p}/float32`), each at its latest version: the same bits a state-dir
export writes, whatever encoding the synchronizer broadcasts to learners (bfloat16 by
default). A learner's or evaluator's credential is refused there (403). A sharded
synchronizer: `--state-dir` and `--sync-url` take every shard's, comma-separated (each
fragment is read from its owner). Errors are one line, `ddiloco export: error: ...`, with
exit status 2.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import torch

from ddiloco.synchronizer.modeldir import GlobalModel, ModelDirError, write_model_dir
from ddiloco.wire.protocol import ModelSpec

__all__ = ["ExportError", "GlobalModel", "from_shard_dirs", "from_state_dir", "main", "write"]

PROG = "ddiloco export"


class ExportError(ModelDirError):
    """Why the export could not be written (one line for the user)."""


def from_shard_dirs(paths: list[str]) -> GlobalModel:
    """The global model in a sharded synchronizer's state directories (any order): each
    fragment from the directory of the shard that owns it (synchronizer/shards.py)."""
    from ddiloco.wire.protocol import shard_map

    models = [from_state_dir(p, shard_ok=True) for p in paths]
    owners: dict[int, GlobalModel] = {}
    for path, m in zip(paths, models, strict=True):
        from ddiloco.synchronizer.storage.state import StateStore

        info = StateStore(Path(path)).load("shard.json") or {}
        assert m.layout is not None
        for p, s in enumerate(shard_map(m.layout, int(info["shards"]))):
            if s == int(info["shard"]):
                owners[p] = m
    layout = models[0].layout
    assert layout is not None
    missing = [p for p in range(len(layout.fragments)) if p not in owners]
    if missing:
        raise ExportError(f"no state dir given owns fragments {missing}: give every shard's")
    params: dict[str, torch.Tensor] = {}
    for p in range(len(layout.fragments)):
        names = {t.name for t in layout.fragments[p].tensors}
        params |= {k: v for k, v in owners[p].params.items() if k in names}
    versions = [owners[p].versions[p] for p in range(len(layout.fragments))]
    return GlobalModel(params, versions, models[0].spec, ",".join(m.source for m in models))


def from_state_dir(path: str | os.PathLike[str], *, shard_ok: bool = False) -> GlobalModel:
    """The global model in a synchronizer's state directory (a comma list: a sharded
    synchronizer's, `from_shard_dirs`)."""
    from ddiloco.synchronizer.replay import recovered
    from ddiloco.synchronizer.storage.state import StateStore
    from ddiloco.wire.protocol import shard_map

    if "," in str(path):
        return from_shard_dirs([p.strip() for p in str(path).split(",")])
    root = Path(path)
    if not root.is_dir():
        raise ExportError(f"state dir {str(root)!r} does not exist")
    if not (root / "layout.json").is_file():
        raise ExportError(
            f"no layout.json in {str(root)!r}: no learner has initialized this job yet"
        )
    store = StateStore(root)
    try:
        layout = store.load_layout()
        assert layout is not None
        info = store.load("shard.json") or {}
        shards = int(info.get("shards", 1))
        if shards > 1 and not shard_ok:
            raise ExportError(
                f"{str(root)!r} is shard {info.get('shard')} of {shards}: give every shard's "
                "state dir, comma-separated"
            )
        owners = shard_map(layout, shards)
        fragments = [  # with the merges its journal holds and its file not yet
            recovered(store, f) if owners[f.index] == int(info.get("shard", 0)) else None
            for f in layout.fragments
        ]
        spec = store.load_model() or ModelSpec()
    except (OSError, ValueError) as e:
        raise ExportError(f"cannot read the state in {str(root)!r}: {e}") from None
    params = {k: v for fs in fragments if fs is not None for k, v in fs.params.items()}
    versions = [fs.version if fs is not None else 0 for fs in fragments]
    return GlobalModel(params, versions, spec, str(root.resolve()), layout)


BUSY_WAIT_S = 60.0
"""How long a fragment's float32 read is asked again while the synchronizer answers 503
(another read of that fragment is being encoded)."""


def exact_fragment(client: Any, p: int) -> tuple[int, dict[str, torch.Tensor]]:
    """Fragment p's float32 Theta and version from `client` (a SyncClient or ShardClients),
    asked again each second while it answers 503, for `BUSY_WAIT_S` at most."""
    from ddiloco.learner.sync_client import SyncUnavailable

    deadline = time.monotonic() + BUSY_WAIT_S
    while True:
        try:
            return client.exact_fragment(p)
        except SyncUnavailable as e:
            if e.status != 503 or time.monotonic() >= deadline:
                raise
        time.sleep(1.0)


def from_synchronizer(url: str, token: Any, tls: Any = None) -> GlobalModel:
    """The global model a live synchronizer holds (GET /v1/status, /v1/model, and each
    fragment's float32 Theta): exact, as a state-dir export's."""
    from ddiloco.learner.shard_clients import ShardClients
    from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable

    urls = [u.strip() for u in url.split(",")]
    for one in urls:
        if not re.match(r"^https?://[^/\s]+", one):
            raise ExportError(f"--sync-url {one!r} is not an http:// or https:// URL")
    client: Any = (
        SyncClient(url, token, tls=tls, timeout=120.0)
        if len(urls) == 1
        else ShardClients(urls, token, tls=tls, timeout=120.0)
    )
    try:
        status = client.status()
        if not status.initialized:
            raise ExportError(f"{url} holds no global model yet: no learner has initialized it")
        spec = client.model_spec()
        params: dict[str, torch.Tensor] = {}
        versions = []
        for f in status.fragments:
            version, tensors = exact_fragment(client, f.index)
            versions.append(version)
            params |= tensors
    except SyncRefused as e:
        if e.status == 401:
            raise ExportError(f"{url} refused the token (401): check DDILOCO_TOKEN") from None
        if e.status == 403:
            raise ExportError(
                f"{url} refused: {e}: --sync-url needs the job key (DDILOCO_TOKEN), not a "
                "learner's or evaluator's credential"
            ) from None
        raise ExportError(f"{url} refused: {e}") from None
    except SyncUnavailable as e:
        raise ExportError(f"cannot reach the synchronizer at {url}: {e}") from None
    finally:
        client.close()
    return GlobalModel(params, versions, spec, url)


def write(model: GlobalModel, out: str | os.PathLike[str], tokenizer: str | None = None) -> Path:
    """Write ``model`` into the directory ``out`` (modeldir.py), and ddiloco_export.json."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ExportError(f"--out {str(path)!r} exists and is not a directory")
    write_model_dir(model, path, tokenizer)
    kind = model.spec.kind
    info = {
        "source": model.source,
        "model": model.spec.name,
        "kind": kind,
        "tokenizer": model.spec.tokenizer,
        "versions": model.versions,
        "global_version": sum(model.versions),
        "parameters": sum(t.numel() for t in model.params.values()),
    }
    (path / "ddiloco_export.json").write_text(json.dumps(info, indent=2) + "\n")
    return path


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        prog=PROG, description="Write a job's global model out as safetensors."
    )
    source = ap.add_mutually_exclusive_group(required=True)
    source.add_argument("--state-dir", help="the synchronizer's state directory")
    source.add_argument("--sync-url", help="a live synchronizer (the job key: DDILOCO_TOKEN)")
    ap.add_argument("--out", required=True, help="directory to write (created if missing)")
    ap.add_argument("--token-file", help="file holding the job token (instead of DDILOCO_TOKEN)")
    ap.add_argument("--ca-file", help="PEM CA of an https synchronizer")
    ap.add_argument("--client-cert", help="PEM client certificate (mutual TLS)")
    ap.add_argument("--client-key", help="PEM key of --client-cert")
    ap.add_argument(
        "--tokenizer", help="tokenizer directory to write beside an hf model (default: the job's)"
    )
    return ap.parse_args(argv)


def _token(args: argparse.Namespace) -> Any:
    from ddiloco.wire.auth import StaticTokens, TokenFile

    if args.token_file:
        try:
            return TokenFile(args.token_file)
        except (OSError, ValueError) as e:
            raise ExportError(str(e)) from None
    token = os.environ.get("DDILOCO_TOKEN", "")
    if not token.strip():
        raise ExportError("no token for --sync-url: set DDILOCO_TOKEN or give --token-file")
    return StaticTokens(token)


def run(args: argparse.Namespace) -> GlobalModel:
    if args.state_dir:
        model = from_state_dir(args.state_dir)
    else:
        from ddiloco.wire.tls import ClientTLS

        if (args.client_cert is None) != (args.client_key is None):
            raise ExportError("give both --client-cert and --client-key, or neither")
        tls = ClientTLS(args.ca_file, args.client_cert, args.client_key)
        model = from_synchronizer(args.sync_url, _token(args), tls)
    write(model, args.out, args.tokenizer)
    return model


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    try:
        model = run(args)
    except ModelDirError as e:  # ExportError among them
        sys.stderr.write(f"{PROG}: error: {e}\n")
        return 2
    except Exception as e:  # never a traceback: one line that says what failed
        first = (str(e).splitlines() or [""])[0][:500]  # an exception may say nothing
        sys.stderr.write(f"{PROG}: error: {type(e).__name__}: {first}\n")
        return 2
    n = sum(t.numel() for t in model.params.values())
    sys.stdout.write(
        f"{PROG}: wrote {args.out} ({model.spec.kind} model {model.spec.name or '?'}, "
        f"{n:,} parameters, fragment versions {model.versions})\n"
    )
    return 0
