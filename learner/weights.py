"""A job's starting weights: pretrained ``hf:DIR`` weights and ``--init-from DIR``, safetensors only.

    w = find("/models/llama-1b")            # Weights (model.safetensors or its index), or None
    net = load_hf(config, w)                 # an hf model of `config` holding exactly those
    load_params(gpt, find(export_dir))       # a GPT preset (or a model entry's model) in place
    check("tiny", None, "/runs/x/export")    # the CLIs' checks, before anything starts

Where weights come from (learner/hf.py ``build_model``, learner/task.py ``build_task``):

- ``--model hf:DIR``: DIR's own weights when it holds any, else a seeded random init.
- ``--init-from DIR`` (any model): DIR's weights, in place of the random init (and of an
  ``hf:`` directory's own). DIR is a model directory: a previous job's ``ddiloco export``
  (cli/export.py: for an hf: job a ``save_pretrained`` directory; for a GPT preset
  ``model.safetensors`` of ``GPT.state_dict()`` and a ``config.json`` naming the preset), or
  a Hugging Face snapshot.

Every learner builds its model from the same file, so they all start from the same
parameters; the first to join uploads them as the job's initial model (learner/diloco.py
``_initial`` hands the synchronizer the model's parameters as built).

Only safetensors are read: ``model.safetensors``, or shards with
``model.safetensors.index.json``. Pickle weights (``pytorch_model*.bin``, ``*.pt``,
``*.pth``, ``*.ckpt``) are refused by name and never opened, since unpickling a file runs
code from it; a directory holding other ``*.safetensors`` only (an adapter, a framework's own
layout) is refused too, rather than silently trained from a random init.

The weights must be the job's model exactly: every parameter present with its shape, and no
tensor the model lacks. For an hf: model they load through ``from_pretrained`` (safetensors
only, no hub, no remote code), which knows each architecture's checkpoint names and ties the
output head to the input embedding when the config ties them (a tied head is stored once);
its report of missing, unexpected and mismatched tensors is then refused by the first
tensor it names. ``--init-from`` also compares configs: an hf config must equal the job's in
every key but bookkeeping, training-only and context-length ones (``CONFIG_KEYS_IGNORED``;
the job may train shorter windows, and a learned position table is checked by its shape); a
GPT export's fields must be the preset's. Every refusal is a ``WeightsError``: one line,
exit 2 from the CLIs (cli/errors.py).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch
from torch import nn

from ddiloco.cli.errors import UsageError

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel

    from ddiloco.learner.model import GPTConfig

log = logging.getLogger(__name__)

SAFETENSORS: Final = "model.safetensors"
SAFETENSORS_INDEX: Final = "model.safetensors.index.json"
SHARD_GLOB: Final = "model-*-of-*.safetensors"
PICKLE_GLOBS: Final = ("pytorch_model*.bin", "*.pt", "*.pth", "*.ckpt")
"""Weights files that are pickles: refused by name, never opened."""
CONFIG_KEYS_IGNORED: Final = frozenset(
    {
        # bookkeeping
        "_name_or_path",
        "_commit_hash",
        "architectures",
        "transformers_version",
        "dtype",
        "torch_dtype",
        "tokenizer_class",
        # inference and output switches
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
        "attn_implementation",
        "_attn_implementation",
        # token ids (the tokenizer's business) and classification heads
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "sep_token_id",
        "decoder_start_token_id",
        "id2label",
        "label2id",
        "problem_type",
        # training-only: the init (overwritten) and dropout
        "initializer_range",
        "attention_dropout",
        "hidden_dropout",
        "dropout",
        "resid_pdrop",
        "embd_pdrop",
        "attn_pdrop",
        # context length: a job may train shorter windows (learned tables: their shapes)
        "max_position_embeddings",
        "n_positions",
        "n_ctx",
        "seq_length",
    }
)
"""hf config keys ``--init-from`` may differ in from the job's config: they change neither
the tensors nor the function they compute."""
GPT_FIELDS_IGNORED: Final = frozenset({"dropout"})
"""GPTConfig fields an ``--init-from`` export may differ in (training-only)."""


class WeightsError(UsageError, ValueError):
    """Weights that cannot start this job: one line naming the file or tensor and why."""


@dataclass(frozen=True)
class Weights:
    """The safetensors weights of a model directory."""

    directory: Path
    files: tuple[Path, ...]
    """``model.safetensors``, or the shards the index names (in name order)."""
    index: Path | None = None
    """``model.safetensors.index.json`` of sharded weights."""

    @property
    def shown(self) -> str:
        """The file to name in logs and errors: the single file, else the index."""
        return str(self.index or self.files[0])


def find(directory: str | Path) -> Weights | None:
    """The safetensors weights in ``directory``, or None when it holds no weights at all.

    Raises WeightsError for pickle weights without safetensors, shards without their index
    (or an index naming a shard that is not there), and other ``*.safetensors`` only."""
    d = Path(directory).expanduser()
    if not d.is_dir():
        raise WeightsError(f"{str(d)!r} is not a model directory")
    single = d / SAFETENSORS
    if single.is_file():
        return Weights(d, (single,))
    index = d / SAFETENSORS_INDEX
    if index.is_file():
        return Weights(d, _shards(index), index)
    shards = sorted(d.glob(SHARD_GLOB))
    if shards:
        raise WeightsError(
            f"{shards[0]}: sharded safetensors without {SAFETENSORS_INDEX} beside them; write "
            "the index (save_pretrained does) or merge the shards into model.safetensors"
        )
    pickles = sorted({p for pattern in PICKLE_GLOBS for p in d.glob(pattern) if p.is_file()})
    if pickles:
        raise WeightsError(
            f"{pickles[0]}: pickle weights, which ddiloco does not load (unpickling runs code "
            "from the file); convert them to safetensors (model.safetensors, e.g. "
            "save_pretrained(DIR, safe_serialization=True)) and give the directory again"
        )
    others = sorted(d.glob("*.safetensors"))
    if others:
        raise WeightsError(
            f"{others[0]}: not a model's weights file; give {SAFETENSORS}, or shards "
            f"model-0000x-of-0000y.safetensors with {SAFETENSORS_INDEX}"
        )
    return None


def _shards(index: Path) -> tuple[Path, ...]:
    try:
        weight_map = json.loads(index.read_text())["weight_map"]
        names = sorted({str(v) for v in weight_map.values()})
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise WeightsError(f"{index}: not a safetensors index ({type(e).__name__}: {e})") from None
    files = []
    for name in names:
        if Path(name).name != name or not name.endswith(".safetensors"):
            raise WeightsError(f"{index}: names {name!r}, not a .safetensors file beside it")
        path = index.parent / name
        if not path.is_file():
            raise WeightsError(f"{index}: names {name}, which is not in {index.parent}")
        files.append(path)
    if not files:
        raise WeightsError(f"{index}: names no weights file")
    return tuple(files)


def shapes(weights: Weights) -> dict[str, tuple[int, ...]]:
    """Every tensor's name and shape, read from the files' headers (no tensor data)."""
    from safetensors import safe_open

    out: dict[str, tuple[int, ...]] = {}
    for path in weights.files:
        try:
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                    out[key] = tuple(f.get_slice(key).get_shape())
        except Exception as e:  # a corrupt or truncated file: one line naming it
            raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def tensors(weights: Weights) -> dict[str, torch.Tensor]:
    """Every tensor of the files, on the CPU (safetensors: no code runs)."""
    from safetensors.torch import load_file

    out: dict[str, torch.Tensor] = {}
    for path in weights.files:
        try:
            out |= load_file(str(path), device="cpu")
        except Exception as e:
            raise WeightsError(f"{path}: not a readable safetensors file ({e})") from None
    return out


def mismatch(
    expected: Mapping[str, tuple[int, ...]],
    found: Mapping[str, tuple[int, ...]],
    tolerated: set[str] | frozenset[str] = frozenset(),
) -> str | None:
    """The first difference between the model's tensors (``expected``, in the model's order)
    and a file's (``found``), as words, or None when they match. ``tolerated``: names the
    file may hold beyond ``expected`` (aliases of tied parameters, buffers)."""
    for name, shape in expected.items():
        if name not in found:
            return f"tensor {name} {list(shape)} of the model is not in the file"
        if tuple(found[name]) != tuple(shape):
            return f"tensor {name} is {list(found[name])} in the file, {list(shape)} in the model"
    extra = sorted(set(found) - set(expected) - set(tolerated))
    if extra:
        return f"tensor {extra[0]} of the file is not in the model"
    return None


def load_params(model: nn.Module, weights: Weights) -> None:
    """Copy the file's tensors into ``model``'s parameters (a GPT preset, a model entry's
    model), in place, on whatever device they are. The file must hold every parameter by its
    ``named_parameters()`` name and shape, and nothing else but other ``state_dict`` names
    (a tied alias, a buffer: not loaded). WeightsError names the first mismatched tensor."""
    named = dict(model.named_parameters())
    expected = {k: tuple(p.shape) for k, p in named.items()}
    tolerated = set(model.state_dict()) - set(named)
    if (why := mismatch(expected, shapes(weights), tolerated)) is not None:
        raise WeightsError(f"{weights.shown} does not match the job's model: {why}")
    loaded = tensors(weights)
    with torch.no_grad():
        for name, p in named.items():
            p.copy_(loaded[name].to(dtype=p.dtype))


def load_hf(config: PretrainedConfig, weights: Weights) -> PreTrainedModel:
    """``AutoModelForCausalLM`` of ``config`` holding ``weights``, float32, in train mode.

    ``from_pretrained`` from the weights' directory with the job's config: safetensors only,
    local files only, no remote code. Anything it would have left randomly initialized or
    could not place (a missing, unexpected or mismatched tensor) is refused, naming the
    first in the model's order."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    verbosity, bar = hf_logging.get_verbosity(), hf_logging.is_progress_bar_enabled()
    hf_logging.set_verbosity_error()  # its load report and bars: the refusal below says it
    hf_logging.disable_progress_bar()
    try:
        net, info = AutoModelForCausalLM.from_pretrained(
            str(weights.directory),
            config=config,
            dtype=torch.float32,
            use_safetensors=True,
            local_files_only=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,  # reported below, by name, instead of a traceback
        )
    except (OSError, ValueError, RuntimeError, KeyError, TypeError) as e:
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raise WeightsError(
            f"{weights.shown}: cannot load it into the job's model: {first}"
        ) from None
    finally:
        hf_logging.set_verbosity(verbosity)
        if bar:
            hf_logging.enable_progress_bar()
    if (why := _loading_problem(net, info)) is not None:
        raise WeightsError(f"{weights.shown} does not match the job's model: {why}")
    return net.train()


