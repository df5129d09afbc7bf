"""The synchronizer capacity model of the simulator (simulator/syncer.py) and `--plan`'s use of it."""

from __future__ import annotations

import pytest

from ddiloco.simulator.syncer import (
    DOWNLOAD_ENCODINGS,
    ENCODINGS,
    ROUND_TRIP_S1,
    SyncerConfig,
    SyncerLoad,
    bytes_per_value,
    download_bytes_per_value,
    fit,
    ingest_left,
    load,
    parse_capacity,
    serve_share,
)

WIDE = dict(params=12e9, learners=8, H=24, step_s=5.0, fragments=24, tau=2)


def test_bytes_per_value_counts_the_scales() -> None:
    assert bytes_per_value("bf16") == 2.0
    assert bytes_per_value("int8", 128) == pytest.approx(1 + 4 / 128)
    assert bytes_per_value("int4", 128) == pytest.approx(0.5 + 4 / 128)
    with pytest.raises(ValueError, match="unknown encoding"):
        bytes_per_value("int2")


def test_download_bytes_per_value_by_broadcast_encoding() -> None:
    got = {e: download_bytes_per_value(e, 128) for e in DOWNLOAD_ENCODINGS}
    assert got == pytest.approx(
        {
            "float32": 4.0,
            "bfloat16": 2.0,
            "int8": 1 + 4 / 128,
            "int8-delta": 1 + 4 / 128,
            "int4-delta": 0.5 + 4 / 128,
        }
    )
    with pytest.raises(ValueError, match="unknown download encoding 'bf16'"):
        download_bytes_per_value("bf16")


def test_mean_load_is_the_whole_model_from_every_learner_every_h_steps() -> None:
    got = load(SyncerConfig(), encoding="bf16", shards=1, **WIDE)
    assert got.mean_gbps == pytest.approx(8 * 12e9 * 2 / (24 * 5.0) / 1e9)
    # every learner downloads every merge: the whole model once per H steps, bfloat16
    assert got.out_gbps == pytest.approx(8 * 12e9 * 2 / (24 * 5.0) / 1e9)
    f32 = load(SyncerConfig(download_encoding="float32"), encoding="bf16", shards=1, **WIDE)
    assert f32.out_gbps == pytest.approx(2 * got.out_gbps)
    assert got.mean_utilisation == pytest.approx(
        got.mean_gbps / 1.282 + got.out_gbps / SyncerConfig().out_gbps
    )
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


def test_the_fitted_out_capacity_reproduces_the_measured_round_trip() -> None:
    """The default out capacity, with the default ingest capacities, predicts each measured
    S = 1 round trip (bench/RESULTS.md) within 10%: the in-rate from the measured out-rate
    (what the round condition uses), and the out-rate from the measured in-rate."""
    cfg = SyncerConfig()
    assert cfg.download_encoding == "bfloat16"  # what the bench's clients downloaded
    for enc, (in_gbps, out_gbps) in ROUND_TRIP_S1.items():
        predicted_in = ingest_left(cfg, enc, serve_share(cfg, out_gbps))
        assert predicted_in == pytest.approx(in_gbps, rel=0.10), enc
        predicted_out = cfg.out_gbps * (1 - in_gbps / cfg.shard_gbps[enc])
        assert predicted_out == pytest.approx(out_gbps, rel=0.10), enc
    # the default is the mean of the three points' own fits, as its docstring derives it
    fits = [o / (1 - i / cfg.shard_gbps[e]) for e, (i, o) in ROUND_TRIP_S1.items()]
    assert cfg.out_gbps == pytest.approx(sum(fits) / len(fits), abs=0.005)
    # ingest's figures alone would put the round trip's intake 2.4-2.8x too high
    assert all(cfg.shard_gbps[e] > 2 * i for e, (i, _) in ROUND_TRIP_S1.items())


def _shards(got: SyncerLoad | None) -> float:
    return float("inf") if got is None else got.shards


def test_more_learners_never_need_fewer_shards() -> None:
    base = {k: v for k, v in WIDE.items() if k != "learners"}
    for down in ("bfloat16", "float32", "int4-delta"):
        cfg = SyncerConfig(download_encoding=down)
        for enc in ENCODINGS:
            seen = [_shards(fit(cfg, learners=m, encodings=(enc,), **base)) for m in range(1, 33)]
            assert seen == sorted(seen), (down, enc, seen)
            assert seen[-1] > seen[0], (down, enc, seen)  # the learners' load does move it


