"""The chaos schedule of `ddiloco local` (local/chaos.py), applied to pods on a cluster.

    from kubernetes import client
    chaos = PodChaos(api_client, "team-a", job="my-job")
    records = chaos.run(make_schedule("kill+partition", learners=8, seconds=600, seed=1))
    chaos.inject(event, now); chaos.recover(now)   # or event by event (chaos.ChaosInjector)

Each event maps to Kubernetes API calls on the pods the operator labels
(`ddiloco.dev/learner-id=<target>`, the synchronizer by `app.kubernetes.io/component`):

| event | API calls |
|---|---|
| kill, kill_sync | DELETE the pod with gracePeriodSeconds=0 (SIGKILL; the operator replaces it) |
| remove | POST an Eviction for the pod (scavenged capacity taken back; honours PDBs) |
| partition | CREATE a deny-all NetworkPolicy on the pod's labels, DELETE it `delay` s later |
| pause, add | none: recorded as skipped (no API freezes a container; adding a learner is a change of the job's replicas, which the operator owns) |

The replacement delay of a kill is not ours to choose on a cluster: the operator and the
scheduler decide when the new pod runs. A NetworkPolicy needs a CNI that enforces it (kwok,
on the test control plane, stores it and enforces nothing). `plan()` is the pure mapping;
`run()` applies it on the schedule's clock; tests/integration/test_chaos_k8s.py runs it on a
real apiserver. PodChaos is also a `chaos.ChaosInjector`, the interface of the local runs
(local/supervisor.py): `inject(event, now)` performs the event's first action now and holds
a partition's heal until `recover(now)` finds it due, so `chaos.inject_due` drives pods as
it drives processes.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final, Literal

from ddiloco.local.chaos import SYNCHRONIZER, ChaosEvent, Schedule

log = logging.getLogger(__name__)

LABEL_LEARNER_ID: Final = "ddiloco.dev/learner-id"
LABEL_COMPONENT: Final = "app.kubernetes.io/component"
LABEL_JOB: Final = "ddiloco.dev/job"
LABEL_CHAOS: Final = "ddiloco.dev/chaos"

Verb = Literal["delete", "evict", "isolate", "heal", "skip"]


@dataclass(frozen=True)
class PodAction:
    at: float
    """Seconds after the schedule's start."""
    verb: Verb
    target: str
    selector: str
    """Label selector of the target's pods."""
    reason: str = ""


def selector(target: str, job: str | None = None) -> str:
    """Label selector of a schedule target's pods (the operator's labels)."""
    own = (
        f"{LABEL_COMPONENT}=synchronizer"
        if target == SYNCHRONIZER
        else f"{LABEL_LEARNER_ID}={target}"
    )
    return f"{own},{LABEL_JOB}={job}" if job else own


def event_actions(ev: ChaosEvent, job: str | None = None) -> list[PodAction]:
    """The API actions of one event, at its time (a partition's heal `delay` s after its
    cut; pure)."""

    def act(verb: Verb, at: float, reason: str = "") -> PodAction:
        return PodAction(round(at, 3), verb, ev.target, selector(ev.target, job), reason)

    if ev.action in ("kill", "kill_sync"):
        return [act("delete", ev.at)]
    if ev.action == "remove":
        return [act("evict", ev.at)]
    if ev.action == "partition":
        return [act("isolate", ev.at), act("heal", ev.at + ev.delay)]
    if ev.action == "pause":
        return [act("skip", ev.at, "no Kubernetes API freezes a running container")]
    return [act("skip", ev.at, "adding a learner is a change of the job's replicas")]  # add


def plan(schedule: Schedule, job: str | None = None) -> list[PodAction]:
    """The API actions of a schedule, in time order (pure). A schedule in steps is refused:
    a pod's inner steps are not watched from here."""
    if schedule.in_steps:
        raise ValueError("a chaos schedule in steps cannot be applied to pods; draw it in seconds")
    out = [action for ev in schedule.events for action in event_actions(ev, job)]
    out.sort(key=lambda a: (a.at, a.verb != "heal"))  # a heal before a new cut at the same time
    return out


