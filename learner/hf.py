"""Hugging Face models for the learners: ``--model hf:PATH``, built from a local config only.

    model = build_model("hf:llama-tiny", seed=0)      # the shipped config (learner/configs/)
    model = build_model("hf:/models/my-llama")         # config.json, and its weights if any
    model = build_model("hf:llama-tiny", init_from="runs/x/export")   # another's weights
    tok = load_tokenizer("hf:llama-tiny")              # that directory's tokenizer, or None
    names = embedding_param_names(model)               # from the model itself, tied ones once
    loss = causal_lm_loss(model, x, y)                 # y is x shifted by one token

``PATH`` is a directory with a ``config.json`` or a config ``.json`` file; ``SHIPPED`` maps
short names to the configs in this package. A directory that holds weights
(``model.safetensors``, or shards with ``model.safetensors.index.json``: a
``save_pretrained`` or ``ddiloco export`` directory, a Hugging Face snapshot) starts training
from them, so a job can fine-tune; one without weights, a config file and the shipped
configs start from a seeded random init. ``init_from`` (``--init-from DIR``) takes another
directory's weights instead. Which it was is one INFO line. Weights are safetensors only,
checked against the config's model tensor by tensor (learner/weights.py): pickle weights are
refused by name, never opened. Nothing is downloaded: configs and tokenizers load with
``local_files_only`` and the hub is switched off for this process (``HF_HUB_OFFLINE``), and
no remote code runs (``trust_remote_code`` is never set). Parameters are float32 whatever the
config's ``dtype`` says (bf16 autocast on CUDA is the training loop's business).

Embeddings are the parameters of ``get_input_embeddings()``, ``get_output_embeddings()`` and
of every ``nn.Embedding`` module (position embeddings of GPT-2 style models), matched by
object identity against ``named_parameters()``, which lists a tied output head once under
its input embedding's name; so the wrapper merges a tied matrix once.

The context length trained (``block_size``) is the config's ``max_position_embeddings``
(``n_positions``, ``n_ctx``), at most ``MAX_BLOCK_SIZE``. The loss is the model's own causal
LM loss (``model.loss_function`` through ``labels``), given the targets already shifted
(``shift_labels``), so all ``B*T`` targets of a batch count, as for the GPT presets.

``model_spec`` describes the job's model for the synchronizer (carried by the init upload,
stored as ``model.json`` in its state dir, served at ``GET /v1/model``), so that
``ddiloco export`` can write a directory ``AutoModelForCausalLM.from_pretrained`` loads.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Final

import torch
from torch import nn

from ddiloco.wire.protocol import ModelSpec

if TYPE_CHECKING:
    from transformers import PretrainedConfig, PreTrainedModel, PreTrainedTokenizerBase

log = logging.getLogger(__name__)

# No hub: every config and tokenizer is a local file (set before transformers is imported).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

PREFIX: Final = "hf:"
CONFIGS_DIR: Final = Path(__file__).parent / "configs"
SHIPPED: Final[dict[str, Path]] = {"llama-tiny": CONFIGS_DIR / "llama-tiny"}
"""Short names for the configs shipped in this package: ``hf:llama-tiny``."""
MAX_BLOCK_SIZE: Final = 2048
"""The longest context trained when the config allows more (a 128k-position config would
not fit a batch); write a config with a smaller ``max_position_embeddings`` for less."""
TOKENIZER_FILES: Final = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
)
"""Text files of a tokenizer that travel with the model spec and the export."""
SPEC_FILES_LIMIT: Final = 8 << 20
"""Tokenizer files larger than this together are left out of the model spec (the init
upload's header holds it); ``ddiloco export --tokenizer PATH`` then supplies them."""
BYTE_SPECIALS: Final = ("<s>", "</s>")
"""The byte-level tokenizer's special tokens, ids 256 (bos) and 257 (eos)."""


def is_hf(model: str) -> bool:
    """True for a model spec ``hf:...``."""
    return model.startswith(PREFIX)


def model_dir(model: str) -> Path:
    """The directory holding ``model``'s config (``hf:NAME`` of ``SHIPPED`` or ``hf:PATH``).

    Raises FileNotFoundError naming the path when there is no config there."""
    if not is_hf(model):
        raise ValueError(f"{model!r} is not an hf: model (hf:PATH or hf:{'|'.join(SHIPPED)})")
    name = model[len(PREFIX) :]
    if not name:
        raise ValueError(f"{model!r}: give hf:PATH (a config.json or model directory)")
    path = SHIPPED.get(name) or Path(name).expanduser()
    if path.is_file():
        return path.parent
    if not (path / "config.json").is_file():
        shipped = ", ".join(f"hf:{n}" for n in SHIPPED)
        raise FileNotFoundError(
            f"{model}: no config.json at {str(path)!r}; give a model directory, a config "
            f".json file, or a shipped config ({shipped})"
        )
    return path


def weights_dir(model: str) -> Path | None:
    """The directory whose weights ``model`` starts from: ``hf:DIR``'s DIR (a shipped name's
    too), None for ``hf:FILE.json`` (a config alone, never the files beside it)."""
    name = model[len(PREFIX) :]
    path = SHIPPED.get(name) or Path(name).expanduser()
    return None if path.is_file() else model_dir(model)


def _config_file(model: str) -> Path:
    name = model[len(PREFIX) :]
    path = SHIPPED.get(name) or Path(name).expanduser()
    return path if path.is_file() else model_dir(model) / "config.json"


def load_config(model: str) -> PretrainedConfig:
    """The model's ``PretrainedConfig``, read from the local file only."""
    from transformers import AutoConfig

    path = _config_file(model)
    if path.name == "config.json":
        return AutoConfig.from_pretrained(str(path.parent), local_files_only=True)
    raw = json.loads(path.read_text())
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{path}: a model config is a JSON object with a 'model_type'")
    return AutoConfig.for_model(raw.pop("model_type"), **raw)


def build_model(
    model: str, seed: int | None = None, init_from: str | os.PathLike[str] | None = None
) -> PreTrainedModel:
    """The ``AutoModelForCausalLM`` of ``model``'s config, float32 params, holding the
    weights of ``init_from`` if given, else those of ``model``'s directory if it has any,
    else freshly initialised (see the module docstring; one INFO line says which).

    With ``seed``, torch's generator is seeded first, so every learner builds the same model
    (otherwise seed it yourself, as for ``model.build_model``). Weights that are not this
    config's model, or are not safetensors, raise ``weights.WeightsError`` (one line)."""
    from ddiloco.learner import weights

    config = load_config(model)
    if seed is not None:
        torch.manual_seed(seed)
    if init_from is not None:
        found = weights.init_weights(init_from)
        weights.check_hf_config(config, init_from)
        net = weights.load_hf(config, found)
        log.info("loaded pretrained weights from %s (--init-from)", found.shown)
        return net
    own = weights_dir(model)
    found = weights.find(own) if own is not None else None
    if found is None:
        log.info("no weights in %s: random init", own or _config_file(model))
        return from_config(config)
    net = weights.load_hf(config, found)
    log.info("loaded pretrained weights from %s", found.shown)
    return net


def from_config(config: PretrainedConfig) -> PreTrainedModel:
    """``AutoModelForCausalLM.from_config`` in float32 (init from torch's generator)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(config, dtype=torch.float32)


def block_size(config: PretrainedConfig) -> int:
    """Context length trained: the config's position limit, at most ``MAX_BLOCK_SIZE``."""
    for key in ("max_position_embeddings", "n_positions", "n_ctx", "seq_length"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 1:
            return min(value, MAX_BLOCK_SIZE)
    return MAX_BLOCK_SIZE


def embedding_param_names(model: nn.Module) -> set[str]:
    """Names (as ``model.named_parameters()`` lists them) of the embedding parameters: those
    of the input and output embeddings and of every ``nn.Embedding``, matched by identity."""
    modules: list[nn.Module] = [m for m in model.modules() if isinstance(m, nn.Embedding)]
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        fn = getattr(model, getter, None)
        try:
            module = fn() if fn is not None else None
        except NotImplementedError:
            module = None
        if isinstance(module, nn.Module):
            modules.append(module)
    wanted = {id(p) for m in modules for p in m.parameters(recurse=False)}
    return {name for name, p in model.named_parameters() if id(p) in wanted}


def causal_lm_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """The model's causal LM loss of targets ``y`` (already shifted: ``y[:, t]`` follows
    ``x[:, t]``), mean over all ``B*T`` targets, computed in float32 by the model."""
    return model(input_ids=x, labels=y, shift_labels=y, use_cache=False).loss


# ---- tokenizers ------------------------------------------------------------------------
def tokenizer_dir(path: str | os.PathLike[str]) -> Path | None:
    """The directory of a tokenizer path (a directory, or a file inside one), or None when
    it holds no tokenizer files."""
    p = Path(path).expanduser()
    d = p.parent if p.is_file() else p
    return d if any((d / f).is_file() for f in TOKENIZER_FILES[:2]) else None


def load_tokenizer(path: str | os.PathLike[str]) -> PreTrainedTokenizerBase:
    """An ``AutoTokenizer`` from a local directory, or a bare ``tokenizer.json`` file.

    Raises FileNotFoundError when there is no tokenizer there."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    p = Path(path).expanduser()
    if p.is_file() and not (p.parent / "tokenizer_config.json").is_file():
        tok = PreTrainedTokenizerFast(tokenizer_file=str(p))
    else:
        d = tokenizer_dir(p)
        if d is None:
            raise FileNotFoundError(
                f"no tokenizer at {str(p)!r}: give a directory with tokenizer.json "
                "(+ tokenizer_config.json) or a tokenizer.json file"
            )
        tok = AutoTokenizer.from_pretrained(str(d), local_files_only=True)
    tok.model_max_length = 1 << 62  # documents are tokenized whole, then packed
    return tok


def tokenizer_files(path: str | os.PathLike[str]) -> dict[str, str]:
    """The tokenizer's text files (``TOKENIZER_FILES`` present) by name."""
    p = Path(path).expanduser()
    if p.is_file() and not (p.parent / "tokenizer_config.json").is_file():
        return {"tokenizer.json": p.read_text()}
    d = tokenizer_dir(p)
    if d is None:
        return {}
    return {f: (d / f).read_text() for f in TOKENIZER_FILES if (d / f).is_file()}


def tokenizer_digest(path: str | os.PathLike[str]) -> str:
    """A digest of the tokenizer's files: what a tokenized corpus's cache key holds."""
    h = hashlib.sha256()
    for name, text in sorted(tokenizer_files(path).items()):
        h.update(name.encode() + b"\0" + text.encode() + b"\0")
    return h.hexdigest()[:24]


def byte_tokenizer_json() -> str:
    """The byte-level tokenizer shipped with llama-tiny, as ``tokenizer.json`` text: token
    ``b`` is byte ``b`` (0..255, so ids agree with the GPT presets' bytes), then ``<s>`` 256
    and ``</s>`` 257. A BPE model without merges over GPT-2's byte-to-unicode alphabet."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    printable = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars: dict[int, str] = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):  # the other bytes map above 255, in order (GPT-2's scheme)
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    tok = Tokenizer(models.BPE(vocab={chars[b]: b for b in range(256)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(list(BYTE_SPECIALS))
    return tok.to_str(pretty=True)


def write_byte_tokenizer(directory: str | os.PathLike[str], max_length: int) -> None:
    """Write the byte-level tokenizer (``tokenizer.json``, ``tokenizer_config.json``) into
    ``directory``: how learner/configs/llama-tiny's were made (a unit test checks they are)."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "tokenizer.json").write_text(byte_tokenizer_json() + "\n")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BYTE_SPECIALS[0],
        "eos_token": BYTE_SPECIALS[1],
        "model_max_length": max_length,
        "clean_up_tokenization_spaces": False,
    }
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


# ---- the job's model, for the synchronizer and the export ------------------------------
def model_spec(
    model: str, model_entry: str | None = None, tokenizer: str | None = None
) -> ModelSpec:
    """What the job trains, as the init upload carries it (see the module docstring).

    GPT preset: its name and ``GPTConfig``; hf: the config.json as parsed, the tokenizer's
    text files (the ``tokenizer`` path's, else the model directory's; left out, with
    ``tokenizer_omitted``, above ``SPEC_FILES_LIMIT``) and a generation_config.json if the
    model directory has one; a model entry: its name only."""
    if model_entry:
        return ModelSpec(kind="entry", name=model_entry)
    if not is_hf(model):
        from ddiloco.learner.model import PRESETS

        cfg = PRESETS.get(model)
        config = dataclasses.asdict(cfg) if cfg is not None else {}
        return ModelSpec(kind="gpt", name=model, config=config, tokenizer="bytes")
    directory = model_dir(model)
    config = json.loads(_config_file(model).read_text())
    source = Path(tokenizer).expanduser() if tokenizer else directory
    files = tokenizer_files(source) if tokenizer or tokenizer_dir(directory) else {}
    omitted = sum(len(t.encode()) for t in files.values()) > SPEC_FILES_LIMIT
    if omitted:
        files = {}
    generation = directory / "generation_config.json"
    if generation.is_file():
        files["generation_config.json"] = generation.read_text()
    kind_of_tokenizer = "hf" if (tokenizer or tokenizer_dir(directory)) else "bytes"
    return ModelSpec(
        kind="hf",
        name=model,
        config=config,
        files=files,
        tokenizer=kind_of_tokenizer,
        tokenizer_omitted=omitted,
    )


def spec_metadata(model: str, model_entry: str | None, tokenizer: str | None) -> str:
    """``model_spec`` as the JSON text the init upload's metadata carries (``MODEL_KEY``)."""
    return model_spec(model, model_entry, tokenizer).model_dump_json()
