"""What a learner trains: a model, its batches, its loss and its eval, bundled as a ``Task``.

The training loop knows nothing about GPTs or corpora; it asks ``build_task`` for a ``Task``:

    task = build_task(preset="tiny", learner_index=1, num_learners=3, seed=0)
    x, y = next(task.batches)
    loss = task.loss_fn(task.model, x, y)
    loss.backward()
    held_out = task.eval_loss(task.model)

Built in: a ``GPT`` preset (``model.PRESETS``) on ``data`` (``data.load_tokens``): the eval
split is the tail of the corpus, the rest is cut into one shard per learner. The model is
initialised right after ``torch.manual_seed(seed)``, so every learner starts from the same
weights; batches are drawn with seed ``seed + learner_index``.

Bring your own (``--model-entry module:function``): the function is imported and called as

    function(learner_index=i, num_learners=m, seed=s, device="cpu" | "cuda" | ...)

and must return a ``Task`` whose model is on ``device``, identical on every learner for a given
``seed`` (same parameter names, shapes, dtypes and initial values: the synchronizer merges
them), whose ``batches`` yield this learner's ``(inputs, targets)`` forever, and whose
``embedding_params`` names the parameters to merge by plain averaging (may be empty). The
``preset``, ``data`` and ``batch_size`` arguments of ``build_task`` are not passed; the entry
decides those itself. A failure to import or call the entry, or a wrong return value, raises
``ModelEntryError`` naming the entry. ``ddiloco.learner.examples:char_mlp`` is a small example.
"""

from __future__ import annotations

import functools
import importlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from ddiloco.learner.data import BatchIterator, eval_loss, load_tokens, shard, split_eval
from ddiloco.learner.model import build_model, is_embedding_param


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
) -> Task:
    """The ``Task`` of learner ``learner_index`` of ``num_learners`` (see the module docstring)."""
    if num_learners < 1:
        raise ValueError(f"num_learners must be >= 1, got {num_learners}")
    if not 0 <= learner_index < num_learners:
        raise ValueError(f"learner_index must be in [0, {num_learners}), got {learner_index}")
    if model_entry is not None:
        return _task_from_entry(model_entry, learner_index, num_learners, seed, device)

    torch.manual_seed(seed)
    model = build_model(preset).to(device)
    block_size = model.config.block_size
    train, held_out = split_eval(load_tokens(data, vocab_size=model.config.vocab_size))
    mine = shard(train, learner_index, num_learners)
    return Task(
        model=model,
        batches=BatchIterator(mine, batch_size, block_size, seed + learner_index, device),
        loss_fn=gpt_loss,
        eval_loss=functools.partial(
            eval_loss, tokens=held_out, batch_size=batch_size, block_size=block_size, device=device
        ),
        tokens_per_batch=batch_size * block_size,
        embedding_params={name for name, _ in model.named_parameters() if is_embedding_param(name)},
    )


def _task_from_entry(
    entry: str, learner_index: int, num_learners: int, seed: int, device: str
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
    try:
        task = function(
            learner_index=learner_index, num_learners=num_learners, seed=seed, device=device
        )
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
