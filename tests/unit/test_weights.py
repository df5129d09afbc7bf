"""A job starts from pretrained weights: ``hf:DIR``'s own and ``--init-from DIR`` (learner/weights.py).

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_weights.py

Real files and real transformers models, nothing from the hub: a tiny Llama is trained a few
steps (so its weights are not any seed's init) and written with ``save_pretrained``; a GPT
preset's export is made by ``ddiloco export`` from an in-process synchronizer
(tests/unit/test_export.py ``run_job``). Pickle weights are written with ``torch.save`` to
be refused; ``torch.load`` is replaced by a failure wherever one is, so nothing unpickles.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from ddiloco.cli import export
from ddiloco.learner import cli as learner_cli
from ddiloco.learner import hf, weights
from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.data import stdlib_files
from ddiloco.learner.model import build_model
from ddiloco.learner.task import build_task
from ddiloco.learner.train import train
from ddiloco.learner.weights import WeightsError
from ddiloco.local.processes import env_with
from tests.conftest import SyncServer
from tests.unit.test_export import run_job

torch.set_num_threads(1)

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 256,  # byte tokens: hf:DIR without a tokenizer reads bytes
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
    "tie_word_embeddings": True,
}


@pytest.fixture(autouse=True)
def token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # never the user's cache


@pytest.fixture
def no_unpickling(monkeypatch: pytest.MonkeyPatch) -> None:
    """Any torch.load from here on fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"torch.load called on {args[:1]}")

    monkeypatch.setattr(torch, "load", refuse)


def llama_config(**changes: Any) -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(**(TINY_LLAMA | changes))


def text_bytes() -> bytes:
    return b"\n".join(p.read_bytes() for p in stdlib_files()[:3])


def fixed_batch() -> tuple[torch.Tensor, torch.Tensor]:
    """Fixed windows of bytes (inputs, targets shifted by one)."""
    raw = torch.tensor(list(text_bytes()[: 4 * 33]), dtype=torch.long).view(4, 33)
    return raw[:, :-1].contiguous(), raw[:, 1:].contiguous()


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, Any, Path]]:
    """(a save_pretrained dir of a tiny Llama trained a few steps, that model, a text file)."""
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(1)
    net = AutoModelForCausalLM.from_config(llama_config(), dtype=torch.float32)
    opt = torch.optim.AdamW(net.parameters(), lr=1e-2)
    data = torch.tensor(list(text_bytes()[:20_000]), dtype=torch.long)
    g = torch.Generator().manual_seed(0)
    for _ in range(8):
        starts = torch.randint(0, len(data) - 33, (8,), generator=g)
        w = torch.stack([data[s : s + 33] for s in starts])
        hf.causal_lm_loss(net, w[:, :-1].contiguous(), w[:, 1:].contiguous()).backward()
        opt.step()
        opt.zero_grad()
    net.eval()
    d = tmp / "llama"
    net.save_pretrained(str(d), safe_serialization=True)
    text = tmp / "text.txt"
    text.write_bytes(text_bytes())
    yield d, net, text


def config_dir(path: Path, **changes: Any) -> Path:
    """A model directory holding a config.json only."""
    llama_config(**changes).save_pretrained(str(path))
    assert {p.name for p in path.iterdir()} == {"config.json"}
    return path


def copy_weights(src: Path, dst: Path, **changes: Any) -> Path:
    """`src`'s model.safetensors beside a config.json with `changes`."""
    config_dir(dst, **changes)
    shutil.copyfile(src / "model.safetensors", dst / "model.safetensors")
    return dst


