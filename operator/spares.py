"""Hot spares (`failurePolicy.hotSpares`): idle, already started learner pods per group that
take over a failed slot's identity instead of a cold start.

    group_spares = spares.observe(job, group, tgt, view.pods)   # reconcile.py, per group
    spare = group_spares.take()                                 # a Ready one, or None
    spares.promote(job, group, tgt, slot, spare, shard, attempt, now, plan)
    spares.refill(job, group, tgt, group_spares, plan)         # keep hotSpares standing
    delivered = spares.put_assignment(url, token, context, assignment, timeout)  # act.py

A spare pod (builders.build_spare_pod) is a learner pod without a slot: label
`ddiloco.dev/role: spare`, a serial (`ddiloco.dev/spare`, also in its name), env
DDILOCO_SPARE=1. `ddiloco learner` in it does the cold start (imports, model, one throwaway
step; learner/spare.py), then turns Ready and long-polls the synchronizer's
`GET /v1/spares/<pod>` for an identity.

Promotion, when a slot's pod has failed and is gone and its replacement is due (the same
backoff and limit as a new pod), and a Ready spare of the group stands by:
  1. the spare's labels are patched to the slot's (slot, learner id, data part, attempt + 1,
     role learner; annotation `ddiloco.dev/promoted-at`), a JSON patch whose `test` ops make
     the pod's uid and its role "spare" preconditions: a spare deleted, replaced or promoted
     meanwhile is refused, never promoted twice;
  2. once the patch is done, the runtime PUTs the assignment to the synchronizer
     (`PUT /v1/spares/<pod>`, the job key, the operator's own TLS client as for
     /v1/status), which hands it to the spare's waiting long poll (the spare asks with its
     own spare credential, and is answered the slot's learner credential with it);
  3. a new spare is created in the same pass (the lowest serial no pod of the group uses).
The slot's books count the promoted pod as its replacement exactly as a new pod (its attempt
label), and a SparePromoted event (posted once the patch is done) names both. Without a Ready spare the slot gets a new pod.

Crash safety without history: the promotion is in the pod's labels, so each pass derives from
what it observes which promoted pods still need their assignment: every promoted pod that is
alive is re-sent (PUT is idempotent) until the synchronizer says the spare fetched it (a
restarted synchronizer, which forgot it, gets it again). The spare learns its slot from the
synchronizer alone, so a synchronizer down for minutes only delays it: the runtime re-sends
each pass while the promotion is younger than RESEND_S, then with a doubling backoff up to
RESEND_MAX_S (`Resends`), for as long as the promoted pod lives.

Its credential: the promoted pod keeps mounting its item `spare.<pod>` of the group's
credentials Secret, which from the promotion on holds the slot's learner credential
(tokens.credentials), so a learner that re-reads its token file after a 401 (a key rotation
finished after the synchronizer handed it its credential) reads the right one.
"""

from __future__ import annotations

import json
import ssl
import urllib.request
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Final

from ddiloco.operator import builders
from ddiloco.operator.api import DecoupledDiLoCoJob, LearnerGroup
from ddiloco.operator.plan import Action, Assignment, Event, Plan, PodView, Target, iso
from ddiloco.operator.slots import Slot

RESEND_S: Final = 60.0
"""How long after its promotion a spare's assignment is re-sent on every pass (then with a
backoff) until it is delivered."""
RESEND_FIRST_S: Final = 2.0
"""The first wait between two sends of an assignment past RESEND_S; it doubles."""
RESEND_MAX_S: Final = 60.0
"""The longest wait between two sends of an undelivered assignment."""
PROMOTED: Final = "SparePromoted"
ASSIGNMENT_PATH: Final = "/v1/spares/{pod}"


@dataclass
class GroupSpares:
    """A group's spares as observed in one pass, and what the pass did with them."""

    standing: list[PodView] = field(default_factory=list)  # unpromoted, not terminating
    serials: set[int] = field(default_factory=set)  # used by any pod born a spare
    taken: list[PodView] = field(default_factory=list)  # promoted in this pass
    dead: list[PodView] = field(default_factory=list)  # unpromoted spares that ended

    @property
    def ready(self) -> list[PodView]:
        return [p for p in self.standing if _ready(p) and p not in self.taken]

    def take(self) -> PodView | None:
        """The Ready spare with the lowest serial, now taken; None when none is Ready."""
        ready = self.ready
        if not ready:
            return None
        self.taken.append(ready[0])
        return ready[0]

    def counts(self) -> tuple[int, int]:
        """(spares holding no slot, of which Ready), after this pass's promotions."""
        left = [p for p in self.standing if p not in self.taken]
        return len(left), len(self.ready)


