"""Hot spares in the operator (failurePolicy.hotSpares): the API field, the spare pod, and the
pure reconcile's promotions (operator/spares.py).

    .venv/bin/pytest tests/unit/test_operator_spares.py

The reconcile tests replay passes against a namespace kept as a dict of pod manifests (the
builders' own, as an apiserver would store them): creates add a Running, Ready pod, deletes
remove it, a promotion's JSON patch is applied op by op, its `test` ops included. The real
apiserver does the same in tests/integration/test_operator_spares.py.
"""

from __future__ import annotations

import base64
import copy
import dataclasses
import itertools
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from ddiloco.operator import api, builders, names, spares, tokens
from ddiloco.operator.api import DecoupledDiLoCoJob, FailurePolicy
from ddiloco.operator.plan import (
    Action,
    Assignment,
    ClusterView,
    Observed,
    Plan,
    PodView,
    SecretView,
    home,
)
from ddiloco.operator.reconcile import reconcile
from ddiloco.wire import auth

T0 = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)
CRD = (
    Path(__file__).resolve().parents[2] / "deploy" / "crds" / "ddiloco.dev_decoupleddilocojobs.yaml"
)


def make_job(hot: int = 1, replicas: int = 2, **extra: Any) -> DecoupledDiLoCoJob:
    spec: dict[str, Any] = {
        "image": "ddiloco:dev",
        "training": {"model": "tiny"},
        "synchronizer": {"tls": {"enabled": False}},
        "learnerGroups": [{"name": "a", "replicas": replicas}],
        "failurePolicy": {"hotSpares": hot, "backoffSeconds": 0, "maxReplacementsPerSlot": 5},
    }
    spec.update(extra)
    return DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": "hs", "namespace": "ns", "uid": "uid-1", "generation": 1},
            "spec": spec,
        }
    )


# --------------------------------------------------------------------------- the API


def test_hot_spares_default_to_none_and_are_bounded() -> None:
    assert FailurePolicy().hot_spares == 0
    assert FailurePolicy.model_validate({"hotSpares": 16}).hot_spares == 16
    for bad in (-1, 17, "many"):
        with pytest.raises(pydantic.ValidationError, match=r"hotSpares|hot_spares"):
            FailurePolicy.model_validate({"hotSpares": bad})


def test_the_crd_bounds_hot_spares_and_counts_them_in_the_status() -> None:
    crd = yaml.safe_load(CRD.read_text())
    schema = crd["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    field = schema["properties"]["spec"]["properties"]["failurePolicy"]["properties"]["hotSpares"]
    assert (field["type"], field["minimum"], field["maximum"], field["default"]) == (
        "integer",
        0,
        16,
        0,
    )
    group = schema["properties"]["status"]["properties"]["groups"]["items"]["properties"]
    assert {"spares", "sparesReady", "promoted"} <= set(group)


# --------------------------------------------------------------------------- the spare pod


def env_of(pod: dict[str, Any]) -> dict[str, Any]:
    (container,) = pod["spec"]["containers"]
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container["env"]}


