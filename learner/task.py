"""What a learner trains: a model, its batches, its loss and its eval, bundled as a ``Task``.

The training loop knows nothing about GPTs or corpora; it asks ``build_task`` for a ``Task``:

    task = build_task(preset="tiny", learner_index=1, num_learners=3, seed=0)
    task = build_task(preset="hf:llama-tiny", data="docs.jsonl", rank=1, world=2)
    task = build_task(preset="tiny", init_from="runs/x/export")    # a previous job's model
    x, y = next(task.batches)
    loss = task.loss_fn(task.model, x, y)
    loss.backward()
    held_out = task.eval_loss(task.model)
    task.batches.position, task.batches.seek(p)     # the slot's data stream (corpus.py)

Built in: a ``GPT`` preset (``model.PRESETS``) or a Hugging Face config (``hf:PATH``,
``hf:llama-tiny``: ``hf.py``) on ``data``. Token arrays (a ``.bin``, and for byte-level
tokenization text files and the default stdlib corpus: ``data.load_tokens``) hold out their
tail for eval and cut the rest into one contiguous shard per learner; documents (JSONL,
Parquet, and text under a model's tokenizer: ``corpus.load_corpus``) hold out every 20th
document and deal the others round-robin; a prepared dataset (``ddiloco prepare``: a
directory or URL with a manifest, ``prepared.py``) is read lazily, its chunks dealt
round-robin, its eval set held out at prepare time. The tokenizer is ``tokenizer`` (a local
path), else an ``hf:`` model directory's own, else bytes. The model is initialised right after
``torch.manual_seed(seed)``, so every learner starts from the same weights, unless it starts
from a file's: an ``hf:`` directory's own weights, or ``init_from``'s (any model, a model
entry's too: learner/weights.py), the same file on every learner. Its stream of windows is
drawn with ``(seed, learner_index)`` and taken by the ranks of a group (``rank`` of
``world``) in turn, so that the position does not depend on the group size.

Bring your own (``--model-entry module:function``): the function is imported and called as

    function(learner_index=i, num_learners=m, seed=s, device="cpu" | "cuda" | ...)

(plus ``rank=r, world=n`` if it takes them) and must return a ``Task`` whose model is on
``device``, identical on every learner for a given ``seed`` (same parameter names, shapes,
dtypes and initial values: the synchronizer merges them), whose ``batches`` yield this
learner's ``(inputs, targets)`` forever (with ``position`` and ``seek`` if it is to resume a
slot's data: ``data.BatchIterator`` does both), and whose ``embedding_params`` names the
parameters to merge by plain averaging (may be empty). The ``preset``, ``data``,
``tokenizer`` and ``batch_size`` arguments of ``build_task`` are not passed; the entry
decides those itself. A failure to import or call the entry, or a wrong return value, raises
``ModelEntryError`` naming the entry. ``ddiloco.learner.examples:char_mlp`` is a small example.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from ddiloco.learner import corpus, documents, hf, prepared, weights
from ddiloco.learner.data import BatchIterator, Tokens, eval_loss, load_tokens, shard, split_eval
from ddiloco.learner.model import build_model, is_embedding_param

log = logging.getLogger(__name__)


@dataclass
class Task:
    """A learner's model and data. ``model`` is trained in place by the loop."""

    model: nn.Module
    """The model, already on its device; the same initial weights on every learner."""
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
    """Endless ``(inputs, targets)`` training batches from this learner's own shard."""
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    """``loss_fn(model, inputs, targets)`` -> scalar loss to minimise (differentiable)."""
    eval_loss: Callable[[nn.Module], float]
    """``eval_loss(model)`` -> held-out loss; deterministic, the same data on every learner."""
    tokens_per_batch: int
    """Tokens behind one batch, the unit of work the synchronizer weights merges by."""
    embedding_params: set[str]
    """Names (as in ``model.named_parameters()``) merged by plain averaging, not RDA."""


class ModelEntryError(ValueError):
    """A ``--model-entry`` could not be imported, called, or returned something else than a Task."""