def _ready(pod: PodView) -> bool:
    return pod.ready and pod.phase == "Running" and not pod.terminating


def observe(job: DecoupledDiLoCoJob, group: LearnerGroup, pods: tuple[PodView, ...]) -> GroupSpares:
    mine = [p for p in pods if p.job_uid == job.uid and p.group == group.name]
    standing = sorted(
        (
            p
            for p in mine
            if p.spare and not p.terminating and p.phase not in ("Failed", "Succeeded")
        ),
        key=lambda p: (p.serial if p.serial is not None else 1 << 30, p.name),
    )
    dead = [p for p in mine if p.spare and not p.terminating and p.phase in ("Failed", "Succeeded")]
    serials = {p.serial for p in mine if p.serial is not None}
    return GroupSpares(standing=standing, serials=serials, dead=dead)


def assignment(group: str, index: int, shard: tuple[int, int], attempt: int) -> dict[str, Any]:
    """What a spare needs to become slot `index` of `group`: the per-slot part of a slot
    pod's env (builders.SLOT_ENV), and where it stands in the slot's books."""
    return {
        "learner_id": builders.learner_id(group, index),
        "learner_index": shard[0],
        "num_learners": shard[1],
        "group": group,
        "slot": index,
        "attempt": attempt,
    }


def _label(key: str) -> str:
    return "/metadata/labels/" + key.replace("~", "~0").replace("/", "~1")


def promote(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    tgt: Target,
    rec: Slot,
    spare: PodView,
    shard: tuple[int, int],
    attempt: int,
    now: datetime,
    plan: Plan,
) -> None:
    """Hand slot `rec` to `spare`: the label patch (with its preconditions), the assignment
    to send once it is done, and the event."""
    body = assignment(group.name, rec.index, shard, attempt)
    labels = {
        builders.LABEL_SLOT: str(rec.index),
        builders.LABEL_LEARNER_ID: body["learner_id"],
        builders.LABEL_DATA_PART: f"{shard[0]}-of-{shard[1]}",
        builders.LABEL_ATTEMPT: str(attempt),
    }
    patch: list[dict[str, Any]] = [
        {"op": "test", "path": "/metadata/uid", "value": spare.uid},
        {"op": "test", "path": _label(builders.LABEL_ROLE), "value": builders.ROLE_SPARE},
        {"op": "replace", "path": _label(builders.LABEL_ROLE), "value": builders.ROLE_LEARNER},
        *({"op": "add", "path": _label(k), "value": v} for k, v in labels.items()),
        {
            "op": "add",
            "path": "/metadata/annotations/" + builders.ANNOTATION_PROMOTED_AT.replace("/", "~1"),
            "value": iso(now),
        },
    ]
    plan.actions.append(
        Action(
            "patch",
            tgt,
            "Pod",
            spare.name,
            body={"patch": patch},
            uid=spare.uid,
            then=Assignment(spare.name, spare.uid, body),
            event=Event(
                "Normal",
                PROMOTED,
                f"Hot spare {spare.name} takes over slot {rec.id} after {rec.reason} "
                f"(learner id {body['learner_id']}, data part {shard[0]} of {shard[1]}, "
                f"attempt {attempt})",
            ),
        )
    )


def wanted(job: DecoupledDiLoCoJob, group: LearnerGroup, finished: bool = False) -> int:
    """How many spares the group keeps: hotSpares, but none while suspended, for a group of
    0 replicas (no slot to take over: its spares would only hold nodes) or once every slot
    of the group has finished."""
    if job.spec.suspend or finished or group.replicas == 0:
        return 0
    return job.spec.failure_policy.hot_spares


def refill(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    tgt: Target,
    spares: GroupSpares,
    plan: Plan,
    finished: bool = False,
) -> None:
    """Create spares up to hotSpares (0 while suspended, and once every slot of the group has
    `finished`: no slot is left to take over), each with the lowest free serial; delete the
    surplus (not Ready ones first, then the highest serials)."""
    want = wanted(job, group, finished)
    for pod in spares.dead:  # a spare that ended (e.g. evicted while idle): replaced below
        plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid, grace_seconds=0))
        why = pod.reason or pod.phase
        plan.events.append(Event("Warning", "SpareFailed", f"Hot spare {pod.name} ended: {why}"))
    left = [p for p in spares.standing if p not in spares.taken]
    if len(left) > want:
        surplus = sorted(left, key=lambda p: (_ready(p), p.serial or 0))[: len(left) - want]
        for pod in surplus:
            plan.actions.append(Action("delete", tgt, "Pod", pod.name, uid=pod.uid))
        return
    used = set(spares.serials)
    serial = 0
    for _ in range(want - len(left)):
        while serial in used:
            serial += 1
        used.add(serial)
        plan.actions.append(
            Action(
                "create",
                tgt,
                "Pod",
                builders.spare_pod_name(job, group.name, serial),
                builders.build_spare_pod(
                    job, group, serial, tgt.namespace, owned=tgt.secret is None
                ),
            )
        )