def test_a_spare_pod_is_a_learner_pod_without_a_slot() -> None:
    job = make_job()
    group = job.spec.learner_groups[0]
    spare = builders.build_spare_pod(job, group, 3)
    slot = builders.build_learner_pod(job, group, 0)
    name = spare["metadata"]["name"]
    assert name == builders.spare_pod_name(job, "a", 3)
    assert name.startswith("hs-a-spare-3-") and name != slot["metadata"]["name"]
    labels = spare["metadata"]["labels"]
    assert labels[builders.LABEL_ROLE] == "spare" and labels[builders.LABEL_SPARE] == "3"
    assert labels[builders.LABEL_GROUP] == "a" and labels[builders.LABEL_JOB_UID] == "uid-1"
    for key in (builders.LABEL_SLOT, builders.LABEL_LEARNER_ID, builders.LABEL_DATA_PART):
        assert key not in labels
    env, slot_env = env_of(spare), env_of(slot)
    assert env["DDILOCO_SPARE"] == "1"
    assert env["DDILOCO_POD_NAME"] == {"fieldRef": {"fieldPath": "metadata.name"}}
    assert not set(builders.SLOT_ENV) & set(env)
    # everything else as a slot's pod: image, model, schedule, token file, resources
    assert {k: v for k, v in slot_env.items() if k not in builders.SLOT_ENV} == {
        k: v for k, v in env.items() if k not in ("DDILOCO_SPARE", "DDILOCO_POD_NAME")
    }
    (c,) = spare["spec"]["containers"]
    (s,) = slot["spec"]["containers"]
    assert (c["image"], c["command"], c["resources"]) == (s["image"], s["command"], s["resources"])
    assert c["readinessProbe"]["exec"]["command"] == ["test", "-e", builders.SPARE_READY_FILE]
    # its token file is its own spare credential, one item of its group's credentials Secret
    volumes = {v["name"]: v for v in spare["spec"]["volumes"]}
    assert volumes["token"]["secret"] == {
        "secretName": builders.learner_tokens_secret_name(job, "a"),
        "defaultMode": 0o440,
        "items": [{"key": f"spare.{name}", "path": "token"}],
    }
    assert env["DDILOCO_TOKEN_FILE"] == "/var/run/ddiloco/token/token"
    assert set(volumes) == {"token"}  # no downward API labels: the assignment comes by API
    assert [m["name"] for m in c["volumeMounts"]] == ["token"]
    assert not any("subPath" in m for m in c["volumeMounts"])
    assert spare["spec"]["restartPolicy"] == "Never"
    # its learner_selector sees it (so the job's deletion removes it); from_k8s reads it as one
    assert labels[builders.LABEL_COMPONENT] == "learner"
    view = PodView.from_k8s(spare)
    assert view is not None and view.spare and view.serial == 3 and view.index == -1


def test_under_mutual_tls_a_spare_mounts_its_own_client_certificate() -> None:
    job = make_job(synchronizer={"tls": {"enabled": True, "mutual": True}})
    spare = builders.build_spare_pod(job, job.spec.learner_groups[0], 0)
    client = next(v for v in spare["spec"]["volumes"] if v["name"] == "client")
    assert client["secret"]["secretName"] == builders.spare_client_secret_name(job, "a", 0)
    assert builders.spare_client_secret_name(job, "a", 0) != builders.client_secret_name(
        job, "a", 0
    )
    env = env_of(spare)
    assert env["DDILOCO_CLIENT_CERT_FILE"].startswith(builders.CLIENT_DIR)


def test_the_longest_names_with_spares_are_valid() -> None:
    long = "j" * api.MAX_JOB_NAME
    job = DecoupledDiLoCoJob.from_body(
        {
            "metadata": {"name": long, "namespace": "n" * 63, "uid": "u"},
            "spec": {
                "image": "x",
                "training": {"model": "tiny"},
                "synchronizer": {"tls": {"mutual": True}},
                "learnerGroups": [{"name": "g" * 16, "replicas": 512}],
                "failurePolicy": {"hotSpares": 16},
            },
        }
    )
    assert names.problems(job) == []
    assert len(builders.spare_pod_name(job, "g" * 16, 543)) <= 63


# --------------------------------------------------------------------------- reconcile


