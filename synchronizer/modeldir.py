"""A model directory written from the job's global parameters, held in memory.

    write_model_dir(GlobalModel(params, versions, spec, "where from"), "out/")
    AutoModelForCausalLM.from_pretrained("out/")       # the directory of an hf: job

Shared by `ddiloco export` (cli/export.py, which reads the parameters from a state dir or a
live synchronizer) and the synchronizer's periodic checkpoints (synchronizer/checkpoints.py,
which copies them from its own fragments). What is written into OUT, by the model spec's
kind (the init upload's `ModelSpec`, learner/hf.py `model_spec`):

- hf: `save_pretrained` of the config's model holding the global parameters (config.json,
  generation_config.json, model.safetensors with exactly the names `from_pretrained`
  expects: a tied output head is not written twice), then the tokenizer files the spec
  carried (or the `tokenizer` directory's), so `AutoTokenizer.from_pretrained(OUT)` loads too.
- gpt (a preset): model.safetensors of `GPT.state_dict()` (the tied head once, as
  wte.weight) and config.json naming the preset (`ddiloco_model`) with its GPTConfig fields:
  `GPT(GPTConfig(**fields)).load_state_dict(safetensors.torch.load_file(...))`.
- a model entry, or a job whose init said nothing: model.safetensors of the parameters by
  name, and config.json naming the entry.

Every one of these is a directory `--init-from` loads (learner/weights.py). Problems are a
`ModelDirError`, one line naming what is wrong.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from ddiloco.wire.protocol import Layout, ModelSpec

log = logging.getLogger(__name__)

_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


class ModelDirError(ValueError):
    """Why the model directory could not be written (one line for the user)."""


@dataclass
class GlobalModel:
    """The job's global parameters, as the synchronizer holds them."""

    params: dict[str, torch.Tensor]
    versions: list[int]
    spec: ModelSpec
    source: str
    layout: Layout | None = None
    """The layout (from a state dir or a checkpoint; None from a live synchronizer)."""


def _load_into(model: nn.Module, params: dict[str, torch.Tensor], what: str) -> None:
    named = dict(model.named_parameters())
    missing, extra = sorted(set(named) - set(params)), sorted(set(params) - set(named))
    if missing or extra:
        raise ModelDirError(
            f"the global parameters do not match {what}: missing {missing[:5]}, "
            f"unexpected {extra[:5]}"
        )
    with torch.no_grad():
        for name, p in named.items():
            t = params[name]
            if tuple(t.shape) != tuple(p.shape):
                raise ModelDirError(
                    f"{name} is {list(t.shape)} globally, {list(p.shape)} in {what}"
                )
            p.copy_(t.to(p.dtype))


def _write_hf(model: GlobalModel, out: Path, tokenizer: str | None, need_tokenizer: bool) -> None:
    from ddiloco.learner import hf

    spec = model.spec
    files = dict(spec.files)
    if spec.tokenizer_omitted and tokenizer is None:
        if need_tokenizer:
            raise ModelDirError(
                "the job's tokenizer was too large for the synchronizer to keep: give "
                "--tokenizer PATH (the learners' tokenizer directory)"
            )
        log.warning("Writing %s without the tokenizer (the synchronizer did not keep it)", out)
    (out / "config.json").write_text(json.dumps(spec.config, indent=2))
    try:
        config = hf.load_config(f"hf:{out}")
    except (OSError, ValueError, KeyError) as e:
        raise ModelDirError(f"the job's config.json does not load: {e}") from None
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # one line of output, not a bar per shard
    with torch.random.fork_rng():  # the init is overwritten; seeded only to be reproducible
        torch.manual_seed(0)
        net = hf.from_config(config)
    _load_into(net, model.params, f"the {spec.name} config's model")
    net.save_pretrained(str(out))
    if tokenizer is not None:
        given = hf.tokenizer_files(tokenizer)
        if not given:
            raise ModelDirError(f"--tokenizer {tokenizer!r} holds no tokenizer files")
        files = {k: v for k, v in files.items() if k == "generation_config.json"} | given
    for name, text in files.items():
        if not _PLAIN_NAME.match(name):  # also validated by ModelSpec: never a path
            raise ModelDirError(f"the model spec names a file {name!r} that is not a plain name")
        (out / name).write_text(text)


def _write_gpt(model: GlobalModel, out: Path) -> None:
    from safetensors.torch import save_file

    from ddiloco.learner.model import GPT, PRESETS, GPTConfig

    spec = model.spec
    try:
        config = GPTConfig(**spec.config) if spec.config else PRESETS[spec.name]
    except (TypeError, ValueError, KeyError) as e:
        raise ModelDirError(f"the job's GPT config {spec.name!r} is not usable: {e}") from None
    net = GPT(config)
    _load_into(net, model.params, f"the {spec.name!r} GPT")
    state = {k: v.detach().contiguous() for k, v in net.state_dict().items()}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    fields = {k: getattr(config, k) for k in config.__dataclass_fields__}
    (out / "config.json").write_text(
        json.dumps({"ddiloco_model": spec.name, "kind": "gpt", **fields}, indent=2)
    )


def _write_plain(model: GlobalModel, out: Path) -> None:
    from safetensors.torch import save_file

    state = {k: v.detach().float().contiguous() for k, v in sorted(model.params.items())}
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    spec = model.spec
    (out / "config.json").write_text(
        json.dumps({"ddiloco_model": spec.name, "kind": spec.kind}, indent=2)
    )


def write_model_dir(
    model: GlobalModel,
    out: str | os.PathLike[str],
    tokenizer: str | None = None,
    *,
    need_tokenizer: bool = True,
) -> Path:
    """Write ``model`` into the directory ``out`` (created if missing; see the module
    docstring). ``tokenizer``: a tokenizer directory to write instead of the spec's files.
    ``need_tokenizer`` False writes an hf model whose tokenizer the spec omitted without
    one (a checkpoint: the learners have it) instead of refusing."""
    path = Path(out)
    if path.exists() and not path.is_dir():
        raise ModelDirError(f"{str(path)!r} exists and is not a directory")
    path.mkdir(parents=True, exist_ok=True)
    kind = model.spec.kind
    if kind == "hf":
        _write_hf(model, path, tokenizer, need_tokenizer)
    elif kind == "gpt":
        _write_gpt(model, path)
    else:
        _write_plain(model, path)
    return path
