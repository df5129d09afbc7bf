"""Unit tests of the learner's model and data layer (ddiloco.learner.model, .data, .task).

OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_model_data.py
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from ddiloco.learner.data import (
    BatchIterator,
    eval_loss,
    load_tokens,
    shard,
    split_eval,
)
from ddiloco.learner.examples import CharMLP
from ddiloco.learner.model import GPT, PRESETS, GPTConfig, build_model, is_embedding_param
from ddiloco.learner.task import ModelEntryError, Task, build_task

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def corpus() -> np.ndarray:
    return load_tokens(None)


def tiny(seed: int = 0) -> GPT:
    torch.manual_seed(seed)
    return build_model("tiny")


# --- model -------------------------------------------------------------------------------


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_presets_forward_backward(preset: str) -> None:
    torch.manual_seed(0)
    # Two blocks at the preset's full width: the 12-block gpt2 takes seconds to init on CPU.
    config = dataclasses.replace(PRESETS[preset], n_layer=min(2, PRESETS[preset].n_layer))
    model = GPT(config)
    x = torch.randint(0, config.vocab_size, (2, 16))
    logits, loss = model(x, x)
    assert logits.shape == (2, 16, config.vocab_size)
    assert loss is not None and loss.ndim == 0
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert model(x)[1] is None


def test_build_model_by_name() -> None:
    assert build_model("small").config == PRESETS["small"]
    assert set(PRESETS) >= {"tiny", "small", "base", "gpt2"}


def test_unknown_preset_names_the_allowed_ones() -> None:
    with pytest.raises(ValueError, match="tiny"):
        build_model("huge")


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"n_embd": 65}, "n_embd"),
        ({"n_layer": 0}, "n_layer"),
        ({"dropout": 1.0}, "dropout"),
        ({"vocab_size": -1}, "vocab_size"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    base = {"block_size": 8, "n_layer": 1, "n_head": 2, "n_embd": 8}
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        GPTConfig(**(base | kwargs))


def test_tiny_loss_at_init_is_near_uniform(corpus: np.ndarray) -> None:
    loss = eval_loss(tiny(), corpus, batch_size=8, block_size=64, batches=2)
    assert abs(loss - math.log(256)) < 0.3


def test_init_is_deterministic_given_the_seed() -> None:
    a, b, c = tiny(3).state_dict(), tiny(3).state_dict(), tiny(4).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["wte.weight"], c["wte.weight"])


def test_embedding_param_names() -> None:
    names = [name for name, _ in tiny().named_parameters()]
    assert {n for n in names if is_embedding_param(n)} == {"wte.weight", "wpe.weight"}
    assert is_embedding_param("module.wte.weight")
    assert not is_embedding_param("blocks.0.attn.qkv.weight")
    assert not is_embedding_param("wte")


def test_tied_head_is_one_parameter() -> None:
    model = tiny()
    c = model.config
    per_block = 12 * c.n_embd**2 + 2 * c.n_embd  # qkv, proj, fc, proj + 2 LayerNorms, no bias
    expected = (c.vocab_size + c.block_size) * c.n_embd + c.n_layer * per_block + c.n_embd
    assert model.num_params() == expected
    assert sum(p.numel() for p in model.parameters()) == expected
    assert model.state_dict().keys() == dict(model.named_parameters()).keys()
    assert model.num_params(exclude_embeddings=True) == expected - 320 * c.n_embd


def test_sequence_longer_than_block_is_refused() -> None:
    with pytest.raises(ValueError, match="block_size"):
        tiny()(torch.zeros(1, 65, dtype=torch.long))


# --- data --------------------------------------------------------------------------------


def test_stdlib_corpus(corpus: np.ndarray) -> None:
    assert corpus.dtype == np.uint16
    assert len(corpus) == 8 * 1024 * 1024  # the stdlib holds more than the cap
    assert int(corpus.max()) < 256
    assert b"def " in corpus[:100_000].astype(np.uint8).tobytes()


def test_eval_split_is_the_identical_tail(corpus: np.ndarray) -> None:
    train, held_out = split_eval(corpus)
    assert len(train) + len(held_out) == len(corpus)
    assert np.array_equal(held_out, corpus[len(train) :])
    assert np.array_equal(held_out, split_eval(load_tokens(None))[1])
    with pytest.raises(ValueError, match="eval_fraction"):
        split_eval(corpus, 0.0)


@pytest.mark.parametrize("count", [1, 3, 7])
def test_shards_are_disjoint_and_cover(count: int) -> None:
    tokens = np.arange(1000, dtype=np.uint16)
    shards = [shard(tokens, i, count) for i in range(count)]
    assert np.array_equal(np.concatenate(shards), tokens)
    assert max(map(len, shards)) - min(map(len, shards)) <= 1
    assert np.array_equal(shard(tokens, count - 1, count), shards[-1])


def test_shard_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="index"):
        shard(np.zeros(10, np.uint16), 3, 3)


def test_batches_are_shifted_and_reproducible() -> None:
    tokens = np.arange(500, dtype=np.uint16)
    x, y = next(BatchIterator(tokens, batch_size=4, block_size=16, seed=1))
    assert x.shape == y.shape == (4, 16)
    assert x.dtype == torch.long
    assert torch.equal(y[:, :-1], x[:, 1:])
    assert torch.equal(y[:, -1], x[:, -1] + 1)

    def draws(seed: int) -> list[torch.Tensor]:
        it = BatchIterator(tokens, batch_size=4, block_size=16, seed=seed)
        return [next(it)[0] for _ in range(3)]

    assert all(torch.equal(a, b) for a, b in zip(draws(1), draws(1), strict=True))
    assert not torch.equal(draws(1)[0], draws(2)[0])


def test_batches_refuse_a_short_shard() -> None:
    with pytest.raises(ValueError, match="block_size"):
        BatchIterator(np.zeros(16, np.uint16), batch_size=2, block_size=16, seed=0)


def test_eval_loss_is_deterministic_and_restores_mode(corpus: np.ndarray) -> None:
    model = tiny()
    model.train()
    held_out = split_eval(corpus)[1]
    a = eval_loss(model, held_out, batch_size=4, block_size=64, batches=2)
    assert model.training
    model.eval()
    assert a == eval_loss(model, held_out, batch_size=4, block_size=64, batches=2)
    assert not model.training


def test_load_bin(tmp_path: Path) -> None:
    path = tmp_path / "tokens.bin"
    np.arange(300, dtype=np.uint16).tofile(path)
    tokens = load_tokens(str(path), vocab_size=300)
    assert tokens.dtype == np.uint16
    assert np.array_equal(tokens, np.arange(300))
    with pytest.raises(ValueError, match="vocab_size 256"):
        load_tokens(str(path))
    (tmp_path / "odd.bin").write_bytes(b"abc")
    with pytest.raises(ValueError, match="odd size"):
        load_tokens(str(tmp_path / "odd.bin"))


def test_load_text_file_and_directory(tmp_path: Path) -> None:
    (tmp_path / "b.txt").write_text("world")
    (tmp_path / "a.txt").write_text("hello ")
    (tmp_path / ".hidden").write_text("skipped")
    assert load_tokens(str(tmp_path / "a.txt")).tolist() == list(b"hello ")
    tokens = load_tokens(tmp_path)
    assert tokens.dtype == np.uint16
    assert tokens.astype(np.uint8).tobytes() == b"hello world"


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_tokens(str(tmp_path / "missing.txt"))
    (tmp_path / "empty.txt").write_bytes(b"")
    with pytest.raises(ValueError, match="no tokens"):
        load_tokens(str(tmp_path / "empty.txt"))


# --- task --------------------------------------------------------------------------------


def test_build_task_gives_identical_models_and_own_batches() -> None:
    tasks = [build_task(learner_index=i, num_learners=2, seed=5) for i in range(2)]
    a, b = (t.model.state_dict() for t in tasks)
    assert all(torch.equal(a[k], b[k]) for k in a)
    (xa, ya), (xb, _) = next(tasks[0].batches), next(tasks[1].batches)
    assert not torch.equal(xa, xb)
    assert tasks[0].tokens_per_batch == xa.numel() == 8 * 64
    assert tasks[0].embedding_params == {"wte.weight", "wpe.weight"}
    loss = tasks[0].loss_fn(tasks[0].model, xa, ya)
    loss.backward()
    assert tasks[0].eval_loss(tasks[0].model) == tasks[1].eval_loss(tasks[1].model)


def test_model_entry_example() -> None:
    task = build_task(model_entry="ddiloco.learner.examples:char_mlp", num_learners=2, seed=1)
    assert isinstance(task, Task)
    assert isinstance(task.model, CharMLP)
    assert task.embedding_params == {"emb.weight"}
    x, y = next(task.batches)
    task.loss_fn(task.model, x, y).backward()
    assert abs(task.eval_loss(task.model) - math.log(256)) < 0.5


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ("no_colon", "must look like"),
        ("ddiloco.learner.no_such_module:f", "cannot import"),
        ("ddiloco.learner.examples:missing", "no callable"),
        ("ddiloco.learner.model:is_embedding_param", "unexpected keyword"),
        ("ddiloco.learner.examples:CharMLP", "unexpected keyword"),
    ],
)
def test_bad_model_entry(entry: str, message: str) -> None:
    with pytest.raises((ModelEntryError, TypeError), match=message) as info:
        build_task(model_entry=entry)
    if isinstance(info.value, TypeError):  # raised inside the entry: a note names it
        assert any(entry in note for note in info.value.__notes__)


def test_model_entry_must_return_a_task(monkeypatch: pytest.MonkeyPatch) -> None:
    import ddiloco.learner.examples as examples

    monkeypatch.setattr(examples, "not_a_task", lambda **_: object(), raising=False)
    with pytest.raises(ModelEntryError, match="returned object, expected"):
        build_task(model_entry="ddiloco.learner.examples:not_a_task")
