"""Learner settings: environment names (as the operator sets them), flags over env, validation.

pytest tests/unit/test_learner_config.py
"""

from __future__ import annotations

import logging
import os
import sys
import types

import pytest

from ddiloco.learner.cli import NOT_CONFIG, build_config, parse
from ddiloco.learner.config import READ_ELSEWHERE, LearnerConfig


def test_env_names_match_the_operator_contract() -> None:
    env = {
        "DDILOCO_SYNC_URL": "http://sync:8470",
        "DDILOCO_TOKEN": "t",
        "DDILOCO_LEARNER_ID": "gpu-3",
        "DDILOCO_LEARNER_INDEX": "3",
        "DDILOCO_NUM_LEARNERS": "8",
        "DDILOCO_MODEL": "small",
        "DDILOCO_H": "24",
        "DDILOCO_P": "6",
        "DDILOCO_INNER_LR": "0.001",
        "DDILOCO_MAX_STEPS": "100",
        "DDILOCO_MAX_SECONDS": "30.5",
        "DDILOCO_MAX_TOKENS": "9000",
        "DDILOCO_DATA": "/data/x.bin",
    }
    cfg = LearnerConfig.from_env(env)
    assert (cfg.sync_url, cfg.learner_id, cfg.learner_index, cfg.num_learners) == (
        "http://sync:8470",
        "gpu-3",
        3,
        8,
    )
    assert (cfg.model, cfg.h, cfg.num_fragments, cfg.inner_lr) == ("small", 24, 6, 0.001)
    assert (cfg.max_steps, cfg.max_seconds, cfg.max_tokens, cfg.data) == (
        100,
        30.5,
        9000,
        "/data/x.bin",
    )


def test_flags_override_the_environment() -> None:
    args = parse(["--learner-id", "x", "-H", "12", "-P", "3"])
    cfg = build_config(args, {"DDILOCO_LEARNER_ID": "env", "DDILOCO_H": "48", "DDILOCO_SEED": "7"})
    assert (cfg.learner_id, cfg.h, cfg.num_fragments, cfg.seed) == ("x", 12, 3, 7)


def test_every_option_is_a_field_and_every_field_has_a_variable() -> None:
    dests = {k for k in vars(parse([])) if k not in NOT_CONFIG}
    names = LearnerConfig.env_names()
    assert dests <= set(names)
    assert (names["h"], names["num_fragments"], names["inner_lr"]) == (
        "DDILOCO_H",
        "DDILOCO_P",
        "DDILOCO_INNER_LR",
    )
    assert len(set(names.values())) == len(names)


def test_strict_refuses_unread_names_and_names_them() -> None:
    env = {"DDILOCO_H": "12", "DDILOCO_FRAGMENTS": "3", "DDILOCO_QUORUM": "2", "HOME": "/root"}
    assert LearnerConfig.unread_env(env) == ["DDILOCO_FRAGMENTS", "DDILOCO_QUORUM"]
    with pytest.raises(ValueError, match="DDILOCO_FRAGMENTS, DDILOCO_QUORUM"):
        LearnerConfig.from_env(env, strict=True)
    assert LearnerConfig.from_env(env).num_fragments == 4  # not strict: P stays the default
    # names read by something else are accepted (READ_ELSEWHERE is their one list)
    cfg = LearnerConfig.from_env(
        {"DDILOCO_H": "12", **dict.fromkeys(READ_ELSEWHERE, "x")}, strict=True
    )
    assert cfg.h == 12


@pytest.mark.parametrize(
    ("var", "raw"),
    [
        ("DDILOCO_H", "twelve"),
        ("DDILOCO_H", "12.0"),
        ("DDILOCO_INNER_LR", "fast"),
        ("DDILOCO_GRAD_CLIP", "nan"),  # would have disabled clipping (nan > 0 is False)
        ("DDILOCO_UPLOAD_HTTP2", "ture"),  # was read as False
        ("DDILOCO_ADOPTION", "overwirte"),  # was read as is, and acted as overwrite
        ("DDILOCO_UPDATE_ENCODING", "float16"),  # not a job encoding (wire/encodings.py)
    ],
)
def test_a_value_that_does_not_parse_names_its_variable(var: str, raw: str) -> None:
    with pytest.raises(ValueError, match=var):
        LearnerConfig.from_env({var: raw})


