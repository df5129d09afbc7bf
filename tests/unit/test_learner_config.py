"""Learner settings: environment names (as the operator sets them), flags over env, validation.

pytest tests/unit/test_learner_config.py
"""

from __future__ import annotations

import pytest

from ddiloco.learner.cli import parse
from ddiloco.learner.config import LearnerConfig


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
        "DDILOCO_TAU": "2",
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
    assert (cfg.model, cfg.h, cfg.num_fragments, cfg.tau, cfg.inner_lr) == (
        "small",
        24,
        6,
        2,
        0.001,
    )
    assert (cfg.max_steps, cfg.max_seconds, cfg.max_tokens, cfg.data) == (
        100,
        30.5,
        9000,
        "/data/x.bin",
    )


def test_flags_override_the_environment() -> None:
    args = parse(["--learner-id", "x", "-H", "12", "-P", "3"])
    overrides = {k: v for k, v in vars(args).items() if k not in ("token_file", "log_level")}
    cfg = LearnerConfig.from_env({"DDILOCO_LEARNER_ID": "env", "DDILOCO_H": "48"}, **overrides)
    assert (cfg.learner_id, cfg.h, cfg.num_fragments) == ("x", 12, 3)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_fragments", 30),
        ("learner_index", 5),
        ("tau", 0),
        ("slow_factor", 0.5),
        ("max_tokens", -1),
    ],
)
def test_invalid_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=field):
        LearnerConfig(**{field: value, "num_learners": 2})  # type: ignore[arg-type]


def test_the_token_never_shows_in_repr() -> None:
    assert "s3cret" not in repr(LearnerConfig(token="s3cret"))