# ---- hf:DIR with weights ---------------------------------------------------------------
def test_an_hf_dir_with_weights_starts_from_them(
    trained: tuple[Path, Any, Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    no_unpickling: None,
) -> None:
    d, saved_model, text = trained
    with caplog.at_level(logging.INFO, logger="ddiloco.learner.hf"):
        tasks = [
            build_task(
                preset=f"hf:{d}", data=str(text), batch_size=2, learner_index=i, num_learners=2
            )
            for i in range(2)
        ]
    assert f"loaded pretrained weights from {d / 'model.safetensors'}" in caplog.text
    saved = load_file(str(d / "model.safetensors"))
    for task in tasks:  # every learner: exactly the saved parameters
        params = dict(task.model.named_parameters())
        assert set(params) == set(saved)  # the tied head: stored once, a parameter once
        assert all(torch.equal(params[k], saved[k]) for k in saved)
        assert {p.dtype for p in params.values()} == {torch.float32}
        head, embed = task.model.get_output_embeddings(), task.model.get_input_embeddings()
        assert head.weight is embed.weight  # tied on load, as the config says
        assert task.model.training
    model = tasks[0].model
    x, y = fixed_batch()
    with torch.no_grad():
        loaded = hf.causal_lm_loss(model.eval(), x, y).item()
        assert loaded == hf.causal_lm_loss(saved_model, x, y).item()
        fresh = hf.build_model(f"hf:{config_dir(tmp_path / 'bare')}", seed=0)
        random_init = hf.causal_lm_loss(fresh, x, y).item()
    assert loaded < random_init - 0.1, (loaded, random_init)  # trained, not any init
    assert tasks[0].eval_loss(model) == tasks[0].eval_loss(saved_model)


def test_no_weights_is_a_random_init_and_says_so(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    d = config_dir(tmp_path / "bare")
    with caplog.at_level(logging.INFO, logger="ddiloco.learner.hf"):
        a = hf.build_model(f"hf:{d}", seed=3)
    assert f"no weights in {d}: random init" in caplog.text
    b = hf.build_model(f"hf:{d}", seed=3)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


def test_untied_sharded_weights_load_whole(tmp_path: Path, no_unpickling: None) -> None:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(5)
    net = AutoModelForCausalLM.from_config(
        llama_config(tie_word_embeddings=False), dtype=torch.float32
    )
    d = tmp_path / "sharded"
    net.save_pretrained(str(d), safe_serialization=True, max_shard_size="20KB")
    assert (d / weights.SAFETENSORS_INDEX).is_file() and not (d / weights.SAFETENSORS).exists()
    found = weights.find(d)
    assert found is not None and len(found.files) > 1
    torch.save({"x": torch.zeros(1)}, d / "training_state.pt")  # beside safetensors: ignored
    model = hf.build_model(f"hf:{d}", seed=0)
    want = net.state_dict()
    got = model.state_dict()
    assert set(got) == set(want) and "lm_head.weight" in got
    assert all(torch.equal(got[k], want[k]) for k in want)
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    (d / found.files[-1].name).unlink()
    with pytest.raises(WeightsError, match=r"names model-.*\.safetensors, which is not in"):
        hf.build_model(f"hf:{d}")


@pytest.mark.parametrize("name", ["pytorch_model.bin", "model.pt", "weights.pth", "last.ckpt"])
def test_pickle_only_weights_are_refused_unopened(
    trained: tuple[Path, Any, Path], tmp_path: Path, name: str, no_unpickling: None
) -> None:
    d = config_dir(tmp_path / "pickled")
    torch.save(trained[1].state_dict(), d / name)
    with pytest.raises(WeightsError) as e:
        hf.build_model(f"hf:{d}", seed=0)
    line = str(e.value)
    assert str(d / name) in line and "safetensors" in line and "\n" not in line
    with pytest.raises(WeightsError, match="pickle weights"):
        learner_cli.check_model_and_data(f"hf:{d}", None, None)
    shutil.copyfile(trained[0] / "model.safetensors", d / "model.safetensors")
    assert hf.build_model(f"hf:{d}", seed=0).model.norm.weight.shape == (32,)  # pickle ignored


def test_the_learner_refuses_pickle_weights_in_one_line(
    trained: tuple[Path, Any, Path],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    no_unpickling: None,
) -> None:
    d = config_dir(tmp_path / "pickled")
    torch.save(trained[1].state_dict(), d / "pytorch_model.bin")
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    with pytest.raises(SystemExit) as e:
        learner_cli.main(["--model", f"hf:{d}", "--learner-id", "l0"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("ddiloco learner: error: "), err
    assert "pytorch_model.bin" in err and "convert them to safetensors" in err


def test_weights_that_are_not_the_configs_model_are_refused_by_tensor(
    trained: tuple[Path, Any, Path], tmp_path: Path
) -> None:
    src = trained[0]
    narrow = copy_weights(src, tmp_path / "narrow", intermediate_size=48)
    with pytest.raises(WeightsError) as e:
        hf.build_model(f"hf:{narrow}", seed=0)
    assert "tensor model.layers.0.mlp.gate_proj.weight is [64, 32] in the file, [48, 32]" in str(
        e.value
    )
    deeper = copy_weights(src, tmp_path / "deeper", num_hidden_layers=3)
    with pytest.raises(
        WeightsError, match=r"model\.layers\.2\.self_attn\.q_proj\.weight .* not in the file"
    ):
        hf.build_model(f"hf:{deeper}", seed=0)
    untied = copy_weights(src, tmp_path / "untied", tie_word_embeddings=False)
    with pytest.raises(WeightsError, match=r"tensor lm_head\.weight \[256, 32\] of the model"):
        hf.build_model(f"hf:{untied}", seed=0)
    shallow = copy_weights(src, tmp_path / "shallow", num_hidden_layers=1)
    with pytest.raises(WeightsError, match=r"tensor model\.layers\.1\..* of the file is not in"):
        hf.build_model(f"hf:{shallow}", seed=0)
    # `ddiloco learner`, which loads them in its training process: exit 2, one line
    argv = ["learner", "--model", f"hf:{narrow}", "--learner-id", "l0", "--device", "cpu"]
    done = subprocess.run(
        [sys.executable, "-P", "-m", "ddiloco.cli.main", *argv, "--sync-url", "http://127.0.0.1:9"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env_with(DDILOCO_TOKEN="t", OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(tmp_path)),
    )
    assert done.returncode == 2, done.stderr[-2000:]
    assert done.stderr.startswith(f"ddiloco learner: error: {narrow / 'model.safetensors'} ")
    assert "tensor model.layers.0.mlp.gate_proj.weight is [64, 32] in the file" in done.stderr
    assert done.stderr.count("\n") == 1, done.stderr


def test_unusable_safetensors_layouts_are_refused(tmp_path: Path) -> None:
    d = config_dir(tmp_path / "odd")
    (d / "adapter_model.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"adapter_model\.safetensors: not a model's weights"):
        weights.find(d)
    (d / "model-00001-of-00002.safetensors").write_bytes(b"")
    with pytest.raises(WeightsError, match=r"without model\.safetensors\.index\.json"):
        weights.find(d)
    (d / "model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(WeightsError, match="not a readable safetensors file"):
        weights.shapes(weights.find(d))  # type: ignore[arg-type]
    assert weights.find(config_dir(tmp_path / "bare")) is None


# ---- --init-from -----------------------------------------------------------------------
def test_init_from_a_save_pretrained_dir_is_loading_its_weights(
    trained: tuple[Path, Any, Path], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    src, _, text = trained
    job = config_dir(tmp_path / "job")
    with caplog.at_level(logging.INFO, logger="ddiloco.learner.hf"):
        task = build_task(preset=f"hf:{job}", data=str(text), batch_size=2, init_from=str(src))
    assert "loaded pretrained weights from" in caplog.text and "--init-from" in caplog.text
    direct = build_task(preset=f"hf:{src}", data=str(text), batch_size=2)
    a, b = task.model.state_dict(), direct.model.state_dict()
    assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a)
    weights.check(f"hf:{job}", None, str(src))  # the CLIs' check passes


def test_init_from_another_architecture_is_refused_naming_it(
    trained: tuple[Path, Any, Path], tmp_path: Path
) -> None:
    src = trained[0]
    deeper = config_dir(tmp_path / "deeper", num_hidden_layers=3)
    for call in (
        lambda: weights.check(f"hf:{deeper}", None, str(src)),
        lambda: hf.build_model(f"hf:{deeper}", init_from=str(src)),
    ):
        with pytest.raises(WeightsError, match=r"num_hidden_layers is 2 in its config\.json, 3"):
            call()
    with pytest.raises(WeightsError, match="model_type is 'llama' there, 'gpt2'"):
        d = tmp_path / "gpt2"
        d.mkdir()
        gpt2 = {"model_type": "gpt2", "vocab_size": 256, "n_positions": 64, "n_embd": 32}
        (d / "config.json").write_text(json.dumps(gpt2 | {"n_layer": 1, "n_head": 2}))
        weights.check(f"hf:{d}", None, str(src))
    # the context length may differ: a job trains shorter windows of the same model
    weights.check(
        f"hf:{config_dir(tmp_path / 'short', max_position_embeddings=32)}", None, str(src)
    )
    with pytest.raises(WeightsError, match="no such directory"):
        weights.check("tiny", None, str(tmp_path / "missing"))
    with pytest.raises(WeightsError, match=r"no model\.safetensors"):
        weights.check("tiny", None, str(tmp_path / "deeper"))
    with pytest.raises(WeightsError, match="holds a Hugging Face llama model, not the job's GPT"):
        weights.check("tiny", None, str(src))


@pytest.fixture(scope="module")
def gpt_export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`ddiloco export` of a GPT 'tiny' job whose global model moved off its init (one merge)."""
    tmp = tmp_path_factory.mktemp("gpt-export")
    run_job(tmp / "state", "tiny")
    assert export.main(["--state-dir", str(tmp / "state"), "--out", str(tmp / "out")]) == 0
    return tmp / "out"


def test_init_from_a_gpt_export_seeds_the_synchronizer(
    gpt_export: Path,
    trained: tuple[Path, Any, Path],
    make_sync_server: Callable[..., SyncServer],
    no_unpickling: None,
) -> None:
    exported = load_file(str(gpt_export / "model.safetensors"))
    torch.manual_seed(0)
    seeded = dict(build_model("tiny").named_parameters())
    assert not all(torch.equal(seeded[k], exported[k]) for k in exported)  # not the seed's init
    server = make_sync_server(quorum=1, grace=False)
    cfg = LearnerConfig(
        sync_url=server.url,
        token=server.token,
        learner_id="l0",
        model="tiny",
        data=str(trained[2]),
        init_from=str(gpt_export),
        batch_size=2,
        max_steps=2,  # fewer than any fragment's first hand-over: the job stays at its init
        log_every=0,
        poll_s=0.2,
        device="cpu",
    )
    summary = train(cfg)
    assert summary["steps"] == 2 and summary["handovers"] == 0
    client = server.client()
    status = client.status()
    assert status.initialized and len(status.fragments) == cfg.num_fragments
    served: dict[str, torch.Tensor] = {}
    for f in status.fragments:
        version, tensors = client.fragment(f.index)
        assert version == 0
        served |= tensors
    client.close()
    assert set(served) == set(exported)
    for name, t in exported.items():
        # the job's initial model: the export, in the broadcast's dtype
        assert torch.equal(served[name], t.to(served[name].dtype)), name
    # and every learner's local model starts from it too
    task = build_task(preset="tiny", data=str(trained[2]), batch_size=2, init_from=str(gpt_export))
    params = dict(task.model.named_parameters())
    assert all(torch.equal(params[k], exported[k]) for k in exported)


def test_init_from_a_gpt_export_of_another_preset_is_refused(
    gpt_export: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(
        WeightsError, match=r"block_size is 64 in its config\.json, 128 in the preset 'small'"
    ):
        weights.check("small", None, str(gpt_export))
    bare = tmp_path / "bare"  # no config.json: the tensors themselves are checked
    bare.mkdir()
    shutil.copyfile(gpt_export / "model.safetensors", bare / "model.safetensors")
    weights.check("tiny", None, str(bare))
    why = r"tensor wte\.weight is \[256, 64\] in the file, \[256, 128\] in the model"
    with pytest.raises(WeightsError, match=why):
        weights.check("small", None, str(bare))
    with pytest.raises(WeightsError, match=why):
        build_task(preset="small", init_from=str(bare))
    with pytest.raises(WeightsError, match="holds a gpt model 'tiny', not the job's llama"):
        weights.check("hf:llama-tiny", None, str(gpt_export))
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    with pytest.raises(SystemExit) as e:
        learner_cli.main(["--model", "small", "--init-from", str(bare)])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "wte.weight is [256, 64] in the file" in err, err


def test_init_from_is_a_learner_setting(tmp_path: Path) -> None:
    args = learner_cli.parse(["--init-from", str(tmp_path)])
    assert learner_cli.build_config(args, {}).init_from == str(tmp_path)
    cfg = LearnerConfig.from_env({"DDILOCO_INIT_FROM": "/models/x"}, strict=True)
    assert cfg.init_from == "/models/x"