class Namespace:
    """The pods and Secrets of one namespace, changed by a plan's actions as an apiserver
    would. A pod is created only if the credential item its token volume names is there (the
    kubelet could not start it otherwise), and only its own."""

    def __init__(self) -> None:
        self.pods: dict[str, dict[str, Any]] = {}
        self.secrets: dict[str, SecretView] = {}
        self.serial = 0
        self.refused: list[Action] = []

    def views(self) -> tuple[PodView, ...]:
        return tuple(v for p in self.pods.values() if (v := PodView.from_k8s(p)) is not None)

    def view(self, token: str) -> ClusterView:
        return ClusterView(pods=self.views(), token=token, secrets=dict(self.secrets))

    def item(self, pod: dict[str, Any]) -> bytes:
        """The credential a pod's token file holds."""
        (volume,) = [v for v in pod["spec"]["volumes"] if v["name"] == "token"]
        ((item),) = volume["secret"]["items"]
        assert item["path"] == "token"
        return self.secrets[volume["secret"]["secretName"]].data[item["key"]]

    def apply(self, plan: Plan, ready: bool = True) -> None:
        for a in plan.actions:
            if a.kind == "Secret":
                if a.verb == "delete":
                    self.secrets.pop(a.name, None)
                else:
                    assert a.body is not None
                    assert (a.verb == "create") == (a.name not in self.secrets)
                    self.secrets[a.name] = SecretView(
                        data={k: base64.b64decode(v) for k, v in a.body["data"].items()},
                        job_uid=a.body["metadata"]["labels"][builders.LABEL_JOB_UID],
                    )
                continue
            if a.kind != "Pod":
                continue
            if a.verb == "create":
                assert a.body is not None
                if a.name in self.pods:
                    self.refused.append(a)
                    continue
                labels = a.body["metadata"]["labels"]
                if labels.get(builders.LABEL_ROLE) == builders.ROLE_SPARE:
                    want = auth.spare_token("tok", a.name)
                else:
                    want = auth.learner_token("tok", labels[builders.LABEL_LEARNER_ID])
                assert self.item(a.body) == want.encode(), a.name
                self.serial += 1
                body = copy.deepcopy(a.body)
                body["metadata"]["uid"] = f"uid-{self.serial}"
                body["status"] = {
                    "phase": "Running",
                    "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
                }
                self.pods[a.name] = body
            elif a.verb == "delete":
                if a.name in self.pods and self.pods[a.name]["metadata"]["uid"] == a.uid:
                    del self.pods[a.name]
            elif a.verb == "patch":
                assert a.body is not None
                if not self.json_patch(a.name, a.body["patch"]):
                    self.refused.append(a)

    def json_patch(self, name: str, ops: list[dict[str, Any]]) -> bool:
        pod = copy.deepcopy(self.pods.get(name))
        if pod is None:
            return False
        for op in ops:
            *parents, last = [
                p.replace("~1", "/").replace("~0", "~") for p in op["path"][1:].split("/")
            ]
            node = pod
            for key in parents:
                node = node[key]
            if op["op"] == "test" and node.get(last) != op["value"]:
                return False
            if op["op"] in ("add", "replace"):
                node[last] = op["value"]
        self.pods[name] = pod
        return True

    def fail(self, name: str) -> None:
        self.pods[name]["status"] = {"phase": "Failed", "reason": "Evicted"}


def run(
    job: DecoupledDiLoCoJob, ns: Namespace, now: datetime, passes: int = 4, ready: bool = True
) -> tuple[DecoupledDiLoCoJob, list[Plan]]:
    plans = []
    for k in range(passes):
        obs = Observed(
            now=now + timedelta(seconds=k),
            clusters={home(job): ns.view("tok")},
            statefulset={"status": {"availableReplicas": 1}},
            service=True,
            shards_service=True,
            sync_status={"global_version": 0},
        )
        plan = reconcile(job, obs, fresh_token="tok")
        if plan.status is not None:
            job = job.model_copy(update={"status": plan.status})
        ns.apply(plan, ready)
        plans.append(plan)
    return job, plans


def spare_names(ns: Namespace) -> list[str]:
    return sorted(
        n for n, p in ns.pods.items() if p["metadata"]["labels"].get(builders.LABEL_ROLE) == "spare"
    )


def test_hot_spares_one_makes_one_spare_per_group_and_counts_it() -> None:
    job = make_job(learnerGroups=[{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}])
    ns = Namespace()
    job, _ = run(job, ns, T0)
    assert [n.rsplit("-", 1)[0] for n in spare_names(ns)] == ["hs-a-spare-0", "hs-b-spare-0"]
    slots = sorted(n.rsplit("-", 1)[0] for n in ns.pods if "spare" not in n)
    assert slots == ["hs-a-0", "hs-a-1", "hs-b-0"]
    groups = {g.name: (g.spares, g.spares_ready) for g in job.status.groups}
    assert groups == {"a": (1, 1), "b": (1, 1)}
    assert job.status.phase == "Running"


