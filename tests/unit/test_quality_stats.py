"""bench/quality.py's numbers and arm table: the paired t-interval against known values and
its coverage, the held-out windows against learner/data.py's eval, the parts of the run grid,
the configs every arm gets, and the comparisons built from finished runs.

pytest tests/unit/test_quality_stats.py
"""

from __future__ import annotations

import json
import math
import random
import statistics
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import load_bench

qs = load_bench("quality_stats")
quality = load_bench("quality")


# ---- Student's t --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("df", "t"),
    [(1, 12.7062), (2, 4.3027), (4, 2.7764), (9, 2.2622), (30, 2.0423), (10_000, 1.9602)],
)
def test_t_quantile_matches_the_tables(df: int, t: float) -> None:
    assert qs.t_quantile(0.975, df) == pytest.approx(t, abs=2e-4)
    assert qs.t_quantile(0.025, df) == pytest.approx(-t, abs=2e-4)


def test_t_cdf_known_values() -> None:
    assert qs.student_t_cdf(0.0, 3) == pytest.approx(0.5)
    assert qs.student_t_cdf(1.0, 1) == pytest.approx(0.75)  # Cauchy: 1/2 + atan(1)/pi
    assert qs.student_t_cdf(2.0, 5) + qs.student_t_cdf(-2.0, 5) == pytest.approx(1.0)
    assert qs.student_t_cdf(2.5706, 5) == pytest.approx(0.975, abs=1e-5)
    with pytest.raises(ValueError):
        qs.student_t_cdf(1.0, 0)
    with pytest.raises(ValueError):
        qs.t_quantile(1.0, 3)


def test_paired_interval_known_values() -> None:
    a = [2.1, 2.2, 2.3, 2.4, 2.5]
    b = [2.0] * 5
    iv = qs.paired_interval(a, b)
    sd = statistics.stdev([0.1, 0.2, 0.3, 0.4, 0.5])
    assert iv.n == 5
    assert iv.mean == pytest.approx(0.3)
    assert iv.sd == pytest.approx(sd)
    assert iv.half_width == pytest.approx(2.776445 * sd / math.sqrt(5), rel=1e-5)
    assert (iv.low, iv.high) == pytest.approx((0.3 - 0.196320, 0.3 + 0.196320), abs=1e-5)
    rel = qs.paired_interval([2.2, 2.1, 2.3], [2.0, 2.0, 2.0], relative=True)
    assert rel.values == pytest.approx((0.1, 0.05, 0.15))
    assert rel.mean == pytest.approx(0.1)
    assert rel.half_width == pytest.approx(4.302653 * 0.05 / math.sqrt(3), rel=1e-5)
    # the order of the pairs is the pairing: swapping one arm's seeds changes the interval
    assert qs.paired_interval([1.0, 2.0, 3.0], [1.1, 2.1, 3.1]).sd == pytest.approx(0.0)
    assert qs.paired_interval([1.0, 2.0, 3.0], [3.1, 2.1, 1.1]).sd > 1.0


