"""The report of a `ddiloco local` run: goodput and the rest, from the run's own records.

Sources: the learners' JSON-lines step logs (what each incarnation computed, and when it
adopted merged fragments), the launcher's process timeline (kills, restarts, pauses), the
synchronizer's final status (merges, tokens merged, bytes) and the evaluator's history.

goodput (local/goodput.py) = sum over slots of time spent executing inner steps, divided by
the time each slot held its allocation (the whole run: a killed learner's slot is still
allocated while it waits to be replaced, and a paused one is idle).
"""

from __future__ import annotations

import itertools
import json
import statistics
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.local.goodput import busy_seconds, new_step_spans
from ddiloco.local.samples import merged_at, thin, timeseries

if TYPE_CHECKING:
    from ddiloco.local.launcher import LocalRun


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:  # a line cut by SIGKILL
            continue
    return out


def compute_intervals(steps: list[dict[str, Any]], gap: float = 0.05) -> list[tuple[float, float]]:
    """Merge step records (end time t, duration dt) into [start, end] computing intervals."""
    spans: list[tuple[float, float]] = []
    for r in steps:
        start, end = r["t"] - r["dt"], r["t"]
        if spans and start - spans[-1][1] <= gap:
            spans[-1] = (spans[-1][0], end)
        else:
            spans.append((start, end))
    return spans


def system_uptime(merge_times: list[float], t0: float, t1: float, threshold: float) -> float:
    """Share of [t0, t1] not inside a gap between merges longer than `threshold`."""
    if t1 <= t0:
        return 0.0
    points = [t0, *sorted(t for t in merge_times if t0 <= t <= t1), t1]
    lost = sum(max(0.0, b - a - threshold) for a, b in itertools.pairwise(points))
    return max(0.0, 1.0 - lost / (t1 - t0))


