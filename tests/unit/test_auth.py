"""Bearer tokens from a file that rotates (wire/auth.py), the TLS settings'
validation (synchronizer/config.py, learner/config.py), and the learner's upload loop keeping
an update that met a 401 until its token file catches up.

    .venv/bin/python -m pytest -q tests/unit/test_auth.py
"""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from ddiloco.learner.config import LearnerConfig
from ddiloco.learner.streaming import Streamer
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.wire import codec
from ddiloco.wire.auth import StaticTokens, TokenFile, parse_tokens, token_matches
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)


def test_parse_and_match() -> None:
    assert parse_tokens("new\n\n  old \r\n") == ["new", "old"]
    assert token_matches("old", ["new", "old"]) and token_matches("new", ["new", "old"])
    assert not token_matches("ol", ["new", "old"]) and not token_matches("", ["new", ""])
    assert not token_matches("x", [])
    assert StaticTokens(" t \n").accepted() == ["t"]
    with pytest.raises(ValueError):
        StaticTokens("  ")


def test_a_rewritten_file_is_picked_up(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("old\n")
    tokens = TokenFile(path)
    assert tokens.accepted() == ["old"] and tokens.current() == "old"
    path.write_text("new\nold\n")  # rotation, step 1
    assert tokens.accepted() == ["new", "old"] and tokens.current() == "new"
    path.write_text("new\n")  # step 2: the old one is no longer accepted
    assert tokens.accepted() == ["new"]
    assert not tokens.refresh()  # nothing changed since


def test_a_kubernetes_style_symlink_swap_is_picked_up(tmp_path: Path) -> None:
    # kubelet writes ..<timestamp>/token, points ..data at it and token at ..data/token
    def publish(version: str, text: str) -> None:
        d = tmp_path / f"..{version}"
        d.mkdir()
        (d / "token").write_text(text)
        tmp_link = tmp_path / "..data_tmp"
        tmp_link.symlink_to(d.name)
        os.replace(tmp_link, tmp_path / "..data")

    publish("v1", "aaa\n")
    (tmp_path / "token").symlink_to("..data/token")
    tokens = TokenFile(tmp_path / "token", max_age_s=3600)  # only the stat may notice
    assert tokens.current() == "aaa"
    publish("v2", "bbb\n")  # same size, another inode
    assert tokens.current() == "bbb"


def test_an_emptied_or_missing_file_keeps_the_last_tokens(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text("t1\n")
    tokens = TokenFile(path)
    path.write_text("\n\n")
    assert tokens.accepted() == ["t1"]
    path.unlink()
    assert tokens.accepted() == ["t1"] and not tokens.refresh()
    path.write_text("t2")
    assert tokens.accepted() == ["t2"]
    with pytest.raises(ValueError, match="holds no token"):
        TokenFile(tmp_path / "absent")
    (tmp_path / "empty").write_text("")
    with pytest.raises(ValueError, match="holds no token"):
        TokenFile(tmp_path / "empty")


def test_sync_settings_tls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(name)
    (tmp_path / "token").write_text("new\nold\n")
    monkeypatch.setenv("DDILOCO_TOKEN_FILE", str(tmp_path / "token"))
    monkeypatch.setenv("DDILOCO_TLS_CERT_FILE", "/etc/ddiloco/tls.crt")
    monkeypatch.setenv("DDILOCO_TLS_KEY_FILE", "/etc/ddiloco/tls.key")
    monkeypatch.setenv("DDILOCO_TLS_CLIENT_CA_FILE", "/etc/ddiloco/ca.crt")
    s = SyncSettings(_env_file=None)  # type: ignore[call-arg]
    assert s.tls and s.tls_client_ca_file == Path("/etc/ddiloco/ca.crt")
    assert s.tokens().accepted() == ["new", "old"] and s.bearer_token() == "new"
    for name in ("DDILOCO_TLS_CERT_FILE", "DDILOCO_TLS_KEY_FILE", "DDILOCO_TLS_CLIENT_CA_FILE"):
        monkeypatch.delenv(name)
    assert not SyncSettings(token="t").tls
    with pytest.raises(ValidationError, match="DDILOCO_TLS_KEY_FILE"):
        SyncSettings(token="t", tls_cert_file=Path("c"))
    with pytest.raises(ValidationError, match="DDILOCO_TLS_CLIENT_CA_FILE"):
        SyncSettings(token="t", tls_client_ca_file=Path("ca"))


def test_learner_tls_and_token_file(tmp_path: Path) -> None:
    (tmp_path / "token").write_text("\nfirst\nsecond\n")
    env = {
        "DDILOCO_SYNC_URL": "https://sync.example:8470",
        "DDILOCO_TOKEN_FILE": str(tmp_path / "token"),
        "DDILOCO_CA_FILE": "/tls/ca.crt",
        "DDILOCO_CLIENT_CERT_FILE": "/tls/learner.crt",
        "DDILOCO_CLIENT_KEY_FILE": "/tls/learner.key",
    }
    cfg = LearnerConfig.from_env(env, strict=True)  # every name is read
    assert cfg.token_source().current() == "first"
    t = cfg.client_tls()
    assert (t.ca_file, t.cert_file, t.key_file) == (
        "/tls/ca.crt",
        "/tls/learner.crt",
        "/tls/learner.key",
    )
    with pytest.raises(ValueError, match="DDILOCO_CLIENT_KEY_FILE"):
        LearnerConfig.from_env({k: v for k, v in env.items() if k != "DDILOCO_CLIENT_KEY_FILE"})
    with pytest.raises(ValueError, match="no token"):
        LearnerConfig().token_source()
    # DDILOCO_TOKEN wins over the file, as on the synchronizer
    assert (
        LearnerConfig(token="env", token_file=env["DDILOCO_TOKEN_FILE"]).token_source().current()
        == "env"
    )


def test_an_upload_refused_401_is_kept_and_resent_after_rotation(
    sync_server: Any, tmp_path: Path
) -> None:
    # a real in-process synchronizer (tests/conftest.py) and the learner's real upload loop
    layout = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w0", shape=[8])])])
    admin = sync_server.client()
    joined = admin.join(JoinRequest(learner_id="l0", layout_digest=layout.digest()))
    admin.init(codec.encode({"w0": torch.ones(8)}, {LAYOUT_KEY: layout.model_dump_json()}))
    token_file = tmp_path / "token"
    token_file.write_text("not-yet-rotated\n")
    cfg = LearnerConfig(sync_url=sync_server.url, token_file=str(token_file), learner_id="l0")
    streamer = Streamer(cfg, layout, dict)
    t = threading.Thread(target=streamer._upload_loop, daemon=True)
    t.start()
    streamer.threads.append(t)
    meta = UpdateMeta(
        learner_id="l0",
        fragment=0,
        base_version=0,
        steps=4,
        tokens=40,
        learner_step=4,
        incarnation=joined.incarnation,
    )
    streamer.send(meta, {"w0": torch.full((8,), 0.01)})
    deadline = time.time() + 10
    while streamer.ledger()[0]["attempts"] < 2:  # refused with 401, and sent again
        assert time.time() < deadline
        time.sleep(0.01)
    assert streamer.ledger()[0]["refused_uploads"] == 0 and streamer.outbox.queued() == [meta]
    token_file.write_text(f"{sync_server.token}\n")  # the Secret catches up
    assert streamer.outbox.wait_empty(10)
    assert streamer.results() == [(0, 0, "accepted")]
    assert streamer.close(drain_s=0.1) == {}
    assert admin.status().refusals.get("unauthorized", 0) >= 2