def _loading_problem(net: nn.Module, info: Mapping[str, object]) -> str | None:
    """The first problem ``from_pretrained``'s loading info reports, in the model's order."""
    state = net.state_dict()
    order = {name: i for i, name in enumerate(state)}
    problems: list[tuple[int, str]] = []
    for name, stored, wanted in info.get("mismatched_keys") or ():  # type: ignore[attr-defined]
        why = f"tensor {name} is {list(stored)} in the file, {list(wanted)} in the model"
        problems.append((order.get(name, -1), why))
    for name in info.get("missing_keys") or ():  # type: ignore[attr-defined]
        shape = f" {list(state[name].shape)}" if name in state else ""
        problems.append(
            (order.get(name, -1), f"tensor {name}{shape} of the model is not in the file")
        )
    if problems:
        return min(problems)[1]
    unexpected = sorted(info.get("unexpected_keys") or ())  # type: ignore[call-overload]
    if unexpected:
        return f"tensor {unexpected[0]} of the file is not in the model"
    errors = list(info.get("error_msgs") or ())  # type: ignore[call-overload]
    return str(errors[0]).splitlines()[0] if errors else None


# ---- --init-from: the directory and its config against the job's model -------------------
def init_dir(init_from: str | Path) -> Path:
    """``--init-from``'s directory, which must exist and hold safetensors weights."""
    d = Path(init_from).expanduser()
    if not d.is_dir():
        raise WeightsError(f"--init-from {str(d)!r}: no such directory (give a model directory)")
    return d


