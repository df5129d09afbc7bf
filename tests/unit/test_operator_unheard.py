"""A learner group the synchronizer stopped hearing: the job says Degraded (LearnerGroupUnheard,
naming the group) while its pods run, and Ready again once it is heard. A pod that was just
replaced, whose learner was last heard before the pod became Ready, is starting, not cut off."""

from __future__ import annotations

import dataclasses
from datetime import timedelta
from typing import Any

from ddiloco.operator import conditions as c
from ddiloco.operator.api import DecoupledDiLoCoJob
from ddiloco.operator.plan import PodView, iso
from tests.unit.test_operator_status import T0, cond, make_job, observe, settle, step

GROUPS = [{"name": "home", "replicas": 1}, {"name": "far", "replicas": 2}]


def ready_at(pods: dict[str, PodView], seconds_before: float) -> dict[str, PodView]:
    """The pods, each Ready since `seconds_before` T0: as the API writes times ("...Z") for
    some, as the kubernetes client's models serialize them ("...+00:00") for the others."""
    t = T0 - timedelta(seconds=seconds_before)
    forms = (iso(t), t.isoformat())
    return {
        k: dataclasses.replace(p, ready_since=forms[i % 2])
        for i, (k, p) in enumerate(sorted(pods.items()))
    }


def answer(**learners: tuple[bool, float]) -> dict[str, Any]:
    """A status answer: learner id -> (alive, seconds since last heard)."""
    rows = [
        {"learner_id": lid, "alive": alive, "last_seen_s": last}
        for lid, (alive, last) in learners.items()
    ]
    return {"global_version": 9, "merges": 20, "learners": rows}


def started() -> tuple[DecoupledDiLoCoJob, dict[str, PodView]]:
    job = make_job(GROUPS)
    pods: dict[str, PodView] = {}
    job = settle(job, pods)
    assert cond(job, c.READY) == ("True", c.JOB_READY)
    return job, ready_at(pods, 120)


def test_a_group_unheard_past_the_liveness_window_is_degraded_then_ready_again() -> None:
    job, pods = started()
    cut = answer(**{"home-0": (True, 0.5), "far-0": (False, 30), "far-1": (False, 31)})
    job, _ = step(job, observe(job, tuple(pods.values()), sync=cut))
    assert cond(job, c.DEGRADED) == ("True", c.LEARNER_GROUP_UNHEARD)
    message = (c.get(job.status.conditions, c.DEGRADED) or c).message  # type: ignore[union-attr]
    assert "learner group far" in message and "far-0 last heard 30 s ago" in message
    assert "far-1 last heard 31 s ago" in message  # each time form read
    assert "home" not in message.split("(")[0]
    assert cond(job, c.READY) == ("False", c.DEGRADED_REASON)
    assert job.status.phase == "Degraded"
    assert {g.name: g.ready for g in job.status.groups} == {"home": 1, "far": 2}

    healed = answer(**{"home-0": (True, 0.5), "far-0": (True, 0.2), "far-1": (True, 0.4)})
    job, _ = step(job, observe(job, tuple(pods.values()), sync=healed))
    assert cond(job, c.DEGRADED) == ("False", c.AS_EXPECTED)
    assert cond(job, c.READY) == ("True", c.JOB_READY)
    assert job.status.phase == "Running"


def test_one_learner_of_the_group_heard_is_enough() -> None:
    job, pods = started()
    half = answer(**{"home-0": (True, 0.5), "far-0": (False, 30), "far-1": (True, 1)})
    job, _ = step(job, observe(job, tuple(pods.values()), sync=half))
    assert cond(job, c.DEGRADED) == ("False", c.AS_EXPECTED)


def test_a_pod_not_heard_since_it_became_ready_is_starting_not_cut_off() -> None:
    job, pods = started()
    # both far pods became Ready 5 s ago; their learners were last heard 30 s ago (the
    # pods they replace): they have not joined yet
    pods = {**pods, **ready_at({k: p for k, p in pods.items() if p.group == "far"}, 5)}
    fresh = answer(**{"home-0": (True, 0.5), "far-0": (False, 30), "far-1": (False, 30)})
    job, _ = step(job, observe(job, tuple(pods.values()), sync=fresh))
    assert cond(job, c.DEGRADED) == ("False", c.AS_EXPECTED)
    # and without a status answer nothing is concluded about any group
    job, _ = step(job, observe(job, tuple(pods.values()), sync=None))
    assert cond(job, c.DEGRADED) == ("False", c.AS_EXPECTED)
