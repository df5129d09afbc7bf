"""Hugging Face models for the learners (ddiloco.learner.hf) and the shipped llama-tiny.

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_hf.py

Everything is built from local files (the shipped config, configs written to tmp_path).
"""

from __future__ import annotations

import json
import math
import tomllib
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from ddiloco.learner import hf
from ddiloco.learner.data import stdlib_files
from ddiloco.learner.fragments import partition
from ddiloco.learner.task import build_task
from ddiloco.wire.protocol import ModelSpec

torch.set_num_threads(1)
SHIPPED = hf.SHIPPED["llama-tiny"]
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(autouse=True)
def token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # never the user's cache


def jsonl_corpus(path: Path, files: int = 40) -> Path:
    """Documents from the standard library's sources: each file cut at its blank lines."""
    with open(path, "w") as f:
        for source in stdlib_files()[:files]:
            for doc in source.read_text(errors="replace").split("\n\n\n"):
                f.write(json.dumps({"text": doc}) + "\n")
    return path


def write_config(tmp_path: Path, **changes: object) -> Path:
    """llama-tiny's config.json with `changes`, in its own directory (no tokenizer)."""
    config = json.loads((SHIPPED / "config.json").read_text()) | changes
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def test_shipped_config_is_a_small_float32_llama() -> None:
    model = hf.build_model("hf:llama-tiny", seed=0)
    assert type(model).__name__ == "LlamaForCausalLM"
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    n = sum(p.numel() for p in model.parameters())
    assert 50_000 < n < 500_000, n  # trains on one CPU core in tests
    assert model.config.tie_word_embeddings
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert hf.block_size(model.config) == 128


def test_init_is_identical_for_a_seed_and_differs_across_seeds() -> None:
    a, b = (hf.build_model("hf:llama-tiny", seed=3).state_dict() for _ in range(2))
    c = hf.build_model("hf:llama-tiny", seed=4).state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(
        a["model.layers.0.mlp.up_proj.weight"], c["model.layers.0.mlp.up_proj.weight"]
    )


def test_shipped_tokenizer_is_the_byte_tokenizer_this_project_writes(tmp_path: Path) -> None:
    hf.write_byte_tokenizer(tmp_path, max_length=128)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_text() == (SHIPPED / name).read_text(), name
    tok = hf.load_tokenizer(SHIPPED)
    text = "héllo, wörld\n\tdef f(): return 0  # ünïcode ✓"
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert ids == list(text.encode("utf-8"))  # byte b is token b, as for the GPT presets
    assert tok.decode(ids) == text
    assert (tok.bos_token_id, tok.eos_token_id) == (256, 257)
    assert len(tok) == json.loads((SHIPPED / "config.json").read_text())["vocab_size"] == 258


def test_tied_embeddings_are_one_parameter_found_by_identity() -> None:
    model = hf.build_model("hf:llama-tiny", seed=0)
    names = [n for n, _ in model.named_parameters()]
    assert "lm_head.weight" not in names  # a tied head is listed once, under the input's name
    assert hf.embedding_param_names(model) == {"model.embed_tokens.weight"}


def test_untied_head_is_an_embedding_too(tmp_path: Path) -> None:
    d = write_config(tmp_path, tie_word_embeddings=False)
    model = hf.build_model(f"hf:{d}", seed=0)
    assert hf.embedding_param_names(model) == {"model.embed_tokens.weight", "lm_head.weight"}


def test_position_embeddings_of_a_gpt2_style_model(tmp_path: Path) -> None:
    d = tmp_path / "gpt2"
    d.mkdir()
    config = {"model_type": "gpt2", "vocab_size": 258, "n_positions": 64, "n_embd": 32}
    (d / "config.json").write_text(json.dumps(config | {"n_layer": 1, "n_head": 2}))
    model = hf.build_model(f"hf:{d}", seed=0)
    # wte is tied to the head (listed once), wpe is an nn.Embedding the getters do not return
    assert hf.embedding_param_names(model) == {"transformer.wte.weight", "transformer.wpe.weight"}
    assert hf.block_size(model.config) == 64


