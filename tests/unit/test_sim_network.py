"""The simulator's link model (simulator/network.py): a flat all-reduce ring over sites
with several ranks each, data-parallel with and without overlap, and the Decoupled stream of
several learners behind one site's link, as `ddiloco simulate wide-area` takes them.

.venv/bin/pytest tests/unit/test_sim_network.py
"""

from __future__ import annotations

import json

import pytest

from ddiloco.simulator.cli import main
from ddiloco.simulator.config import NetworkConfig
from ddiloco.simulator.network import ring_allreduce_s, wide_area

MB = 8e6  # bits


def test_ring_of_one_rank_per_site_is_the_sites_ring() -> None:
    # 3 sites: 2*2/3 of the payload through the 1 Gbps link (400 MB), 4 one-way latencies
    got = ring_allreduce_s(300 * MB, (1.0, 2.0, 3.0), 0.01)
    assert got == pytest.approx(400 * MB / 1e9 + 0.04)


def test_ranks_per_site_move_more_and_wait_more_steps() -> None:
    # 2 sites x 2 ranks: a ring of 4, 2*3/4 of the payload across the link, 6 latencies
    got = ring_allreduce_s(100 * MB, (0.1, 0.1), 0.02, ranks_per_site=2)
    assert got == pytest.approx(150 * MB / 0.1e9 + 6 * 0.02)
    assert got > ring_allreduce_s(100 * MB, (0.1, 0.1), 0.02)


def test_overlap_and_measured_dp_compute() -> None:
    net = NetworkConfig(params=1e6, grad_bits=32, link_gbps=(0.032, 0.032), latency_s=0.0)
    allreduce = 32e6 / 0.032e9  # 2 sites, 1 rank each: the whole gradient once, 1 s
    kw = {"step_s": 0.5, "fragments": 4, "H": 24, "tau": 2}
    assert wide_area(net, **kw)["dp_step_s"] == pytest.approx(allreduce)  # max(0.5, 1)
    serial = NetworkConfig(**{**net.__dict__, "dp_overlap": False})
    f = wide_area(serial, **kw, dp_compute_s=0.2)
    assert f["dp_step_s"] == pytest.approx(0.2 + allreduce)
    assert f["speedup"] == pytest.approx((0.2 + allreduce) / 0.5)


def test_learners_behind_one_link_share_it() -> None:
    one = NetworkConfig(params=1e6, link_gbps=(0.01, 0.01))
    two = NetworkConfig(params=1e6, link_gbps=(0.01, 0.01), ranks_per_site=2)
    kw = {"step_s": 0.1, "fragments": 4, "H": 24, "tau": 2}
    a, b = wide_area(one, **kw), wide_area(two, **kw)
    assert b["slowest_link_utilisation"] == pytest.approx(2 * a["slowest_link_utilisation"])
    assert b["decoupled_up_gbps_per_site"] == pytest.approx(2 * a["decoupled_up_gbps_per_site"])


def test_cli_flags_reach_the_model(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["wide-area", "--params", "119104", "--link-gbps", "0.01,0.01", "--latency-ms", "20"]
    argv += ["--step-s", "0.1", "--grad-bits", "32", "-P", "4", "--json"]
    assert main(argv) == 0
    base = json.loads(capsys.readouterr().out)["four_sites"]
    more = [*argv, "--ranks-per-site", "2", "--no-dp-overlap", "--dp-compute-s", "0.05"]
    assert main(more) == 0
    four = json.loads(capsys.readouterr().out)["four_sites"]
    bits = 119104 * 32
    assert base["dp_allreduce_s"] == pytest.approx(bits / 0.01e9 + 2 * 0.02)
    assert four["dp_allreduce_s"] == pytest.approx(1.5 * bits / 0.01e9 + 6 * 0.02)
    assert four["dp_step_s"] == pytest.approx(0.05 + four["dp_allreduce_s"])


def test_ring_steps_that_wait_a_round_trip() -> None:
    # gloo's TCP pairs: each of the 6 steps of a 4-rank ring waits 2 one-way latencies
    one = ring_allreduce_s(8e6, (1.0, 1.0), 0.02, ranks_per_site=2)
    two = ring_allreduce_s(8e6, (1.0, 1.0), 0.02, ranks_per_site=2, step_latencies=2.0)
    assert two - one == pytest.approx(6 * 0.02)