def policy_name(target: str) -> str:
    return f"ddiloco-chaos-isolate-{target}".lower()[:63]


class PodChaos:
    """Applies a schedule to one namespace. State: the records of what it did, each with the
    action, the pods it touched, and an `error` when the API refused."""

    def __init__(
        self,
        api_client: Any,
        namespace: str,
        *,
        job: str | None = None,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        from kubernetes import client

        self.client = client
        self.core = client.CoreV1Api(api_client)
        self.net = client.NetworkingV1Api(api_client)
        self.namespace = namespace
        self.job = job
        self.clock = clock
        self.sleep = sleep
        self.records: list[dict[str, Any]] = []
        self.heals: list[tuple[float, PodAction]] = []
        """Partitions to heal, with when (the clock of `inject`'s `now`)."""

    def _pods(self, sel: str) -> list[Any]:
        pods = self.core.list_namespaced_pod(self.namespace, label_selector=sel).items
        return [p for p in pods if p.metadata.deletion_timestamp is None]

    def apply(self, action: PodAction) -> dict[str, Any]:
        """Perform one action now; return its record."""
        from kubernetes.client.exceptions import ApiException

        rec: dict[str, Any] = {"at": action.at, "verb": action.verb, "target": action.target}
        try:
            if action.verb == "skip":
                rec["reason"] = action.reason
            elif action.verb in ("delete", "evict"):
                names = [p.metadata.name for p in self._pods(action.selector)]
                for name in names:
                    if action.verb == "delete":
                        self.core.delete_namespaced_pod(
                            name, self.namespace, grace_period_seconds=0
                        )
                    else:
                        body = self.client.V1Eviction(
                            metadata=self.client.V1ObjectMeta(name=name, namespace=self.namespace)
                        )
                        self.core.create_namespaced_pod_eviction(name, self.namespace, body)
                rec["pods"] = names
            elif action.verb == "isolate":
                self.net.create_namespaced_network_policy(self.namespace, self._deny_all(action))
                rec["policy"] = policy_name(action.target)
            else:  # heal
                self.net.delete_namespaced_network_policy(
                    policy_name(action.target), self.namespace
                )
                rec["policy"] = policy_name(action.target)
        except ApiException as e:
            rec["error"] = f"{e.status} {e.reason}"
            log.warning("Chaos %s %s refused: %s", action.verb, action.target, rec["error"])
        self.records.append(rec)
        return rec

    def inject(self, ev: ChaosEvent, now: float) -> dict[str, Any] | None:
        """Perform the event's action now (chaos.ChaosInjector); a partition's heal waits
        for `recover`. Returns the record's fields (verb, pods or policy), or None when the
        event is skipped or the API refused it (the record in `records` says why)."""
        first, *later = event_actions(ev, self.job)
        rec = self.apply(first)
        self.heals += [(now + a.at - first.at, a) for a in later]
        if first.verb == "skip" or "error" in rec:
            return None
        return {k: v for k, v in rec.items() if k not in ("at", "target")}

    def recover(self, now: float) -> None:
        """Heal the partitions due by `now`."""
        due = [a for at, a in self.heals if at <= now]
        self.heals = [(at, a) for at, a in self.heals if at > now]
        for action in due:
            self.apply(action)

    def _deny_all(self, action: PodAction) -> Any:
        c = self.client
        labels = dict(kv.split("=", 1) for kv in action.selector.split(","))
        return c.V1NetworkPolicy(
            metadata=c.V1ObjectMeta(
                name=policy_name(action.target), labels={LABEL_CHAOS: "isolate"}
            ),
            spec=c.V1NetworkPolicySpec(
                pod_selector=c.V1LabelSelector(match_labels=labels),
                policy_types=["Ingress", "Egress"],
                ingress=[],
                egress=[],
            ),
        )

    def run(self, schedule: Schedule) -> list[dict[str, Any]]:
        """Apply every action at its time after now; return the records."""
        start = self.clock()
        for action in plan(schedule, self.job):
            wait = start + action.at - self.clock()
            if wait > 0:
                self.sleep(wait)
            self.apply(action)
        return self.records