def test_a_failed_slot_is_handed_to_the_ready_spare_and_a_new_spare_follows() -> None:
    job = make_job()
    ns = Namespace()
    job, _ = run(job, ns, T0)
    (spare,) = spare_names(ns)
    uid = ns.pods[spare]["metadata"]["uid"]
    slot0 = builders.learner_pod_name(job, "a", 0)
    ns.fail(slot0)
    job, plans = run(job, ns, T0 + timedelta(seconds=10))
    # the spare, the same pod, now holds slot 0: labels, attempt 1, the slot's data part
    labels = ns.pods[spare]["metadata"]["labels"]
    assert ns.pods[spare]["metadata"]["uid"] == uid
    assert (labels[builders.LABEL_ROLE], labels[builders.LABEL_SLOT]) == ("learner", "0")
    assert labels[builders.LABEL_LEARNER_ID] == "a-0" and labels[builders.LABEL_ATTEMPT] == "1"
    assert labels[builders.LABEL_DATA_PART] == "0-of-2"
    assert ns.pods[spare]["metadata"]["annotations"][builders.ANNOTATION_PROMOTED_AT]
    assert slot0 not in ns.pods  # the failed pod went, and no cold replacement was made
    events = [e for p in plans for e in p.events]
    # posted by the runtime once the patch is done, never before
    assert not [e for e in events if e.reason == spares.PROMOTED]
    promoted = [a.event for p in plans for a in p.actions if a.event is not None]
    assert len(promoted) == 1 and spare in promoted[0].message and "a-0" in promoted[0].message
    assert any(e.reason == "LearnerReplaced" and spare in e.message for e in events)
    patch = next(a for p in plans for a in p.actions if a.verb == "patch")
    assert patch.then is not None and patch.then.body["learner_id"] == "a-0"
    assert {"op": "test", "path": "/metadata/uid", "value": uid} in patch.body["patch"]  # type: ignore[index]
    # a new spare stands by, with the next serial; the books count one replacement, promoted
    (new,) = spare_names(ns)
    assert new.startswith("hs-a-spare-1-")
    (g,) = job.status.groups
    assert (g.replaced, g.promoted, g.slot_replacements, g.spares) == (1, 1, [1, 0], 1)
    assert job.status.ready_learners == 2 and not job.status.slots
    # each pass re-derives the assignment from the promoted pod's labels: every pass while
    # young, then still, for as long as the pod lives (the runtime backs off and stops once
    # the synchronizer says it was delivered)
    assert any(
        a.pod == spare and a.body["learner_index"] == 0 and a.young
        for p in plans
        for a in p.assignments
    )
    _, plans = run(job, ns, T0 + timedelta(seconds=10 + spares.RESEND_S + 5), passes=1)
    (late,) = plans[0].assignments
    assert (late.pod, late.young, late.body["learner_id"]) == (spare, False, "a-0")
    ns.pods[spare]["metadata"]["deletionTimestamp"] = "2026-12-01T12:05:00Z"
    _, plans = run(job, ns, T0 + timedelta(seconds=300), passes=1)
    assert not [a for a in plans[0].assignments if a.pod == spare]  # a spare that went: no


