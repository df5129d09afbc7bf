"""Bytes, bandwidth and latency: what each training method puts on the links between sites.

    from ddiloco.simulator.network import wide_area
    wide_area(NetworkConfig(), step_s=5.0, fragments=24, H=24, tau=2)

Data-parallel all-reduces the gradient every step: a bandwidth-optimal ring across S sites
moves 2(S-1)/S of the gradient through every site's link, so the slowest link sets the
pace, plus 2(S-1) one-way latencies. We let the all-reduce overlap the whole step (bucketed
backward), which favours the baseline: its step lasts max(compute, all-reduce).

Decoupled DiLoCo (Douillard et al. 2026) ships one fragment (1/P of the model) up and the
merged copy down every H/P steps, in the background; it has tau steps to come back. A
learner never waits, so its step lasts the compute time as long as its link carries the
mean stream; if it cannot, merges fall behind (reported as utilisation above 1).

Tests: `tests/unit/test_sim_network.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

from ddiloco.simulator.config import NetworkConfig

GBIT = 1e9


def model_bits(params: float, bits: int) -> float:
    return params * bits


def ring_allreduce_s(
    payload_bits: float,
    link_gbps: tuple[float, ...],
    latency_s: float,
    ranks_per_site: int = 1,
    step_latencies: float = 1.0,
) -> float:
    """Seconds for a ring all-reduce of `payload_bits` across len(link_gbps) sites with
    `ranks_per_site` ranks each (a flat ring, each site's ranks adjacent, hops inside a site
    free): the slowest link between sites sets the pace of every ring step, and each of the
    2(R-1) steps waits `step_latencies` one-way latencies."""
    sites = len(link_gbps)
    if sites < 2:
        return 0.0
    ranks = sites * ranks_per_site
    moved = 2.0 * (ranks - 1) / ranks * payload_bits
    return moved / (min(link_gbps) * GBIT) + 2 * (ranks - 1) * step_latencies * latency_s


def dp_bandwidth_gbps(params: float, bits: int, sites: int, step_s: float) -> float:
    """Per-site bandwidth data-parallel needs so the all-reduce fits inside one step."""
    return 2.0 * (sites - 1) / sites * model_bits(params, bits) / step_s / GBIT


@dataclass(frozen=True)
class DecoupledTraffic:
    """A learner's traffic per direction: mean over time and peak within the overlap."""

    up_mean_gbps: float
    down_mean_gbps: float
    peak_gbps: float
    bytes_up_per_hour: float
    bytes_down_per_hour: float


def decoupled_traffic(
    net: NetworkConfig, step_s: float, fragments: int, H: int, tau: int, sync_s: float = 0.0
) -> DecoupledTraffic:
    """Traffic of one learner: the whole model goes up and comes down once every H steps;
    each fragment's round trip must fit in tau steps (minus the merge time `sync_s`)."""
    up = model_bits(net.params, net.up_bits)
    down = model_bits(net.params, net.down_bits)
    window = H * step_s
    frag_round_trip = (up + down) / fragments
    budget = max(tau * step_s - sync_s, 1e-9)
    return DecoupledTraffic(
        up_mean_gbps=up / window / GBIT,
        down_mean_gbps=down / window / GBIT,
        peak_gbps=frag_round_trip / budget / GBIT,
        bytes_up_per_hour=up / 8 * 3600 / window,
        bytes_down_per_hour=down / 8 * 3600 / window,
    )


def wide_area(
    net: NetworkConfig,
    *,
    step_s: float,
    fragments: int,
    H: int,
    tau: int,
    dp_compute_s: float | None = None,
) -> dict[str, float]:
    """Speed-up of Decoupled DiLoCo over synchronous data-parallel on the same links, and
    the bandwidth each needs per site. `dp_compute_s`: data-parallel's compute per step when
    it is not `step_s` (a measured run where the two methods share the machine differently)."""
    allreduce = ring_allreduce_s(
        model_bits(net.params, net.grad_bits),
        net.link_gbps,
        net.latency_s,
        net.ranks_per_site,
        net.ring_step_latencies,
    )
    dp_compute = step_s if dp_compute_s is None else dp_compute_s
    dp_step = max(dp_compute, allreduce) if net.dp_overlap else dp_compute + allreduce
    traffic = decoupled_traffic(net, step_s, fragments, H, tau)
    per_site = net.ranks_per_site  # learners behind one site's link
    mean_need = max(traffic.up_mean_gbps, traffic.down_mean_gbps) * per_site
    utilisation = mean_need / min(net.link_gbps)
    # If the slowest link cannot carry the mean stream, merges (not learners) slow down;
    # the learner step stays `step_s` but only 1/utilisation of the fragments get merged.
    return {
        "sites": float(net.sites),
        "step_s": step_s,
        "dp_allreduce_s": allreduce,
        "dp_step_s": dp_step,
        "decoupled_step_s": step_s,
        "speedup": dp_step / step_s,
        "decoupled_up_gbps_per_site": traffic.up_mean_gbps * per_site,
        "decoupled_down_gbps_per_site": traffic.down_mean_gbps * per_site,
        "decoupled_peak_gbps_per_site": traffic.peak_gbps * per_site,
        "slowest_link_utilisation": utilisation,
        "dp_needed_gbps_per_site": dp_bandwidth_gbps(net.params, net.grad_bits, net.sites, step_s),
    }