def build_report(run: LocalRun) -> dict[str, Any]:
    cfg, status, t0, t1 = run.cfg, run.status, run.t0, run.t_end
    wall = t1 - t0
    learners = []
    merge_times: dict[tuple[int, int], float] = {}
    all_step_dts = []
    by_learner: dict[str, list[dict[str, Any]]] = {}
    held_spans: dict[str, tuple[float, float]] = {}
    raw_compute = raw_held = 0.0
    samples = run.sampler.samples if getattr(run, "sampler", None) is not None else []
    for child in run.learners:
        records = [r for r in read_jsonl(run.learner_log(child.name)) if r.get("t", 0) <= t1 + 1]
        steps = [r for r in records if "dt" in r and "step" in r]
        for r in records:
            if r.get("event") == "adopt" and r.get("version", 0) > 0:
                key = (r["fragment"], r["version"])
                merge_times[key] = min(merge_times.get(key, r["t"]), r["t"])
        # A scavenged slot is held only between its add and its remove.
        held_from = max(t0, run.added.get(child.name, t0))
        held_to = min(t1, run.removed.get(child.name, t1))
        if child.name in run.schedule.absent and child.name not in run.added:
            held_to = held_from  # never joined
        held = max(0.0, held_to - held_from)
        by_learner[child.name], held_spans[child.name] = records, (held_from, held_to)
        # Busy time excludes SIGSTOPped time: a pause lands inside a step and stretches its dt.
        compute = busy_seconds(new_step_spans(records), (held_from, held_to), child.pauses)
        raw_compute, raw_held = raw_compute + compute, raw_held + held
        dead = 0.0
        for k, t_kill in enumerate(child.kills):
            back = child.starts[k + 1] if k + 1 < len(child.starts) else t1
            dead += max(0.0, min(back, t1) - t_kill)
        paused = sum(min(b, t1) - a for a, b in child.pauses if a < t1)
        dts = [r["dt"] for r in steps]
        all_step_dts += dts
        contributions = next(
            (x.contributions for x in status.learners if x.learner_id == child.name), 0
        )
        learners.append(
            {
                "id": child.name,
                "steps": len(steps),
                "tokens": len(steps) * _tokens_per_batch(run),
                "step_seconds_mean": statistics.fmean(dts) if dts else 0.0,
                "compute_seconds": round(compute, 3),
                "dead_seconds": round(dead, 3),
                "paused_seconds": round(paused, 3),
                "wait_seconds": round(max(0.0, held - compute - dead - paused), 3),
                "held_seconds": round(held, 3),
                "restarts": max(0, len(child.starts) - 1),
                "kill_times": [round(t - t0, 3) for t in child.kills],
                "restart_delays": [
                    round(child.starts[k + 1] - t, 3)
                    for k, t in enumerate(child.kills)
                    if k + 1 < len(child.starts)
                ],
                "start_times": [round(t - t0, 3) for t in child.starts],
                "merged_at": merged_at(samples, child.name),
                "train_loss": thin(
                    [(r["t"] - t0, r["loss"]) for r in steps if r.get("loss") is not None]
                ),
                "slow_factor": run.schedule.slow_factors.get(child.name, 1.0),
                "contributions": contributions,
                "goodput": round(compute / held, 4) if held > 0 else 0.0,
                "timeline": {
                    "compute": [
                        (round(a - t0, 3), round(b - t0, 3)) for a, b in compute_intervals(steps)
                    ],
                    "dead": [
                        (
                            round(t - t0, 3),
                            round(
                                (child.starts[k + 1] if k + 1 < len(child.starts) else t1) - t0, 3
                            ),
                        )
                        for k, t in enumerate(child.kills)
                    ],
                    "paused": [
                        (round(a - t0, 3), round(min(b, t1) - t0, 3)) for a, b in child.pauses
                    ],
                },
            }
        )
    tokens_computed = sum(x["tokens"] for x in learners)
    step_mean = statistics.fmean(all_step_dts) if all_step_dts else 0.0
    history = run.evaluator.history if run.evaluator else []
    initial = run.evaluator.initial_loss if run.evaluator else None
    final = history[-1][1] if history else None
    return {
        # from the unrounded seconds (the per-slot figures are rounded to ms), as the
        # timeseries' last row is
        "goodput": round(raw_compute / raw_held, 4) if wall and raw_held > 0 else 0.0,
        "merged_work_ratio": round(status.tokens_merged / tokens_computed, 4)
        if tokens_computed
        else 0.0,
        "eval_loss_initial": initial,
        "eval_loss_final": final,
        "merges": status.merges,
        "global_version": status.global_version,
        "tokens_computed": tokens_computed,
        "tokens_merged": status.tokens_merged,
        "bytes_up": status.bytes_up,
        "bytes_down": status.bytes_down,
        "learner_restarts": sum(x["restarts"] for x in learners),
        "sync_restarts": sum(max(0, len(s.starts) - 1) for s in run.syncs),
        "sync_shards": len(run.syncs),
        # every fragment with its owner shard and final version (the job's, merged over shards)
        "fragments": [
            {"index": f.index, "shard": f.shard, "version": f.version, "merge": f.merge}
            for f in status.fragments
        ],
        "wall_seconds": round(wall, 3),
        "sync_seconds_mean": status.xi.get("sync") or 0.0,
        "mean_contributors": round(status.mean_contributors, 3),
        "mean_merge_scale": round(status.mean_merge_scale, 3),
        "contributions_rejected": status.contributions_rejected,
        # the rules the synchronizer says its fragments merge by, not the flag that asked
        "merge_rules": sorted({f.merge for f in status.fragments}),
        "system_uptime": round(
            system_uptime(list(merge_times.values()), t0, t1, 2 * cfg.h * max(step_mean, 1e-3)), 4
        ),
        "eval_history": [(round(t - t0, 3), round(loss, 5), v) for t, loss, v in history],
        # the run over time (local/samples.py): the synchronizer's counts every second, with
        # goodput and merged-work ratio as defined above up to each moment
        "timeseries": timeseries(
            samples,
            by_learner,
            t0=t0,
            t1=t1,
            tokens_per_step=_tokens_per_batch(run),
            held=held_spans,
            idle={c.name: c.pauses for c in run.learners},
        ),
        "chaos_applied": run.applied,
        # the job's token budget (synchronizer/budget.py): reached when the synchronizer says
        # its merged tokens got there; the slots that stopped on hearing it
        "budget": {
            "total_tokens": cfg.total_tokens,
            "tokens_merged": status.tokens_merged,
            "reached": status.finished,
            "learners_finished": sorted(
                c.name for c in run.learners if c.finished and getattr(run, "budget_reached", False)
            ),
        }
        if cfg.total_tokens
        else None,
        "tls": {
            "enabled": cfg.tls,
            "mutual": cfg.mtls,
            "url": run.url,
            "http_version": run.http_version,
        },
        "spares": {
            "taken": run.spares.taken,
            "started": run.spares.started,
            "standby_seconds": round(run.spares.standby_seconds, 3),
            "takeover": cfg.spare_takeover,
            "hot_takeovers": sum(1 for e in run.applied if e.get("hot_spare")),
        }
        if run.spares is not None
        else None,
        "config": {
            "learners": cfg.learners,
            "quorum": cfg.quorum,
            "grace": cfg.grace,
            "merge": cfg.merge,
            "H": cfg.h,
            "P": cfg.fragments,
            "tau": cfg.tau,
            "chaos": cfg.chaos,
            "model": cfg.model,
            "model_entry": cfg.model_entry,
            "data": cfg.data,
            "seed": cfg.seed,
            "max_seconds": cfg.max_seconds,
            "max_steps": cfg.max_steps,
            "total_tokens": cfg.total_tokens,
            "hot_spares": cfg.hot_spares,
            "spare_takeover": cfg.spare_takeover,
            "batch_size": cfg.batch_size,
            "tokens_per_step": _tokens_per_batch(run),
            "inner_lr": cfg.inner_lr,
            "outer_lr": cfg.outer_lr,
            "outer_momentum": cfg.outer_momentum,
            "tls": cfg.tls,
            "mtls": cfg.mtls,
            "update_encoding": cfg.update_encoding,
        },
        "learners": learners,
    }


def _tokens_per_batch(run: LocalRun) -> int:
    return int(run.evaluator.task.tokens_per_batch) if run.evaluator else 0