def gpt_loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Loss of any model following ``GPT.forward``'s contract: ``model(x, y) -> (logits, loss)``."""
    _, loss = model(x, y)
    return loss


def embedding_param_names(model: nn.Module) -> set[str]:
    """Names of the parameters that belong to ``nn.Embedding`` modules of ``model``."""
    return {
        f"{module_name}.{param_name}" if module_name else param_name
        for module_name, module in model.named_modules()
        if isinstance(module, nn.Embedding)
        for param_name, _ in module.named_parameters(recurse=False)
    }


def build_task(
    *,
    preset: str = "tiny",
    data: str | None = None,
    model_entry: str | None = None,
    learner_index: int = 0,
    num_learners: int = 1,
    batch_size: int = 8,
    seed: int = 0,
    device: str = "cpu",
    tokenizer: str | None = None,
    data_field: str = "text",
    rank: int = 0,
    world: int = 1,
    eval_only: bool = False,
    cache_dir: str | None = None,
    init_from: str | None = None,
    seq_len: int | None = None,
) -> Task:
    """The ``Task`` of rank ``rank`` of ``world`` of learner ``learner_index`` of
    ``num_learners`` (see the module docstring). ``eval_only``: for an evaluator, which
    never trains; only the eval set is read, and the batches are its windows.
    ``init_from``: a model directory whose safetensors weights the model starts from
    (``weights.WeightsError`` when they are not this model's). ``seq_len``: tokens per
    training sequence, at most the model's context length (its default)."""
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    if not 0 <= learner_index < num_learners:
        raise ValueError(f"learner_index must be in [0, {num_learners}), got {learner_index}")
    if world < 1 or not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, world), got rank {rank} of world {world}")
    if model_entry is not None:
        task = _task_from_entry(model_entry, learner_index, num_learners, seed, device, rank, world)
        if init_from is not None:
            weights.load_entry(task.model, model_entry, init_from)
        return task

    torch.manual_seed(seed)
    given_tokenizer = tokenizer  # a prepared dataset is checked against this one only
    loss_fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
    if hf.is_hf(preset):
        model: nn.Module = hf.build_model(preset, init_from=init_from).to(device)
        block_size = hf.block_size(model.config)
        vocab_size = int(model.get_input_embeddings().num_embeddings)
        loss_fn = hf.causal_lm_loss
        embedding = hf.embedding_param_names(model)
        own = hf.model_dir(preset)
        tokenizer = tokenizer or (str(own) if hf.tokenizer_dir(own) else None)
    else:
        model = build_model(preset)
        if init_from is not None:
            weights.load_gpt(model, preset, init_from)
        model = model.to(device)
        block_size, vocab_size = model.config.block_size, model.config.vocab_size
        loss_fn = gpt_loss
        embedding = {name for name, _ in model.named_parameters() if is_embedding_param(name)}
    if seq_len is not None:
        if not 1 <= seq_len <= block_size:
            raise ValueError(
                f"seq_len {seq_len} must be in [1, {block_size}]: the model's context length "
                f"is {block_size} tokens"
            )
        block_size = seq_len
    train: Tokens
    if prepared.is_prepared(data):  # tokenized by `ddiloco prepare`: read lazily
        assert data is not None
        ds = prepared.open_dataset(data)
        ds.check_model(vocab_size, tokenizer_digest(given_tokenizer))
        held_out = ds.eval()
        train = held_out if eval_only else ds.train(learner_index, num_learners)
    else:
        train, held_out = _tokens(
            data,
            tokenizer,
            data_field,
            learner_index,
            num_learners,
            vocab_size,
            eval_only,
            cache_dir,
        )
    if len(held_out) < block_size + 1:
        raise ValueError(
            f"the eval set of {data or 'the stdlib corpus'} holds {len(held_out)} tokens, fewer "
            f"than block_size + 1 = {block_size + 1}: give more data"
        )
    if eval_only:
        train = held_out
    elif len(train) < block_size + 1:
        raise ValueError(
            f"learner {learner_index} of {num_learners} has {len(train)} tokens of training "
            f"data, fewer than block_size + 1 = {block_size + 1}: give more data or fewer "
            "learners (a text file is one document, a JSONL line or Parquet row one; every "
            f"{corpus.EVAL_EVERY}th document, from the first, is held out for eval)"
        )
    return Task(
        model=model,
        batches=BatchIterator(
            train, batch_size, block_size, (seed, learner_index), device, rank=rank, world=world
        ),
        loss_fn=loss_fn,
        eval_loss=functools.partial(
            eval_loss,
            tokens=held_out,
            batch_size=batch_size,
            block_size=block_size,
            device=device,
            loss_fn=loss_fn,
        ),
        tokens_per_batch=batch_size * block_size,
        embedding_params=embedding,
    )