def test_fewer_download_bytes_never_need_more_shards() -> None:
    """With the encode cost equal, an encoding of fewer bytes down never needs more shards;
    the encode of a quantized download is a cost of its own, counted once per merge."""
    by_bytes = sorted(DOWNLOAD_ENCODINGS, key=download_bytes_per_value, reverse=True)
    assert by_bytes[0] == "float32" and by_bytes[-1] == "int4-delta"
    base = {k: v for k, v in WIDE.items() if k != "learners"}
    for m in (4, 8, 16):
        for enc in ENCODINGS:
            for encode in ({}, {e: 0.5 for e in DOWNLOAD_ENCODINGS}):
                seen = [
                    _shards(
                        fit(
                            SyncerConfig(download_encoding=d, encode_gvps=encode),
                            learners=m, encodings=(enc,), **base,
                        )
                    )
                    for d in by_bytes
                ]  # fmt: skip
                assert seen == sorted(seen, reverse=True), (m, enc, encode, seen)
                assert seen[0] > seen[-1], (m, enc, encode, seen)
    # a slow encode costs shards that the bytes saved do not win back
    slow = SyncerConfig(download_encoding="int4-delta", encode_gvps={"int4-delta": 0.05})
    got = fit(slow, encodings=("bf16",), **WIDE)
    plain = fit(SyncerConfig(), encodings=("bf16",), **WIDE)
    assert got is not None and plain is not None and got.shards > plain.shards
    # and it is counted once per merge: the same share whatever the learners
    one = load(slow, encoding="bf16", shards=1, **{**WIDE, "learners": 1})
    many = load(slow, encoding="bf16", shards=1, **{**WIDE, "learners": 16})
    encode_share = 12e9 / (24 * 5.0) / 0.05e9
    assert one.serve_share - one.out_gbps / slow.out_gbps == pytest.approx(encode_share)
    assert many.serve_share - many.out_gbps / slow.out_gbps == pytest.approx(encode_share)


def test_a_shard_that_serves_all_the_time_never_fits() -> None:
    """Downloads at or past a shard's whole time leave it nothing to ingest with: no round
    and no shard count fits, however fast its ingest."""
    one = {**WIDE, "fragments": 1}  # one fragment: one shard holds every download
    out = load(SyncerConfig(), encoding="bf16", shards=1, **one).out_gbps
    fast_in = {e: 1e6 for e in ENCODINGS}
    for factor in (1.0, 0.5):
        cfg = SyncerConfig(shard_gbps=fast_in, out_gbps=out * factor, max_util=1.0)
        got = load(cfg, encoding="bf16", shards=4, **one)
        assert got.serve_share >= 1.0 and not got.fits
        assert got.round_s == float("inf")
        assert fit(cfg, **one) is None
    # just under its whole time, the same shard fits (so the refusal above is the share's)
    near = SyncerConfig(shard_gbps=fast_in, out_gbps=out / 0.99, max_util=1.0)
    got = load(near, encoding="bf16", shards=1, **one)
    assert got.serve_share == pytest.approx(0.99) and got.fits


def test_downloads_take_the_round_s_capacity() -> None:
    """The round's ingest runs at what the downloads leave: a slower download side means a
    longer round, and more shards take the downloads of other fragments off it."""
    fast = load(SyncerConfig(out_gbps=100.0), encoding="bf16", shards=2, **WIDE)
    slow = load(SyncerConfig(out_gbps=2.0), encoding="bf16", shards=2, **WIDE)
    assert slow.round_s == pytest.approx(
        fast.round_s * (1 - fast.serve_share) / (1 - slow.serve_share)
    )
    assert slow.round_s > fast.round_s
    more = load(SyncerConfig(out_gbps=2.0), encoding="bf16", shards=8, **WIDE)
    assert more.serve_share < slow.serve_share and more.round_s < slow.round_s


def test_syncer_config_refuses_bad_download_side() -> None:
    with pytest.raises(ValueError, match="out_gbps"):
        SyncerConfig(out_gbps=0.0)
    with pytest.raises(ValueError, match="out_gbps"):
        SyncerConfig(out_gbps=float("nan"))
    with pytest.raises(ValueError, match="unknown download encoding"):
        SyncerConfig(download_encoding="bf16")
    with pytest.raises(ValueError, match="encode_gvps"):
        SyncerConfig(encode_gvps={"int4": 1.0})
    assert parse_capacity(
        "int8-delta=0.2", "--shard-encode-gvps", DOWNLOAD_ENCODINGS, "G values/s"
    ) == {"int8-delta": 0.2}
    with pytest.raises(ValueError, match="bf16='fast' is not a number"):
        parse_capacity("bf16=fast")