def test_an_undelivered_assignment_is_resent_with_a_backoff_until_delivered() -> None:
    """Past RESEND_S the runtime sends an undelivered assignment after 2, 4, 8 ... s, at most
    every RESEND_MAX_S, for as long as the pod is promoted and alive; once delivered, never."""
    r = spares.Resends()
    young = Assignment("p", "uid-p", {}, young=True)
    old = Assignment("p", "uid-p", {}, young=False)
    assert r.due(young, 0.0) and r.due(old, 0.0)
    r.sent(old, 0.0, delivered=False)
    assert r.due(young, 0.5)  # young: every pass
    assert not r.due(old, 1.9) and r.due(old, 2.0)
    sends, t = [], 2.0
    while t < 600:
        if r.due(old, t):
            sends.append(t)
            r.sent(old, t, delivered=False)
        t += 0.5
    gaps = [b - a for a, b in itertools.pairwise(sends)]
    assert gaps[:5] == [4.0, 8.0, 16.0, 32.0, 60.0] and max(gaps) == spares.RESEND_MAX_S
    r.sent(old, t, delivered=True)
    assert r.due(old, t)  # forgotten (the runtime's delivered set keeps it from being sent)
    r.sent(old, t, delivered=False)
    r.keep(set())  # the pod went
    assert r.due(old, t + 0.1)


def test_a_promoted_spares_item_holds_its_slots_learner_credential_through_rotations() -> None:
    """A promoted spare still mounts its `spare.<pod>` item; from the promotion on the item
    holds the slot's learner credential, one line per key during a rotation, so a learner
    that re-reads its token file after a 401 sends its slot's credential."""
    job = make_job()
    ns = Namespace()
    job, _ = run(job, ns, T0)
    (spare,) = spare_names(ns)
    name = builders.learner_tokens_secret_name(job, "a")
    key = builders.spare_token_key(spare)
    assert ns.secrets[name].data[key] == auth.spare_token("tok", spare).encode()
    ns.fail(builders.learner_pod_name(job, "a", 0))
    job, _ = run(job, ns, T0 + timedelta(seconds=10))
    assert ns.pods[spare]["metadata"]["labels"][builders.LABEL_LEARNER_ID] == "a-0"
    assert ns.item(ns.pods[spare]) == auth.learner_token("tok", "a-0").encode()
    assert ns.secrets[name].data[key] == ns.secrets[name].data["a-0"]
    # a rotation: two lines, the new key's first, in the promoted spare's item too
    view = ns.view("new\ntok")
    want = tokens.credentials(job, job.spec.learner_groups[0], view, ["new", "tok"])
    assert want[key] == auth.derived_lines(["new", "tok"], "learner", "a-0").encode()
    assert want[key].split(b"\n")[0] == auth.learner_token("new", "a-0").encode()


def test_each_pod_holds_its_own_credential_and_the_secret_follows_the_spares() -> None:
    """The group's credentials Secret: an item per learner id and per spare pod, those there
    and the next ones a pass may create, so each is there before its pod (Namespace.apply
    checks every pod's item). A promoted spare keeps its own spare item (it reads its
    assignment with it); a removed spare's item goes with it."""
    job = make_job(hot=2)
    ns = Namespace()
    job, _ = run(job, ns, T0)
    name = builders.learner_tokens_secret_name(job, "a")

    def items() -> set[str]:
        return set(ns.secrets[name].data)

    def spares_(*serials: int) -> set[str]:
        return {f"spare.{builders.spare_pod_name(job, 'a', k)}" for k in serials}

    assert spare_names(ns) == sorted(builders.spare_pod_name(job, "a", k) for k in (0, 1))
    assert items() == {"a-0", "a-1"} | spares_(0, 1, 2, 3)
    assert set(ns.secrets) == {name}  # nothing else of the job's in the pods' namespace here
    for pod in ns.pods.values():
        assert b"tok" not in ns.item(pod).split(b"\n")  # never the key itself
    ns.fail(builders.learner_pod_name(job, "a", 0))
    job, _ = run(job, ns, T0 + timedelta(seconds=10))
    assert spare_names(ns) == sorted(builders.spare_pod_name(job, "a", k) for k in (1, 2))
    assert items() == {"a-0", "a-1"} | spares_(0, 1, 2, 3, 4)
    job = job.model_copy(
        update={"spec": job.spec.model_copy(update={"failure_policy": FailurePolicy(hot_spares=0)})}
    )
    job, _ = run(job, ns, T0 + timedelta(seconds=20))
    assert spare_names(ns) == []
    assert items() == {"a-0", "a-1"} | spares_(0)  # spare 0 holds slot a-0 now