@pytest.mark.parametrize(
    ("raw", "value"), [("1", True), ("Yes", True), ("off", False), ("0", False)]
)
def test_booleans_from_the_environment(raw: str, value: bool) -> None:
    assert LearnerConfig.from_env({"DDILOCO_UPLOAD_HTTP2": raw}).upload_http2 is value


def test_optional_and_literal_fields_from_the_environment() -> None:
    cfg = LearnerConfig.from_env(
        {"DDILOCO_MODEL_ENTRY": "m:f", "DDILOCO_ADOPTION": "overwrite", "DDILOCO_LOG_PATH": ""}
    )
    assert (cfg.model_entry, cfg.adoption, cfg.log_path) == ("m:f", "overwrite", None)


def test_mix_alpha_needs_overwrite() -> None:
    # rebase never mixes (diloco.py), so a mix_alpha with it would change nothing
    with pytest.raises(ValueError, match="mix_alpha"):
        LearnerConfig(mix_alpha=0.5)
    assert LearnerConfig(mix_alpha=0.5, adoption="overwrite").mix_alpha == 0.5


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_fragments", 30),
        ("learner_index", 5),
        ("slow_factor", 0.5),
        ("max_tokens", -1),
        ("adoption", "merge"),
        ("update_encoding", "float16"),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LearnerConfig(**{field: value, "num_learners": 2})  # type: ignore[arg-type]


def test_the_token_never_shows_in_repr() -> None:
    assert "s3cret" not in repr(LearnerConfig(token="s3cret"))


def test_main_warns_of_unread_names_and_trains_with_env_and_flags(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from ddiloco.learner import cli

    trained: list[LearnerConfig] = []
    fake = types.ModuleType("ddiloco.learner.train")  # no torch, no network
    fake.init_logging = lambda *a, **k: None  # type: ignore[attr-defined]
    fake.train = trained.append  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "ddiloco.learner.train", fake)
    for name in [k for k in os.environ if k.startswith("DDILOCO_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DDILOCO_TOKEN", "t")
    monkeypatch.setenv("DDILOCO_H", "12")
    monkeypatch.setenv("DDILOCO_INNER_STEPS", "48")  # the CRD's name, not the learner's
    with caplog.at_level(logging.WARNING):
        assert cli.main(["-P", "3"]) == 0
    [cfg] = trained
    assert (cfg.token, cfg.h, cfg.num_fragments) == ("t", 12, 3)
    assert "DDILOCO_INNER_STEPS" in caplog.text


def test_group_and_data_settings_from_the_environment() -> None:
    env = {
        "DDILOCO_NPROC_PER_NODE": "8",
        "DDILOCO_PARALLEL": "fsdp2",
        "DDILOCO_TOKENIZER": "/models/tok",
        "DDILOCO_DATA_FIELD": "content",
    }
    cfg = LearnerConfig.from_env(env, strict=True)
    assert (cfg.nproc_per_node, cfg.parallel, cfg.tokenizer, cfg.data_field) == (
        8,
        "fsdp2",
        "/models/tok",
        "content",
    )
    for var, raw in [("DDILOCO_NPROC_PER_NODE", "0"), ("DDILOCO_PARALLEL", "zero3")]:
        with pytest.raises(ValueError, match=var):
            LearnerConfig.from_env({var: raw})


def test_a_plain_config_reads_no_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    # only from_env reads variables: a LearnerConfig built in code is what the code says
    monkeypatch.setenv("DDILOCO_H", "48")
    monkeypatch.setenv("DDILOCO_ADOPTION", "rebse")
    assert LearnerConfig().h == 24
    with pytest.raises(ValueError, match="DDILOCO_ADOPTION='rebse'"):
        LearnerConfig.from_env()