def init_weights(init_from: str | Path) -> Weights:
    """The weights of ``--init-from``'s directory; WeightsError when it holds none."""
    d = init_dir(init_from)
    found = find(d)
    if found is None:
        raise WeightsError(
            f"--init-from {str(d)!r}: no {SAFETENSORS} (or {SAFETENSORS_INDEX}) there; give a "
            "`ddiloco export` or save_pretrained directory"
        )
    return found


def _config_json(d: Path) -> dict[str, object] | None:
    path = d / "config.json"
    if not path.is_file():
        return None
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise WeightsError(f"{path}: not a JSON config ({e})") from None
    if not isinstance(raw, dict):
        raise WeightsError(f"{path}: not a JSON object")
    return raw


def check_hf_config(job: PretrainedConfig, init_from: str | Path) -> None:
    """Refuse an ``--init-from`` directory whose config is not the job's hf model (its
    ``model_type``, then the first key that differs outside ``CONFIG_KEYS_IGNORED``)."""
    from transformers import AutoConfig

    d = init_dir(init_from)
    raw = _config_json(d)
    if raw is None:
        raise WeightsError(f"--init-from {str(d)!r}: no config.json there to check against the job")
    if "model_type" not in raw:
        kind = f"a {raw.get('kind')} model {raw.get('ddiloco_model')!r}" if "kind" in raw else ""
        raise WeightsError(
            f"--init-from {str(d)!r} holds {kind or 'no Hugging Face config'}, not the job's "
            f"{job.model_type} model"
        )
    if raw["model_type"] != job.model_type:
        raise WeightsError(
            f"--init-from {str(d)!r} is not the job's model: model_type is "
            f"{raw['model_type']!r} there, {job.model_type!r} in the job"
        )
    try:
        theirs = AutoConfig.from_pretrained(str(d), local_files_only=True).to_dict()
    except (OSError, ValueError, KeyError) as e:
        raise WeightsError(f"{d / 'config.json'}: does not load ({e})") from None
    ours = job.to_dict()
    for key in [*ours, *(k for k in theirs if k not in ours)]:
        if key in CONFIG_KEYS_IGNORED:
            continue
        if ours.get(key) != theirs.get(key):
            raise WeightsError(
                f"--init-from {str(d)!r} is not the job's model: {key} is "
                f"{theirs.get(key)!r} in its config.json, {ours.get(key)!r} in the job's"
            )