def serials_wanted(
    job: DecoupledDiLoCoJob, group: LearnerGroup, pods: tuple[PodView, ...]
) -> set[int]:
    """Serials whose client certificate (mutual TLS) must exist: those of the group's pods
    born spares, and the lowest hotSpares free ones (what `refill` may create next)."""
    used = {
        p.serial
        for p in pods
        if p.job_uid == job.uid and p.group == group.name and p.serial is not None
    }
    out, serial = set(used), 0
    for _ in range(wanted(job, group)):
        while serial in used:
            serial += 1
        out.add(serial)
        serial += 1
    return out


def resend(
    job: DecoupledDiLoCoJob,
    group: LearnerGroup,
    pods: tuple[PodView, ...],
    now: datetime,
    plan: Plan,
) -> None:
    """The assignments of the group's promoted spares that are alive, from their labels
    (act.py sends each until the synchronizer says it was delivered, `Resends` says
    when)."""
    for p in pods:
        if (
            p.job_uid != job.uid
            or p.group != group.name
            or p.spare
            or p.serial is None
            or p.shard is None
            or p.terminating
            or p.phase in ("Failed", "Succeeded")
            or not p.promoted_at
        ):
            continue
        try:
            at = datetime.strptime(p.promoted_at, "%Y-%m-%dT%H:%M:%SZ")
        except ValueError:
            continue
        body = assignment(group.name, p.index, p.shard, p.attempt)
        young = now.replace(tzinfo=None) - at <= timedelta(seconds=RESEND_S)
        plan.assignments.append(Assignment(p.name, p.uid, body, young=young))


class Resends:
    """When to send each undelivered assignment again (act.py keeps one per job): every
    pass while its promotion is young, then after RESEND_FIRST_S, doubling up to
    RESEND_MAX_S, so a synchronizer down for long is asked at a bounded rate, and a spare
    promoted while it was down gets its slot once it is back."""

    def __init__(self) -> None:
        self._next: dict[str, tuple[float, float]] = {}  # pod uid -> (send at, last wait)

    def due(self, item: Assignment, now: float) -> bool:
        if item.young:
            return True
        at, _ = self._next.get(item.uid, (now, 0.0))
        return now >= at

    def sent(self, item: Assignment, now: float, delivered: bool) -> None:
        """Note a send (or a failed try): delivered ones are forgotten."""
        if delivered:
            self._next.pop(item.uid, None)
            return
        _, wait = self._next.get(item.uid, (now, 0.0))
        wait = RESEND_FIRST_S if wait <= 0 else min(wait * 2, RESEND_MAX_S)
        self._next[item.uid] = (now + wait, wait)

    def keep(self, uids: set[str]) -> None:
        """Forget the pods no longer promoted and alive."""
        for uid in set(self._next) - uids:
            del self._next[uid]


# ------------------------------------------------------------------------------- I/O (act.py)


def put_assignment(
    base_url: str,
    token: str,
    context: ssl.SSLContext | None,
    item: Assignment,
    timeout: float,
) -> bool:
    """PUT one assignment to the synchronizer; True when the spare has fetched it. Raises
    OSError (unreachable, refused) or ValueError (an answer that is not ours)."""
    data = json.dumps(dict(item.body)).encode()
    req = urllib.request.Request(
        base_url.rstrip("/") + ASSIGNMENT_PATH.format(pod=item.pod),
        data=data,
        method="PUT",
        headers={
            "Authorization": f"Bearer {token}",
            "Content-Type": "application/json",
            "Accept": "application/json",
        },
    )
    https = base_url.startswith("https://")
    with urllib.request.urlopen(req, timeout=timeout, context=context if https else None) as resp:
        answer = json.loads(resp.read())
    if not isinstance(answer, dict):
        raise ValueError("the synchronizer's answer is not a JSON object")
    return bool(answer.get("delivered"))
