"""`ddiloco evaluate` (learner/evaluate.py): when it measures, and what it refuses before it
starts (one line, exit 2).

    .venv/bin/pytest tests/unit/test_evaluate_cli.py

The whole command against a real job is tests/e2e/test_evaluate.py.
"""

from __future__ import annotations

import pytest

from ddiloco.learner import evaluate


@pytest.mark.parametrize(
    ("version", "now", "last", "every_versions", "every_s", "expected"),
    [
        (0, 0.0, None, 0, 300.0, True),  # the first measurement, whatever the schedule
        (9, 10.0, (0, 0.0), 10, 0.0, False),  # 9 merges of 10
        (10, 10.0, (0, 0.0), 10, 0.0, True),
        (1, 299.0, (0, 0.0), 0, 300.0, False),  # T not yet passed
        (1, 300.0, (0, 0.0), 0, 300.0, True),
        (0, 900.0, (0, 0.0), 0, 300.0, False),  # T passed, but the model did not change
        (3, 5.0, (0, 0.0), 10, 300.0, False),
        (12, 5.0, (0, 0.0), 10, 300.0, True),  # N or T, whichever comes first
    ],
)
def test_when_it_measures(
    version: int,
    now: float,
    last: tuple[int, float] | None,
    every_versions: int,
    every_s: float,
    expected: bool,
) -> None:
    assert evaluate.due(version, now, last, every_versions, every_s) is expected


@pytest.mark.parametrize(
    ("argv", "env", "needle"),
    [
        (["--every-seconds", "0"], {"DDILOCO_TOKEN": "t"}, "give --every-versions N"),
        (["--every-versions", "-1"], {"DDILOCO_TOKEN": "t"}, "must be >= 0"),
        (["--eval-batches", "0"], {"DDILOCO_TOKEN": "t"}, "--eval-batches 0"),
        (["--poll-seconds", "0"], {"DDILOCO_TOKEN": "t"}, "--poll-seconds 0"),
        ([], {}, "no token"),
        (["--data", "/nonexistent/corpus.txt"], {"DDILOCO_TOKEN": "t"}, "does not exist"),
        (["--model", "huge"], {"DDILOCO_TOKEN": "t"}, "unknown model preset 'huge'"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(
    argv: list[str],
    env: dict[str, str],
    needle: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    for name in ("DDILOCO_TOKEN", "DDILOCO_TOKEN_FILE"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with pytest.raises(SystemExit) as e:
        evaluate.main(["--sync-url", "http://127.0.0.1:9", *argv])
    assert e.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()[-1:]
    assert line.startswith("ddiloco evaluate: error: ") and needle in line, line