def check_gpt_config(config: GPTConfig, preset: str, init_from: str | Path) -> None:
    """Refuse an ``--init-from`` directory whose config.json (when it has one: an export
    writes it) is not the job's GPT preset: an hf or entry model, or a differing field."""
    d = init_dir(init_from)
    raw = _config_json(d)
    if raw is None:
        return  # the tensors' names and shapes are checked when they load
    if "model_type" in raw:
        raise WeightsError(
            f"--init-from {str(d)!r} holds a Hugging Face {raw['model_type']} model, not the "
            f"job's GPT preset {preset!r}"
        )
    kind = raw.get("kind")
    if kind not in (None, "gpt"):
        raise WeightsError(
            f"--init-from {str(d)!r} holds a {kind} model {raw.get('ddiloco_model')!r}, not the "
            f"job's GPT preset {preset!r}"
        )
    for field in config.__dataclass_fields__:
        if field in GPT_FIELDS_IGNORED or field not in raw:
            continue
        if raw[field] != getattr(config, field):
            raise WeightsError(
                f"--init-from {str(d)!r} is not the job's model: {field} is {raw[field]!r} "
                f"in its config.json, {getattr(config, field)!r} in the preset {preset!r}"
            )


def load_gpt(model: nn.Module, preset: str, init_from: str | Path) -> None:
    """Start a GPT preset's ``model`` from ``--init-from`` (an export of a GPT job)."""
    weights = init_weights(init_from)
    check_gpt_config(model.config, preset, init_from)  # type: ignore[arg-type]
    load_params(model, weights)
    log.info("loaded initial weights from %s (--init-from)", weights.shown)


def load_entry(model: nn.Module, entry: str, init_from: str | Path) -> None:
    """Start a model entry's ``model`` from ``--init-from`` (tensors by parameter name)."""
    weights = init_weights(init_from)
    load_params(model, weights)
    log.info("loaded initial weights from %s (--init-from, model entry %s)", weights.shown, entry)


# ---- the CLIs' checks ------------------------------------------------------------------
def check(model: str, model_entry: str | None, init_from: str | None) -> None:
    """What the CLIs refuse before starting anything (WeightsError, one line): an hf:
    directory's unusable weights (pickle only, shards without their index), and an
    ``--init-from`` that holds no safetensors or is not the job's model (its config; for a
    GPT preset also every tensor's name and shape, read from the file's header). An hf
    model's tensors are checked when they load (``load_hf``), a model entry's likewise."""
    from ddiloco.learner import hf

    if model_entry is None and hf.is_hf(model) and (own := hf.weights_dir(model)) is not None:
        find(own)
    if init_from is None:
        return
    weights = init_weights(init_from)
    if model_entry is not None:
        return
    if hf.is_hf(model):
        check_hf_config(hf.load_config(model), init_from)
        return
    from ddiloco.learner.model import GPT, PRESETS

    if model not in PRESETS:
        return  # refused by name by the preset check
    check_gpt_config(PRESETS[model], model, init_from)
    with torch.device("meta"):  # names and shapes only: no memory, no init
        net = GPT(PRESETS[model])
    expected = {k: tuple(p.shape) for k, p in net.named_parameters()}
    if (why := mismatch(expected, shapes(weights))) is not None:
        raise WeightsError(f"{weights.shown} does not match the job's model: {why}")