def tokenizer_digest(tokenizer: str | None) -> str | None:
    """The digest a corpus tokenized with ``tokenizer`` (a local path) carries, as
    ``corpus.HFTokens`` names it; None for None."""
    if tokenizer is None:
        return None
    return f"hf-{hf.tokenizer_digest(Path(tokenizer).expanduser())}"


def _tokens(
    data: str | None,
    tokenizer: str | None,
    data_field: str,
    learner_index: int,
    num_learners: int,
    vocab_size: int,
    eval_only: bool,
    cache_dir: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """``(this learner's training tokens, eval tokens)`` of ``data`` (module docstring)."""
    if not documents.is_documents(data, byte_level=tokenizer is None):
        train, held_out = split_eval(load_tokens(data, vocab_size=vocab_size))
        return shard(train, learner_index, num_learners), held_out
    tokens: corpus.TextTokens = corpus.ByteTokens()
    if tokenizer is not None:
        path = Path(tokenizer).expanduser()
        tokens = corpus.HFTokens(hf.load_tokenizer(path), hf.tokenizer_digest(path))
    c = corpus.load_corpus(
        data,
        tokens,
        data_field=data_field,
        learner_index=learner_index,
        num_learners=num_learners,
        vocab_size=vocab_size,
        cache_dir=cache_dir,
        eval_only=eval_only,
    )
    return c.train, c.eval


def _task_from_entry(
    entry: str, learner_index: int, num_learners: int, seed: int, device: str, rank: int, world: int
) -> Task:
    module_name, sep, function_name = entry.partition(":")
    if not sep or not module_name or not function_name or ":" in function_name:
        raise ModelEntryError(f"model entry {entry!r} must look like 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ModelEntryError(f"model entry {entry!r}: cannot import {module_name!r}: {e}") from e
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ModelEntryError(
            f"model entry {entry!r}: module {module_name!r} has no callable {function_name!r}"
        )
    kwargs = {"learner_index": learner_index, "num_learners": num_learners, "seed": seed}
    try:
        params = inspect.signature(function).parameters
    except (TypeError, ValueError):
        params = {}
    takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    if takes_any or {"rank", "world"} <= set(params):
        kwargs |= {"rank": rank, "world": world}
    elif world > 1:
        log.warning("model entry %r takes no rank and world: every rank gets its batches", entry)
    try:
        task = function(**kwargs, device=device)
    except Exception as e:
        e.add_note(f"raised by model entry {entry!r}")
        raise
    if not isinstance(task, Task):
        raise ModelEntryError(
            f"model entry {entry!r} returned {type(task).__name__}, expected "
            "ddiloco.learner.task.Task"
        )
    if not isinstance(task.model, nn.Module):
        raise ModelEntryError(
            f"model entry {entry!r}: Task.model is {type(task.model).__name__}, not an nn.Module"
        )
    unknown = set(task.embedding_params) - {name for name, _ in task.model.named_parameters()}
    if unknown:
        raise ModelEntryError(
            f"model entry {entry!r}: embedding_params names no parameter of the model: "
            f"{sorted(unknown)}"
        )
    return task