def test_without_a_ready_spare_the_slot_gets_a_new_pod() -> None:
    job = make_job()
    ns = Namespace()
    job, _ = run(job, ns, T0, ready=False)  # the spare never turns Ready (still warming up)
    (spare,) = spare_names(ns)
    ns.fail(builders.learner_pod_name(job, "a", 1))
    job, plans = run(job, ns, T0 + timedelta(seconds=10), ready=False)
    assert not [a for p in plans for a in p.actions if a.verb == "patch"]
    assert builders.learner_pod_name(job, "a", 1) in ns.pods  # recreated under its own name
    assert spare_names(ns) == [spare]
    (g,) = job.status.groups
    assert (g.replaced, g.promoted, g.spares, g.spares_ready) == (1, 0, 1, 0)


def test_a_promotion_whose_precondition_fails_changes_nothing() -> None:
    job = make_job()
    ns = Namespace()
    job, _ = run(job, ns, T0)
    (spare,) = spare_names(ns)
    ns.fail(builders.learner_pod_name(job, "a", 0))
    seen = ns.view("tok")
    obs_pods = seen.pods
    ns.pods[spare]["metadata"]["uid"] = "someone-else"  # replaced between observe and patch
    plan = reconcile(
        job,
        Observed(
            now=T0 + timedelta(seconds=10),
            clusters={home(job): seen},
            statefulset={"status": {"availableReplicas": 1}},
            service=True,
            shards_service=True,
        ),
        fresh_token="tok",
    )
    ns.pods.pop(builders.learner_pod_name(job, "a", 0))  # the failed pod is gone by now
    job = job.model_copy(update={"status": plan.status})
    plan2 = reconcile(
        job,
        Observed(
            now=T0 + timedelta(seconds=11),
            clusters={home(job): dataclasses.replace(seen, pods=obs_pods[1:])},
            statefulset={"status": {"availableReplicas": 1}},
            service=True,
            shards_service=True,
        ),
        fresh_token="tok",
    )
    ns.apply(plan2)
    assert [a.verb for a in ns.refused] == ["patch"]
    assert ns.pods[spare]["metadata"]["labels"][builders.LABEL_ROLE] == "spare"


def test_suspend_and_fewer_spares_delete_spares_and_scaling_keeps_them() -> None:
    job = make_job(hot=2)
    ns = Namespace()
    job, _ = run(job, ns, T0)
    assert len(spare_names(ns)) == 2
    job = job.model_copy(
        update={"spec": job.spec.model_copy(update={"failure_policy": FailurePolicy(hot_spares=1)})}
    )
    job, _ = run(job, ns, T0 + timedelta(seconds=5))
    assert len(spare_names(ns)) == 1
    job = job.model_copy(update={"spec": job.spec.model_copy(update={"suspend": True})})
    job, _ = run(job, ns, T0 + timedelta(seconds=10))
    assert ns.pods == {}
    (g,) = job.status.groups
    assert (g.spares, g.replaced, g.promoted) == (0, 0, 0)


def test_spares_go_once_every_slot_of_their_group_has_finished() -> None:
    # a finished slot is never replaced: a spare would only hold its (GPU) node
    job = make_job(learnerGroups=[{"name": "a", "replicas": 2}, {"name": "b", "replicas": 1}])
    ns = Namespace()
    job, _ = run(job, ns, T0)
    a_slots = [builders.learner_pod_name(job, "a", i) for i in (0, 1)]
    ns.pods[a_slots[0]]["status"] = {"phase": "Succeeded"}
    job, _ = run(job, ns, T0 + timedelta(seconds=5))
    assert len(spare_names(ns)) == 2  # slot a-1 still trains and may fail
    ns.pods[a_slots[1]]["status"] = {"phase": "Succeeded"}
    job, _ = run(job, ns, T0 + timedelta(seconds=10))
    assert [n.rsplit("-", 1)[0] for n in spare_names(ns)] == ["hs-b-spare-0"]
    assert all(name in ns.pods for name in a_slots)  # the finished pods stay, as they were
    groups = {g.name: g.spares for g in job.status.groups}
    assert groups == {"a": 0, "b": 1}
    assert job.status.phase == "Running"  # b still trains


