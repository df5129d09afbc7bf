"""The synchronizer capacity model of the simulator (simulator/syncer.py) and `--plan`'s use of it."""

from __future__ import annotations

import pytest

from ddiloco.simulator.syncer import SyncerConfig, bytes_per_value, fit, load, parse_capacity

WIDE = dict(params=12e9, learners=8, H=24, step_s=5.0, fragments=24, tau=2)


def test_bytes_per_value_counts_the_scales() -> None:
    assert bytes_per_value("bf16") == 2.0
    assert bytes_per_value("int8", 128) == pytest.approx(1 + 4 / 128)
    assert bytes_per_value("int4", 128) == pytest.approx(0.5 + 4 / 128)
    with pytest.raises(ValueError, match="unknown encoding"):
        bytes_per_value("int2")


def test_mean_load_is_the_whole_model_from_every_learner_every_h_steps() -> None:
    got = load(SyncerConfig(), encoding="bf16", shards=1, **WIDE)
    assert got.mean_gbps == pytest.approx(8 * 12e9 * 2 / (24 * 5.0) / 1e9)
    two = load(SyncerConfig(), encoding="bf16", shards=2, **WIDE)
    assert two.mean_utilisation == pytest.approx(got.mean_utilisation / 2)


def test_fewer_bits_or_more_capacity_need_fewer_shards() -> None:
    cfg = SyncerConfig(shard_gbps={"bf16": 1.0, "int8": 1.0, "int4": 1.0})
    s = {e: fit(cfg, encodings=(e,), **WIDE) for e in ("bf16", "int8", "int4")}
    assert all(v is not None for v in s.values())
    assert s["bf16"].shards >= s["int8"].shards >= s["int4"].shards  # type: ignore[union-attr]
    assert s["bf16"].shards > s["int4"].shards  # type: ignore[union-attr]
    faster = SyncerConfig(shard_gbps={"bf16": 4.0})
    assert fit(faster, encodings=("bf16",), **WIDE).shards < s["bf16"].shards  # type: ignore[union-attr]


def test_a_round_is_bound_to_one_shard() -> None:
    """Shards help a round only while fragments in flight outnumber them: with a shard too
    slow for one fragment's quorum, no shard count fits."""
    slow = SyncerConfig(shard_gbps={"bf16": 0.05}, max_shards=64)
    assert fit(slow, encodings=("bf16",), **WIDE) is None
    got = load(slow, encoding="bf16", shards=64, **WIDE)
    assert got.round_s > got.round_budget_s and not got.fits
    # a quorum of K waits for K contributions
    k1 = load(SyncerConfig(), encoding="bf16", shards=4, quorum=1, **WIDE)
    k4 = load(SyncerConfig(), encoding="bf16", shards=4, quorum=4, **WIDE)
    assert k4.round_s == pytest.approx(4 * k1.round_s)


def test_capacity_flag() -> None:
    assert parse_capacity("bf16=0.9, int4=2") == {"bf16": 0.9, "int4": 2.0}
    with pytest.raises(ValueError, match="ENCODING=GB/s"):
        parse_capacity("fp8=1")
    with pytest.raises(ValueError, match="shard_gbps"):
        SyncerConfig(shard_gbps={"bf16": 0.0})


def test_plan_ranks_encoding_and_shards() -> None:
    from ddiloco.simulator.config import FailureConfig, NetworkConfig, RunConfig
    from ddiloco.simulator.plan import search

    run = RunConfig(chips=4096, learners=4, quorum=1, fragments=24, H=24, tau=2, horizon_s=86400)
    fail = FailureConfig()
    tight = NetworkConfig(params=12e9, link_gbps=(2.0, 3.0, 4.0, 5.0))
    able = SyncerConfig(shard_gbps={e: 1.0 for e in ("bf16", "int8", "int4")})
    cands = search(run, fail, tight, learners=(4,), fragments=(24,), hs=(24, 96), syncer=able)
    assert cands, "nothing fits"
    assert {c.encoding for c in cands} <= {"bf16", "int8", "int4"}
    assert all(c.shards >= 1 for c in cands)
    # at 1 GB/s a shard ingests one or two bf16 contributions of a 12B / 24 fragment within
    # a quarter of tau x 5 s, not the four a K = 4 round waits for: that one drops to int8
    by_k = {(c.quorum, c.H): c.encoding for c in cands}
    assert by_k[(1, 24)] == by_k[(2, 24)] == "bf16"
    assert by_k[(4, 24)] == "int8"
    # a faster synchronizer needs no more shards for the same configuration
    fast = search(
        run, fail, tight, learners=(4,), fragments=(24,), hs=(24, 96),
        syncer=SyncerConfig(shard_gbps={e: 10.0 for e in ("bf16", "int8", "int4")}),
    )  # fmt: skip
    key = {(c.quorum, c.H): c for c in fast}
    for c in cands:
        other = key[(c.quorum, c.H)]
        assert other.shards <= c.shards


def test_wide_area_says_shards_per_encoding(capsys: pytest.CaptureFixture[str]) -> None:
    from ddiloco.simulator.cli import main

    assert main(["wide-area", "--shard-gbps", "bf16=1,int8=1,int4=1", "--json"]) == 0
    import json

    got = json.loads(capsys.readouterr().out)["synchronizer"]
    assert set(got) == {"bf16", "int8", "int4"}
    assert got["bf16"]["shards"] >= got["int4"]["shards"] >= 1
    assert main(["wide-area", "--shard-gbps", "bf16=0.001,int8=1,int4=1"]) == 0
    text = capsys.readouterr().out
    assert "bf16  none up to --max-shards" in text and "int4  S = " in text
