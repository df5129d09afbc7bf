"""`ddiloco export` from a synchronizer's state directory (cli/export.py).

    OMP_NUM_THREADS=1 .venv/bin/pytest tests/unit/test_export.py

A synchronizer runs in-process on tmp_path and is initialized the way a learner does it (the
init payload carries the layout and the model spec); its global model is moved off the init
by one merge, then exported and loaded back: with `from_pretrained` for an hf: model, into a
`GPT` for a preset. The export over HTTP (`--sync-url`) is in tests/e2e/test_export_e2e.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from ddiloco.cli import export
from ddiloco.learner import hf
from ddiloco.learner.fragments import partition
from ddiloco.learner.model import GPT, GPTConfig
from ddiloco.learner.task import build_task
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.synchronizer.storage.state import StateStore
from ddiloco.wire import codec
from ddiloco.wire.errors import PayloadError, SyncError
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    MODEL_KEY,
    JoinRequest,
    ModelSpec,
    UpdateMeta,
)

torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def token_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))


def run_job(state: Path, model: str, tokenizer: str | None = None) -> dict[str, torch.Tensor]:
    """Initialize a synchronizer on `state` with `model`'s task, merge one update into every
    fragment, and return the global parameters it then holds."""
    data = state.parent / "docs.jsonl"
    data.write_text("".join(json.dumps({"text": f"document {i} " * 40}) + "\n" for i in range(30)))
    task = build_task(preset=model, data=str(data), tokenizer=tokenizer)
    params = {k: v.detach().clone() for k, v in task.model.named_parameters()}
    layout = partition(task.model.named_parameters(), 2, task.embedding_params)
    sync = Synchronizer(
        SyncSettings(token="t", state_dir=state, quorum=1, grace=False, outer_momentum=0.0)
    )
    sync.join(JoinRequest(learner_id="l0"))
    meta = {
        LAYOUT_KEY: layout.model_dump_json(),
        MODEL_KEY: hf.spec_metadata(model, None, tokenizer),
    }
    sync.init(codec.encode(params, meta))
    torch.manual_seed(1)
    for f in layout.fragments:
        delta = {t.name: 0.01 * torch.randn(t.shape) for t in f.tensors}
        um = UpdateMeta(
            learner_id="l0", fragment=f.index, base_version=0, steps=4, tokens=64, learner_step=4
        )
        sync.submit(codec.encode(delta, um.to_metadata()), f.index)
        assert sync.merge(f.index) == 1
    out = {k: v for f in sync.fragments for k, v in f.state.params.items()}
    sync.close()
    assert not all(torch.equal(out[k], params[k]) for k in params)  # it moved
    return out


def test_hf_export_loads_with_from_pretrained(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    global_params = run_job(tmp_path / "state", "hf:llama-tiny")
    assert StateStore(tmp_path / "state").load("model.json")["kind"] == "hf"
    assert (
        export.main(["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "out")]) == 0
    )
    names = {p.name for p in (tmp_path / "out").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "ddiloco_export.json"} <= names
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "out", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched key
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in global_params.items())
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied again on load
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "pt") as f:
        stored = set(f.keys())
    assert stored == set(state) - {"lm_head.weight"}  # the tied head is stored once
    tok = AutoTokenizer.from_pretrained(tmp_path / "out")
    assert tok("abc", add_special_tokens=False)["input_ids"] == [97, 98, 99]
    info_file = json.loads((tmp_path / "out" / "ddiloco_export.json").read_text())
    assert info_file["versions"] == [1, 1] and info_file["model"] == "hf:llama-tiny"


def test_untied_hf_export_keeps_the_head(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    d = tmp_path / "untied"
    d.mkdir()
    config = json.loads((hf.SHIPPED["llama-tiny"] / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"tie_word_embeddings": False}))
    tok = str(hf.SHIPPED["llama-tiny"])
    global_params = run_job(tmp_path / "state", f"hf:{d}", tokenizer=tok)
    assert export.main(["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "o")]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(tmp_path / "o", output_loading_info=True)
    assert not any(info.values()), info
    assert torch.equal(model.lm_head.weight, global_params["lm_head.weight"])
    assert not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)
    assert (tmp_path / "o" / "tokenizer.json").read_text() == (
        Path(tok) / "tokenizer.json"
    ).read_text()


def test_gpt_export_is_its_state_dict_and_names_the_preset(tmp_path: Path) -> None:
    global_params = run_job(tmp_path / "state", "tiny")
    assert export.main(["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "o")]) == 0
    config = json.loads((tmp_path / "o" / "config.json").read_text())
    assert config["ddiloco_model"] == "tiny" and config["kind"] == "gpt"
    fields = {k: v for k, v in config.items() if k not in ("ddiloco_model", "kind")}
    model = GPT(GPTConfig(**fields))
    model.load_state_dict(load_file(str(tmp_path / "o" / "model.safetensors")))  # strict
    assert all(torch.equal(model.state_dict()[k], v) for k, v in global_params.items())


def test_a_job_that_said_nothing_exports_its_parameters(tmp_path: Path) -> None:
    sync = Synchronizer(SyncSettings(token="t", state_dir=tmp_path / "state"))
    params = {"a": torch.ones(3), "b": torch.zeros(2, 2)}
    layout = partition(((k, v.requires_grad_()) for k, v in params.items()), 1)
    sync.init(codec.encode(params, {LAYOUT_KEY: layout.model_dump_json()}))
    sync.close()
    assert not (tmp_path / "state" / "model.json").exists()
    assert export.main(["--state-dir", str(tmp_path / "state"), "--out", str(tmp_path / "o")]) == 0
    back = load_file(str(tmp_path / "o" / "model.safetensors"))
    assert back.keys() == params.keys() and torch.equal(back["a"], params["a"])


def test_init_with_a_bad_model_spec_is_refused(tmp_path: Path) -> None:
    sync = Synchronizer(SyncSettings(token="t", state_dir=tmp_path))
    params = {"a": torch.ones(3)}
    layout = partition(((k, v.requires_grad_()) for k, v in params.items()), 1)
    for spec in ('{"kind": "rocket"}', '{"files": {"../../etc/x": "y"}}', "[1", "{" * 500):
        with pytest.raises(PayloadError, match="model spec"):
            sync.init(codec.encode(params, {LAYOUT_KEY: layout.model_dump_json(), MODEL_KEY: spec}))
    assert sync.layout is None and not (tmp_path / "layout.json").exists()
    with pytest.raises(SyncError, match=r"no global model") as refused:
        sync.model_spec()
    assert refused.value.status == 409
    sync.init(codec.encode(params, {LAYOUT_KEY: layout.model_dump_json()}))
    assert sync.model_spec() == ModelSpec()  # initialized without one: kind "unknown"


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        ("missing", "does not exist"),
        ("empty", "no learner has initialized"),
        ("file_out", "is not a directory"),
    ],
)
def test_errors_are_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], setup: str, message: str
) -> None:
    state, out = tmp_path / "state", tmp_path / "out"
    if setup == "empty":
        state.mkdir()
    if setup == "file_out":
        run_job(state, "tiny")
        out.write_text("a file")
    assert export.main(["--state-dir", str(state), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco export: error: ") and message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_sync_url_errors_need_no_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DDILOCO_TOKEN", raising=False)
    out = str(tmp_path / "o")
    assert export.main(["--sync-url", "http://127.0.0.1:9", "--out", out]) == 2
    assert "no token" in capsys.readouterr().err
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    assert export.main(["--sync-url", "ftp://x", "--out", out]) == 2
    assert "not an http:// or https:// URL" in capsys.readouterr().err
    assert export.main(["--sync-url", "http://127.0.0.1:9", "--out", out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ddiloco export: error: cannot reach") and err.count("\n") == 1
