"""The report's series over time (local/samples.py), the HTML page's pieces (local/report_html.py)
and the CLI around them: `ddiloco local report DIR` and `--tensorboard` without tensorboardX.

pytest tests/unit/test_report_html.py
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from ddiloco.local.goodput import busy_seconds
from ddiloco.local.report_html import main as report_main
from ddiloco.local.report_html import render
from ddiloco.local.samples import BusyClock, merged_at, thin, timeseries
from ddiloco.local.svg import ticks

spans = st.lists(
    st.tuples(st.floats(0, 100), st.floats(0, 5)).map(lambda p: (p[0], p[0] + p[1])), max_size=30
)


@given(spans, spans, st.floats(-5, 110), st.floats(0, 20), st.floats(50, 100))
def test_busy_clock_matches_busy_seconds_up_to_any_moment(work, idle, t, a, b) -> None:
    clock = BusyClock(work, (a, b), idle)
    expected = busy_seconds(work, (a, min(b, t)), idle) if t > a else 0.0
    assert abs(clock.until(t) - expected) < 1e-6


def sample(t: float, version: int, merged: int, contributions: dict[str, int]) -> dict:
    return {
        "t": t,
        "version": version,
        "merges": version,
        "tokens_merged": merged,
        "bytes_up": 100 * version,
        "bytes_down": 300 * version,
        "contributions": contributions,
        "loss": {},
        "step": {},
    }


def test_timeseries_counts_tokens_and_goodput_up_to_each_sample() -> None:
    t0 = 1000.0
    steps = [{"t": t0 + k + 1, "dt": 1.0, "step": k + 1} for k in range(10)]  # busy 0..10
    samples = [sample(2.0, 1, 10, {"a": 1}), sample(5.0, 3, 30, {"a": 3}), sample(10.0, 4, 40, {})]
    rows = timeseries(
        samples,
        {"a": steps, "b": []},
        t0=t0,
        t1=t0 + 10,
        tokens_per_step=10,
        held={"a": (t0, t0 + 10), "b": (t0, t0 + 10)},
        idle={"a": [(t0 + 4, t0 + 5)]},
    )
    assert [r["tokens_computed"] for r in rows] == [20, 50, 100]
    assert [r["merged_work_ratio"] for r in rows] == [0.5, 0.6, 0.4]
    # a busy, b never: 2/4, then (5 - 1 paused) / 10, then 9 / 20
    assert [r["goodput"] for r in rows] == [0.5, 0.4, 0.45]
    assert merged_at(samples, "a") == [(2.0, 1), (5.0, 2)]
    assert merged_at(samples, "b") == []


def test_thin_keeps_short_curves_and_averages_long_ones() -> None:
    assert thin([(0.0, 1.0), (1.0, 2.0)]) == [(0.0, 1.0), (1.0, 2.0)]
    long = [(float(i), float(i % 2)) for i in range(1000)]
    out = thin(long, most=100)
    assert len(out) == 100 and all(abs(v - 0.5) < 0.11 for _, v in out)


def test_ticks_are_round_and_cover_the_range() -> None:
    assert ticks(0, 20, 10) == [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert ticks(2.3, 5.4) == [3.0, 4.0, 5.0]  # at most n: steps of 1, not 0.5
    assert ticks(0, 1) == [0, 0.2, 0.4, 0.6, 0.8, 1.0]
    assert ticks(1.0, 1.0) == [1.0]


def report_dict() -> dict:
    learner = {
        "id": "learner-0",
        "steps": 3,
        "tokens": 30,
        "contributions": 2,
        "restarts": 1,
        "goodput": 0.5,
        "compute_seconds": 5.0,
        "wait_seconds": 3.0,
        "dead_seconds": 2.0,
        "paused_seconds": 0.0,
        "kill_times": [4.0],
        "start_times": [-1.0, 6.0],
        "merged_at": [[3.0, 2]],
        "train_loss": [[1.0, 5.0], [8.0, 4.0]],
        "timeline": {"compute": [[0.0, 4.0], [6.0, 7.0]], "dead": [[4.0, 6.0]], "paused": []},
    }
    return {
        "goodput": 0.5,
        "merged_work_ratio": 0.6667,
        "eval_loss_initial": 5.5,
        "eval_loss_final": 4.25,
        "merges": 2,
        "global_version": 2,
        "tokens_computed": 30,
        "tokens_merged": 20,
        "bytes_up": 1000,
        "bytes_down": 3000,
        "learner_restarts": 1,
        "wall_seconds": 10.0,
        "mean_contributors": 1.0,
        "mean_merge_scale": 0.5,
        "sync_shards": 2,
        "fragments": [{"index": 0, "shard": 1, "version": 7, "merge": "rda"},
                      {"index": 1, "shard": 0, "version": 5, "merge": "mean"}],
        "system_uptime": 1.0,
        "eval_history": [[5.0, 4.5, 1], [10.0, 4.25, 2]],
        "chaos_applied": [{"at": 4.0, "action": "kill", "target": "learner-0", "applied_at": 4.0}],
        "timeseries": [sample(5.0, 1, 10, {}) | {"tokens_computed": 15, "goodput": 0.5,
                       "merged_work_ratio": 0.6667}],
        "config": {"learners": 1, "quorum": 1, "grace": True, "merge": "rda", "chaos": "kill",
                   "data": "/tmp/<x>.txt"},
        "learners": [learner],
    }  # fmt: skip


def test_render_escapes_and_survives_a_report_without_series() -> None:
    r = report_dict()
    r["learners"][0]["id"] = "<i>l0</i>"
    page = render(r)
    assert "<i>l0</i>" not in page and "&lt;i&gt;l0&lt;/i&gt;" in page
    assert "/tmp/&lt;x&gt;.txt" in page
    assert "killed at 4.0 s" in page and "incarnation 2 started at 6.0 s" in page
    # the shards: how many, and each fragment's owner, rule and final version
    assert "2 shard(s)" in page and "S=2" in page and "0.500" in page
    assert "<td>0</td><td>1</td><td>rda</td><td>7</td>" in page
    del r["timeseries"], r["learners"][0]["merged_at"], r["learners"][0]["train_loss"]
    del r["fragments"]
    older = render(r)  # a report.json written before the series (and the fragments) existed
    assert older.count("not recorded in this run") == 4


def test_ddiloco_local_report_rebuilds_the_page_and_refuses_a_bad_dir(tmp_path: Path) -> None:
    (tmp_path / "report.json").write_text(json.dumps(report_dict()))
    assert report_main([str(tmp_path)]) == 0
    page = (tmp_path / "report.html").read_text()
    assert 'id="stat-goodput"' in page and "0.500" in page
    assert (tmp_path / "report.png").stat().st_size > 10_000
    cli = [sys.executable, "-P", "-m", "ddiloco.cli.main", "local", "report"]
    bad = subprocess.run([*cli, str(tmp_path / "nope")], capture_output=True, text=True)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.startswith("ddiloco local report: error: cannot read")
    assert len(bad.stderr.strip().splitlines()) == 1


def test_tensorboard_flag_without_tensorboardx_is_one_line(tmp_path: Path) -> None:
    code = (
        "import sys; sys.modules['tensorboardX'] = None\n"  # as if it were not installed
        "from ddiloco.local.cli import main\n"
        f"sys.exit(main(['--tensorboard', {str(tmp_path)!r}, '--out', {str(tmp_path / 'r')!r}]))"
    )
    done = subprocess.run([sys.executable, "-P", "-c", code], capture_output=True, text=True)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "ddiloco local: error: --tensorboard needs the tensorboardX package: "
        "pip install 'decoupled-diloco[tensorboard]' (tensorboardX)"
    )
    assert not (tmp_path / "r").exists()  # refused before anything started