def test_an_evicted_learner_that_exited_0_is_replaced_not_finished() -> None:
    # On SIGTERM the learner hands over its work and exits 0, so the kubelet reports an evicted
    # (deleted) pod as Succeeded: still a failure, whose slot the spare takes over.
    job = make_job(replicas=1)
    ns = Namespace()
    job, _ = run(job, ns, T0)
    (spare,) = spare_names(ns)
    slot0 = builders.learner_pod_name(job, "a", 0)
    ns.pods[slot0]["metadata"]["deletionTimestamp"] = "2026-12-01T12:00:05Z"
    ns.pods[slot0]["status"] = {"phase": "Succeeded"}
    job, _ = run(job, ns, T0 + timedelta(seconds=5), passes=1)
    assert job.status.phase != "Succeeded" and spare_names(ns) == [spare]
    del ns.pods[slot0]  # the kubelet finished the deletion
    job, _ = run(job, ns, T0 + timedelta(seconds=10))
    labels = ns.pods[spare]["metadata"]["labels"]
    assert (labels[builders.LABEL_LEARNER_ID], labels[builders.LABEL_ATTEMPT]) == ("a-0", "1")
    (g,) = job.status.groups
    assert (g.replaced, g.promoted) == (1, 1)


def test_serials_wanted_cover_promoted_spares_and_the_next_ones() -> None:
    job = make_job(hot=2)
    pods = (
        PodView(name="x", uid="1", job_uid="uid-1", group="a", index=0, serial=1),
        PodView(name="y", uid="2", job_uid="uid-1", group="a", index=-1, spare=True, serial=3),
        PodView(name="z", uid="3", job_uid="other", group="a", index=-1, spare=True, serial=0),
    )
    assert spares.serials_wanted(job, job.spec.learner_groups[0], pods) == {0, 1, 2, 3}


def test_a_spare_that_fails_is_deleted_and_replaced() -> None:
    job = make_job()
    ns = Namespace()
    job, _ = run(job, ns, T0)
    (spare,) = spare_names(ns)
    ns.fail(spare)
    job, plans = run(job, ns, T0 + timedelta(seconds=5))
    assert spare not in ns.pods
    (new,) = spare_names(ns)
    assert new != spare
    assert any(e.reason == "SpareFailed" and spare in e.message for p in plans for e in p.events)
    assert not [a for p in plans for a in p.actions if a.verb == "patch"]  # never promoted


def test_under_mutual_tls_each_spare_gets_its_own_certificate() -> None:
    import base64

    from cryptography import x509

    from ddiloco.operator import certs

    job = make_job(synchronizer={"tls": {"enabled": True, "mutual": True}})
    promoted = PodView(name="p", uid="1", job_uid="uid-1", group="a", index=0, serial=2)
    obs = Observed(now=T0, clusters={home(job): ClusterView(pods=(promoted,), token="tok")})
    plan = Plan()
    certs.tls_plan(job, obs, plan)
    made = {a.name: a.body for a in plan.actions if a.kind == "Secret" and a.verb == "create"}
    # the promoted spare (serial 2) keeps its own, and the next spare's (serial 0) is ready
    for serial in (0, 2):
        body = made[builders.spare_client_secret_name(job, "a", serial)]
        assert body is not None
        cert = x509.load_pem_x509_certificate(base64.b64decode(body["data"]["tls.crt"]))
        cn = cert.subject.get_attributes_for_oid(x509.NameOID.COMMON_NAME)[0].value
        assert cn == builders.spare_pod_name(job, "a", serial)
    assert builders.spare_client_secret_name(job, "a", 1) not in made  # not wanted
    # and they are read by name, never listed: the spares' names are among those read
    names = certs.secret_names(job, home(job))
    assert builders.spare_client_secret_name(job, "a", 0) in names