def test_a_config_file_path_and_its_errors(tmp_path: Path) -> None:
    path = tmp_path / "my-llama.json"
    path.write_text((SHIPPED / "config.json").read_text())
    model = hf.build_model(f"hf:{path}", seed=0)
    assert model.config.hidden_size == 64
    with pytest.raises(FileNotFoundError, match=r"no config\.json"):
        hf.build_model(f"hf:{tmp_path / 'missing'}")
    with pytest.raises(ValueError, match="hf:PATH"):
        hf.model_dir("hf:")
    (tmp_path / "bad.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match="model_type"):
        hf.build_model(f"hf:{tmp_path / 'bad.json'}")


def test_loss_is_the_models_own_over_every_target() -> None:
    model = hf.build_model("hf:llama-tiny", seed=0)
    x, y = torch.randint(0, 258, (2, 16)), torch.randint(0, 258, (2, 16))
    loss = hf.causal_lm_loss(model, x, y)
    logits = model(input_ids=x).logits
    assert torch.allclose(loss, F.cross_entropy(logits.view(-1, 258), y.view(-1)))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())


def test_hf_task_trains_and_its_layout_holds_each_parameter_once(tmp_path: Path) -> None:
    data = str(jsonl_corpus(tmp_path / "docs.jsonl"))
    tasks = [
        build_task(preset="hf:llama-tiny", data=data, learner_index=i, num_learners=2)
        for i in (0, 1)
    ]
    a, b = (t.model.state_dict() for t in tasks)
    assert all(torch.equal(a[k], b[k]) for k in a)
    task = tasks[0]
    x, y = next(task.batches)
    assert x.shape == (8, 128) and task.tokens_per_batch == 8 * 128
    assert not torch.equal(x, next(tasks[1].batches)[0])  # each learner its own shard
    assert abs(task.eval_loss(task.model) - math.log(258)) < 0.5
    assert task.eval_loss(task.model) == tasks[1].eval_loss(tasks[1].model)
    params = dict(task.model.named_parameters())
    layout = partition(params.items(), 4, task.embedding_params)
    listed = [t.name for f in layout.fragments for t in f.tensors]
    assert sorted(listed) == sorted(params)  # the tied head is not a second tensor
    assert [f.embedding for f in layout.fragments] == [True, False, False, False]
    opt = torch.optim.AdamW(task.model.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        x, y = next(task.batches)
        loss = task.loss_fn(task.model, x, y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5, losses


def test_model_spec_carries_what_an_export_needs(tmp_path: Path) -> None:
    spec = hf.model_spec("hf:llama-tiny")
    assert spec.kind == "hf" and spec.tokenizer == "hf" and not spec.tokenizer_omitted
    assert spec.config == json.loads((SHIPPED / "config.json").read_text())
    assert set(spec.files) == {"tokenizer.json", "tokenizer_config.json"}
    assert ModelSpec.model_validate_json(hf.spec_metadata("hf:llama-tiny", None, None)) == spec
    bare = write_config(tmp_path)  # a config without a tokenizer: byte-level tokens
    assert hf.model_spec(f"hf:{bare}").tokenizer == "bytes"
    assert hf.model_spec(f"hf:{bare}", tokenizer=str(SHIPPED)).files == spec.files
    gpt = hf.model_spec("tiny")
    assert (gpt.kind, gpt.config["n_embd"], gpt.tokenizer) == ("gpt", 64, "bytes")
    entry = hf.model_spec("tiny", "ddiloco.learner.examples:char_mlp")
    assert (entry.kind, entry.name) == ("entry", "ddiloco.learner.examples:char_mlp")


def test_model_spec_refuses_file_names_that_are_paths() -> None:
    for name in ("../config.json", "/etc/passwd", ".hidden", "a/b"):
        with pytest.raises(ValueError):
            ModelSpec(kind="hf", files={name: "x"})


def test_the_shipped_configs_are_package_data() -> None:
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "ddiloco.learner.configs" in pyproject["tool"]["setuptools"]["packages"]
    patterns = pyproject["tool"]["setuptools"]["package-data"]["ddiloco.learner.configs"]
    configs = ROOT / "learner" / "configs"
    shipped = {p for p in configs.rglob("*") if p.is_file()}
    covered = {p for pattern in patterns for p in configs.glob(pattern)}
    assert shipped and shipped <= covered, shipped - covered