def test_paired_interval_rejects_what_it_cannot_measure() -> None:
    with pytest.raises(ValueError, match="equal lengths"):
        qs.paired_interval([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="at least 2"):
        qs.paired_interval([1.0], [1.0])


def test_interval_covers_the_true_mean_95_percent_of_the_time() -> None:
    """5 pairs with a true mean difference of 0.3: the t-interval covers it in ~95% of 2000
    draws (binomial sd 0.5%); a normal quantile (1.96) would cover only ~88%."""
    rng = random.Random(0)
    hits = 0
    trials = 2000
    for _ in range(trials):
        b = [rng.gauss(2.0, 0.1) for _ in range(5)]
        a = [x + 0.3 + rng.gauss(0.0, 0.05) for x in b]
        iv = qs.paired_interval(a, b)
        hits += iv.low <= 0.3 <= iv.high
    assert 0.935 <= hits / trials <= 0.965


# ---- the held-out windows -----------------------------------------------------------------


def test_window_losses_are_learner_evals_windows(tmp_path: Path) -> None:
    from ddiloco.learner.task import build_task

    data = tmp_path / "tokens.bin"
    np.random.default_rng(0).integers(0, 256, 200_000).astype(np.uint16).tofile(data)
    task = build_task(preset="tiny", data=str(data), seed=0, batch_size=8)
    losses = qs.window_losses(task, task.model, 64)
    assert len(losses) == 64
    assert statistics.fmean(losses) == pytest.approx(task.eval_loss(task.model), rel=1e-5)
    held_out = 200_000 - (200_000 - int(200_000 * 0.05))
    everything = qs.window_losses(task, task.model, 10**6)
    assert len(everything) == (held_out - 1) // 64  # capped at non-overlapping windows
    assert len(set(everything)) > len(everything) // 2  # windows differ, not one repeated
    assert task.model.training  # put back as it was


# ---- the harness --------------------------------------------------------------------------


def test_seeds_parts_and_arms_parse_or_refuse() -> None:
    assert quality.parse_seeds("5") == [0, 1, 2, 3, 4]
    assert quality.parse_seeds("3-5") == [3, 4, 5]
    assert quality.parse_seeds("0,2,7") == [0, 2, 7]
    assert quality.parse_part("2/4") == (2, 4)
    assert quality.parse_arms("dp,sync_diloco") == ["dp", "sync_diloco"]
    for bad in ("x", "2,2", "-1,3", "0"):
        with pytest.raises(quality.argparse.ArgumentTypeError):
            quality.parse_seeds(bad)
    for bad in ("0/3", "5/4", "1-2", "a/b"):
        with pytest.raises(quality.argparse.ArgumentTypeError):
            quality.parse_part(bad)
    with pytest.raises(quality.argparse.ArgumentTypeError, match="unknown arm 'nope'"):
        quality.parse_arms("dp,nope")


def test_bad_arguments_are_one_line_errors(capsys: pytest.CaptureFixture[str]) -> None:
    for argv in (["--arms", "bogus"], ["--model", "hf:x"], ["--eval-windows", "1"]):
        with pytest.raises(SystemExit) as e:
            quality.main([*argv, "--report", "--out", "/nonexistent/never"])
        assert e.value.code == 2
        assert "error:" in capsys.readouterr().err


def test_parts_cover_the_grid_once_seed_major() -> None:
    arms, seeds = list(quality.DEFAULT_ARMS), [0, 1, 2, 3, 4]
    whole = quality.grid(arms, seeds, None)
    parts = [quality.grid(arms, seeds, (i, 3)) for i in (1, 2, 3)]
    assert [run for part in parts for run in part] == whole
    assert len(whole) == len(set(whole)) == 20
    assert parts[0][: len(arms)] == [(arm, 0) for arm in arms]


def test_the_arm_table_is_consistent() -> None:
    for arm, ref, _ in quality.COMPARISONS:
        assert arm in quality.ARMS and ref in quality.ARMS
    assert all(spec.chaos in quality.CHAOS for spec in quality.ARMS.values())
    assert set(quality.DEFAULT_ARMS) <= set(quality.ARMS)


def test_every_arm_gets_the_same_budget_seed_and_batch(tmp_path: Path) -> None:
    args = quality.parser().parse_args(["--learners", "4", "--steps", "96", "--batch-size", "4"])
    cfgs = {arm: quality.build_config(arm, 3, args, tmp_path / arm) for arm in quality.ARMS}
    for cfg in cfgs.values():
        assert (cfg.learners, cfg.max_steps, cfg.seed, cfg.batch_size) == (4, 96, 3, 4)
        assert cfg.max_seconds == args.cap_seconds
    assert type(cfgs["dp"]).__name__ == "DPConfig" and not cfgs["dp"].elastic
    assert cfgs["sync_diloco"].quorum == 4
    assert (cfgs["decoupled_grace"].quorum, cfgs["decoupled_grace"].grace) == (1, True)
    assert cfgs["decoupled_k1"].grace is False
    assert cfgs["decoupled_grace_mean"].merge == "mean"
    assert cfgs["decoupled_grace"].schedule.events == []
    assert cfgs["decoupled_grace_live_chaos"].hot_spares == 0
    spare = cfgs["decoupled_grace_live_chaos_spare"]
    assert (spare.hot_spares, spare.spare_takeover) == (1, "immediate")
    assert spare.schedule.events == cfgs["decoupled_grace_live_chaos"].schedule.events
    chaos = {e.action for e in cfgs["decoupled_grace_chaos"].schedule.events}
    assert chaos == {"kill", "pause"}
    pause = cfgs["decoupled_grace_pause"].schedule.events
    assert pause and pause == cfgs["sync_diloco_pause"].schedule.events  # the same chaos
    assert {e.action for e in pause} == {"pause"}


def _result(arm: str, seed: int, loss: float, budget_met: bool = True) -> dict[str, Any]:
    windows = [loss - 0.1, loss, loss + 0.1, loss + 0.2 * (seed % 2) - 0.1]
    return {
        "arm": arm,
        "seed": seed,
        "eval_loss": statistics.fmean(windows),
        "eval_se": statistics.stdev(windows) / 2,
        "eval_windows": 4,
        "window_losses": windows,
        "tokens": 1000,
        "budget_met": budget_met,
        "final_model_fresh": True,
        "merged_work_ratio": 1.0,
        "goodput": 0.9,
        "wall_seconds": 30.0,
        "chaos_events_applied": 0,
    }


def test_comparisons_pair_by_seed_and_drop_runs_off_budget() -> None:
    ref = {0: 2.00, 1: 2.10, 2: 1.90, 3: 2.05}
    arm = {0: 2.02, 1: 2.13, 2: 1.91, 3: 9.99}
    results = {("sync_diloco", s): _result("sync_diloco", s, x) for s, x in ref.items()}
    results |= {("decoupled_grace", s): _result("decoupled_grace", s, x) for s, x in arm.items()}
    results[("decoupled_grace", 3)]["budget_met"] = False  # left out: not equal tokens
    summary = quality.summarize(results)
    (row,) = summary["comparisons"]
    assert (row["arm"], row["reference"], row["seeds"]) == (
        "decoupled_grace",
        "sync_diloco",
        [0, 1, 2],
    )
    a = [results[("decoupled_grace", s)]["eval_loss"] for s in (0, 1, 2)]
    b = [results[("sync_diloco", s)]["eval_loss"] for s in (0, 1, 2)]
    want = qs.paired_interval(a, b, relative=True)
    assert row["relative"]["mean"] == pytest.approx(want.mean)
    assert row["relative"]["low"] == pytest.approx(want.low)
    assert row["diff"]["mean"] == pytest.approx(statistics.fmean([0.02, 0.03, 0.01]))
    assert summary["arms"]["decoupled_grace"]["seeds"] == [0, 1, 2]
    assert summary["arms"]["sync_diloco"]["seeds"] == [0, 1, 2, 3]
    # the windows differ by a constant between the arms: the eval set adds no error to it
    assert row["eval_set_se_of_mean_diff"] == pytest.approx(0.0, abs=1e-9)
    text = quality.tables(summary)
    assert "| decoupled_grace | sync_diloco | 3 |" in text


def test_an_hf_config_is_a_model_size_named_by_its_absolute_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(Path(quality.__file__).parent)  # bench/: the config by a relative path
    ap = quality.parser()
    args = ap.parse_args(["--model", "hf:configs/llama-2m.json"])
    quality.check_args(ap, args)
    assert args.model == "hf:" + str(Path("configs/llama-2m.json").resolve())
    args = ap.parse_args(["--model", "hf:llama-tiny"])  # a shipped name stays a name
    quality.check_args(ap, args)
    assert args.model == "hf:llama-tiny"


def test_gap_against_size_pairs_each_size_and_orders_by_parameters(tmp_path: Path) -> None:
    sizes = load_bench("quality_sizes")
    llama = Path(quality.__file__).parent / "configs" / "llama-2m.json"
    data = {
        "tiny": ({0: 2.40, 1: 2.41, 2: 2.39}, {0: 2.48, 1: 2.47, 2: 2.49}),
        f"hf:{llama}": ({0: 2.30, 1: 2.33, 2: 2.31}, {0: 2.33, 1: 2.35, 2: 2.32}),
    }
    outs = []
    for k, (model, (dp, arm)) in enumerate(data.items()):
        out = tmp_path / f"size{k}"
        for name, losses in (("dp", dp), ("decoupled_grace_live", arm)):
            for seed, loss in losses.items():
                run = out / "runs" / f"{name}-s{seed}"
                run.mkdir(parents=True)
                (run / "result.json").write_text(json.dumps(_result(name, seed, loss)))
        (out / "settings.json").write_text(json.dumps({"model": model}))
        outs.append(out)
    png = tmp_path / "gap.png"
    assert (
        sizes.main(
            [str(outs[1]), str(outs[0]), "--png", str(png), "--json", str(tmp_path / "r.json")]
        )
        == 0
    )
    rows = json.loads((tmp_path / "r.json").read_text())
    assert [r["model"] for r in rows] == ["tiny", "llama-2m"]  # by parameters, not argument order
    assert rows[0]["parameters"] == 119_104 and rows[1]["parameters"] == 1_820_736
    for r, (dp, arm) in zip(rows, data.values(), strict=True):
        a = [_result("x", s, arm[s])["eval_loss"] for s in (0, 1, 2)]
        b = [_result("x", s, dp[s])["eval_loss"] for s in (0, 1, 2)]
        want = qs.paired_interval(a, b, relative=True)
        assert (r["gap"], r["low"], r["high"]) == pytest.approx((want.mean, want.low, want.high))
    assert rows[1]["gap"] < rows[0]["gap"]
    assert png.stat().st_size > 10_000  # a drawn figure, not an empty canvas
    only_dp = tmp_path / "only-dp"
    (only_dp / "runs" / "dp-s0").mkdir(parents=True)
    (only_dp / "runs" / "dp-s0" / "result.json").write_text(json.dumps(_result("dp", 0, 2.0)))
    (only_dp / "settings.json").write_text(json.dumps({"model": "tiny"}))
    with pytest.raises(SystemExit, match="no paired runs"):
        sizes.main([str(only_dp)])
