"""`ddiloco simulate` as a user runs it: JSON shapes of every subcommand.

.venv/bin/pytest tests/unit/test_sim_cli.py
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.simulator.cli import main

REPORT = Path(__file__).parent / "data" / "sim_local_report.json"


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> object:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def test_paper_table_json_shape(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["paper-table", "--json", "--horizon-days", "0.02"])
    assert isinstance(out, dict)
    assert list(out) == ["dp", "elastic_dp", "m2", "m4", "m8", "m16"]
    for cols in out.values():
        assert list(cols) == ["150k", "300k", "600k", "1.2M", "2.4M"]
        assert all(0.0 <= v <= 1.0 for v in cols.values())
    assert out["m16"]["2.4M"] > out["dp"]["2.4M"]


def test_paper_table_text_and_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "g.png"
    assert main(["paper-table", "--horizon-days", "0.01", "--plot", str(png)]) == 0
    assert "max deviation" in capsys.readouterr().out
    assert png.read_bytes()[:4] == b"\x89PNG"


def test_run_json_has_every_method(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, ["run", "--chips", "20000", "--learners", "4", "--horizon-days", "0.05", "--json"]
    )
    assert isinstance(out, list)
    assert [r["strategy"] for r in out] == ["dp", "elastic_dp", "diloco", "decoupled"]
    assert "peak_gbps_per_site" in out[3] and "wall_hours_to_tokens" in out[0]
    one = run_json(
        capsys,
        [
            "run",
            "--chips",
            "20000",
            "--chips-per-learner",
            "5000",
            "--strategy",
            "decoupled",
            "--horizon-days",
            "0.01",
            "--json",
        ],
    )
    assert isinstance(one, list) and one[0]["learners"] == 4


def test_wide_area_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, ["wide-area", "--json"])
    assert isinstance(out, dict)
    four = out["four_sites"]
    assert four["speedup"] > 20  # 12B bf16 over a 2 Gbps ring vs a 5 s step
    assert four["slowest_link_utilisation"] < 1.0
    assert (
        out["eight_sites"]["dp_gbps_per_site"]
        > 10 * out["eight_sites"]["decoupled_gbps_per_site_bf16"]
    )


def test_plan_flag_and_calibrate_flag(capsys: pytest.CaptureFixture[str]) -> None:
    # capacities given, so the ranking does not move with the measured defaults (syncer.py)
    gbps = "bf16=1,int8=1,int4=1"
    plan = run_json(
        capsys,
        ["--plan", "--chips", "50000", "--horizon-days", "0.05", "--top", "3", "--json",
         "--shard-gbps", gbps],
    )  # fmt: skip
    assert isinstance(plan, list) and 1 <= len(plan) <= 3
    assert plan[0]["effective_goodput"] >= plan[-1]["effective_goodput"]
    cal = run_json(capsys, ["--calibrate", str(REPORT), "--json"])
    assert isinstance(cal, list) and cal[0]["name"] == "sim_local_report"


def test_wide_area_download_side_flags(capsys: pytest.CaptureFixture[str]) -> None:
    """The download side's flags reach the synchronizer model: float32 downloads (twice
    bfloat16's bytes) never need fewer shards, a slower shard out needs more, and the
    assumptions say what was used."""
    base = run_json(capsys, ["wide-area", "--json"])
    f32 = run_json(capsys, ["wide-area", "--json", "--download-encoding", "float32"])
    slow = run_json(capsys, ["wide-area", "--json", "--shard-out-gbps", "0.5"])
    assert isinstance(base, dict) and isinstance(f32, dict) and isinstance(slow, dict)
    assert base["assumptions"]["download_encoding"] == "bfloat16"
    assert f32["assumptions"]["download_encoding"] == "float32"
    assert slow["assumptions"]["shard_out_gbps"] == 0.5
    for enc, got in base["synchronizer"].items():
        assert f32["synchronizer"][enc]["out_gbps"] == pytest.approx(2 * got["out_gbps"])
        assert f32["synchronizer"][enc]["shards"] >= got["shards"]
        assert slow["synchronizer"][enc]["shards"] > got["shards"]
    # a faster delta encode needs no more shards than the measured one
    delta = ["wide-area", "--json", "--download-encoding", "int4-delta"]
    measured = run_json(capsys, delta)
    quick = run_json(capsys, [*delta, "--shard-encode-gvps", "int4-delta=10"])
    assert isinstance(measured, dict) and isinstance(quick, dict)
    assert all(
        quick["synchronizer"][e]["shards"] <= v["shards"]
        for e, v in measured["synchronizer"].items()
    )
    assert quick["synchronizer"]["bf16"]["shards"] < measured["synchronizer"]["bf16"]["shards"]


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--shard-out-gbps", "0"], "out_gbps must be a finite number > 0"),
        (["--shard-out-gbps", "-1"], "out_gbps must be a finite number > 0"),
        (["--shard-out-gbps", "fast"], "invalid float value: 'fast'"),
        (["--download-encoding", "bf16"], "invalid choice: 'bf16'"),
        (["--shard-encode-gvps", "int4=1"], "--shard-encode-gvps wants ENCODING=G values/s"),
        (["--shard-encode-gvps", "int8-delta=quick"], "int8-delta='quick' is not a number"),
        (["--shard-encode-gvps", "int8-delta=0"], "encode_gvps: int8-delta=0.0"),
        (["--shard-gbps", "bf16=x"], "--shard-gbps: bf16='x' is not a number"),
    ],
)
def test_wide_area_rejects_bad_download_side(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["wide-area", *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err
