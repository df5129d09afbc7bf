"""`spec.evaluation`: the evaluator's Deployment and credential (operator/evaluator_workload.py),
what reconcile does with them, and the synchronizer's latest evaluation in the job status.

    .venv/bin/pytest tests/unit/test_operator_evaluation.py

Pure: the builders and reconcile on hand-made observations (tests/integration/
test_operator_evaluation.py has the apiserver's side).
"""

from __future__ import annotations

import base64
import dataclasses
import math
from typing import Any

import pytest

from ddiloco.learner import evaluate
from ddiloco.learner.config import LearnerConfig
from ddiloco.operator import api, builders, evaluator_workload, tokens
from ddiloco.operator import conditions as c
from ddiloco.operator.metrics import OperatorMetrics
from ddiloco.operator.plan import ClusterView, Observed, SecretView, home
from ddiloco.operator.reconcile import reconcile
from ddiloco.wire.auth import Principal, StaticTokens, authenticate
from tests.unit.test_operator_reconcile import T0, TOKEN, make_job, observe, step
from tests.unit.test_operator_template import env_of

DATA_VOLUME = {"name": "data", "persistentVolumeClaim": {"claimName": "corpus"}}
DATA_MOUNT = {"name": "data", "mountPath": "/data", "readOnly": True}
EVALUATION = {
    "data": "/data/heldout.jsonl",
    "everyVersions": 20,
    "everySeconds": 600,
    "evalBatches": 4,
    "tensorboardDir": "/data/tb",
    "volumes": [DATA_VOLUME],
    "volumeMounts": [DATA_MOUNT],
    "resources": {"requests": {"cpu": "2", "memory": "4Gi"}},
    "nodeSelector": {"pool": "cpu"},
}
TRAINING = {"model": "tiny", "data": "/data/train.jsonl", "batchSize": 4, "seed": 7}


def job_with(evaluation: dict[str, Any] | None = EVALUATION, **spec: Any) -> api.DecoupledDiLoCoJob:
    if evaluation is not None:
        spec["evaluation"] = evaluation
    return make_job(training=TRAINING, **spec)


def container(dep: dict[str, Any]) -> dict[str, Any]:
    (found,) = dep["spec"]["template"]["spec"]["containers"]
    return found


def test_the_deployment_runs_ddiloco_evaluate_with_the_learners_settings() -> None:
    job = job_with()
    assert api.validate(job.spec) == []
    dep = evaluator_workload.build_evaluator_deployment(job)
    assert dep["metadata"]["name"] == "tiny-evaluator"
    assert dep["metadata"]["ownerReferences"][0]["uid"] == "job-1"
    assert dep["metadata"]["labels"][builders.LABEL_JOB_UID] == "job-1"
    assert dep["spec"]["replicas"] == 1 and dep["spec"]["strategy"] == {"type": "Recreate"}
    pod = dep["spec"]["template"]["spec"]
    main = container(dep)
    assert main["command"] == ["ddiloco", "evaluate"]
    # the flags parse as `ddiloco evaluate`'s, and give the learners' model and data settings
    args = evaluate.parse(main["args"])
    evaluate.check(args)
    assert (args.every_versions, args.every_seconds, args.eval_batches) == (20, 600.0, 4)
    assert args.tensorboard == "/data/tb" and args.data == "/data/heldout.jsonl"
    learner = builders.build_learner_pod(job, job.spec.learner_groups[0], 0)
    theirs = LearnerConfig.from_env(
        {k: v for k, v in env_of(learner["spec"]["containers"][0]).items() if isinstance(v, str)}
    )
    ours = LearnerConfig.from_env(
        env_of(main), **{k: getattr(args, k) for k in evaluate.SHARED if getattr(args, k)}
    )
    for field in ("model", "model_entry", "batch_size", "seed", "seq_len", "tokenizer"):
        assert getattr(ours, field) == getattr(theirs, field), field
    assert ours.data == "/data/heldout.jsonl" != theirs.data  # evaluation.data wins
    assert ours.sync_url == theirs.sync_url  # reached as in-cluster learners reach it
    # its own credential, as a mounted file (never the job key, never a learner's)
    env = env_of(main)
    assert env["DDILOCO_TOKEN_FILE"] == f"{builders.TOKEN_DIR}/{builders.TOKEN_KEY}"
    assert "DDILOCO_TOKEN" not in env
    assert set(env) <= set(LearnerConfig.env_names().values())  # each read, as a learner's
    LearnerConfig.from_env(env, strict=True)
    token = next(v for v in pod["volumes"] if v["name"] == "token")
    assert token["secret"]["secretName"] == "tiny-evaluator-token"
    assert {"name": "token", "mountPath": builders.TOKEN_DIR, "readOnly": True} in main[
        "volumeMounts"
    ]
    # the template fields: the data volume and mount, resources, node selector
    assert DATA_VOLUME in pod["volumes"] and DATA_MOUNT in main["volumeMounts"]
    assert main["resources"] == {"requests": {"cpu": "2", "memory": "4Gi"}}
    assert pod["nodeSelector"] == {"pool": "cpu"}
    assert pod["automountServiceAccountToken"] is False


def test_without_evaluation_data_the_training_data_is_measured_and_tls_is_trusted() -> None:
    job = job_with({"everySeconds": 60}, synchronizer={"tls": {"enabled": True}})
    main = container(evaluator_workload.build_evaluator_deployment(job))
    args = evaluate.parse(main["args"])
    assert args.data == "/data/train.jsonl" and args.every_versions == 0
    env = env_of(main)
    assert env["DDILOCO_CA_FILE"] == f"{builders.TRUST_DIR}/{builders.CA_KEY}"
    assert env["DDILOCO_SYNC_URL"].startswith("https://tiny-synchronizer.ns.svc:")
    pod = evaluator_workload.build_evaluator_deployment(job)["spec"]["template"]["spec"]
    trust = next(v for v in pod["volumes"] if v["name"] == "trust")
    assert trust["secret"]["secretName"] == builders.trust_secret_name(job)


@pytest.mark.parametrize(
    ("evaluation", "spec", "needle"),
    [
        ({"everySeconds": 0}, {}, "set evaluation.everyVersions or evaluation.everySeconds"),
        (
            {},
            {"synchronizer": {"tls": {"enabled": True, "mutual": True}}},
            "not available with synchronizer.tls.mutual",
        ),
        (
            {"env": [{"name": "DDILOCO_TOKEN", "value": "x"}]},
            {},
            "evaluation.env[0]: env DDILOCO_TOKEN",
        ),
    ],
)
def test_bad_evaluation_specs_are_refused_by_name(
    evaluation: dict[str, Any], spec: dict[str, Any], needle: str
) -> None:
    job = job_with(evaluation, **spec)
    problems = api.validate(job.spec)
    assert any(needle in p for p in problems), problems
    plan = reconcile(job, observe(job), fresh_token="fresh")
    assert plan.status is not None and plan.status.phase == "Invalid"
    assert not plan.actions


def secret(job: api.DecoupledDiLoCoJob, keys: list[str]) -> SecretView:
    return SecretView(
        data={builders.TOKEN_KEY: evaluator_workload.credential(job, keys)}, job_uid=job.uid
    )


def with_home(obs: Observed, job: api.DecoupledDiLoCoJob, **secrets: SecretView) -> Observed:
    view = obs.clusters[home(job)]
    view = dataclasses.replace(view, secrets={**view.secrets, **secrets})
    return dataclasses.replace(obs, clusters={**obs.clusters, home(job): view})


def evaluator_actions(plan: Any) -> list[tuple[str, str, str]]:
    return [
        (a.verb, a.kind, a.name)
        for a in plan.actions
        if a.name in ("tiny-evaluator", "tiny-evaluator-token")
    ]


def test_reconcile_creates_updates_and_removes_the_evaluator() -> None:
    job = job_with()
    _, plan = step(job, observe(job))
    assert evaluator_actions(plan) == [
        ("create", "Secret", "tiny-evaluator-token"),
        ("create", "Deployment", "tiny-evaluator"),
    ]
    body = next(a.body for a in plan.actions if a.name == "tiny-evaluator-token")
    assert body is not None and body["metadata"]["ownerReferences"][0]["uid"] == "job-1"
    line = base64.b64decode(body["data"][builders.TOKEN_KEY]).decode()
    # least privilege: the credential is an evaluator's, derived from the job key
    who = authenticate(f"Bearer {line}", StaticTokens(TOKEN))
    assert who == Principal("evaluator", "tiny-evaluator")
    assert who.evaluates() and not who.trains()
    # both there as built: nothing to do
    dep = evaluator_workload.build_evaluator_deployment(job)
    done = with_home(observe(job), job, **{"tiny-evaluator-token": secret(job, [TOKEN])})
    done = dataclasses.replace(done, evaluator=dep)
    assert evaluator_actions(reconcile(job, done, fresh_token="fresh")) == []
    # a changed schedule replaces the Deployment; a suspend scales it to 0
    changed = job_with({**EVALUATION, "everyVersions": 5})
    plan = reconcile(changed, dataclasses.replace(done), fresh_token="fresh")
    assert evaluator_actions(plan) == [("replace", "Deployment", "tiny-evaluator")]
    suspended = job_with(suspend=True)
    plan = reconcile(suspended, done, fresh_token="fresh")
    (replace,) = [a for a in plan.actions if a.name == "tiny-evaluator"]
    assert replace.body is not None and replace.body["spec"]["replicas"] == 0
    # dropping spec.evaluation deletes both (the job's own only)
    dep["metadata"]["uid"] = "dep-uid"
    plain = job_with(None)
    plan = reconcile(plain, dataclasses.replace(done, evaluator=dep), fresh_token="fresh")
    assert evaluator_actions(plan) == [
        ("delete", "Deployment", "tiny-evaluator"),
        ("delete", "Secret", "tiny-evaluator-token"),
    ]
    assert next(a for a in plan.actions if a.kind == "Deployment").uid == "dep-uid"
    theirs = with_home(
        observe(plain),
        plain,
        **{"tiny-evaluator-token": SecretView(data={}, job_uid="another-job")},
    )
    assert evaluator_actions(reconcile(plain, theirs, fresh_token="fresh")) == []


def test_a_key_rotation_waits_for_the_evaluators_credential() -> None:
    job = job_with()
    keys = ["new", TOKEN]
    # a rotation under way, its grace over; every group's credentials hold both keys
    notes = {tokens.ANNOTATION_ROTATION: "1", tokens.ANNOTATION_ROTATED_AT: "2020-01-01T00:00:00Z"}
    obs = observe(job)
    clusters = {}
    for tgt, view in obs.clusters.items():
        found = dict(view.secrets)
        for group in job.spec.learner_groups:
            name = builders.learner_tokens_secret_name(job, group.name)
            if name in found:
                found[name] = SecretView(
                    data=tokens.credentials(job, group, view, keys), job_uid=job.uid
                )
        if tgt == home(job):
            found[builders.token_secret_name(job)] = SecretView(job_uid=job.uid, annotations=notes)
            view = dataclasses.replace(view, token="new\n" + TOKEN)
        clusters[tgt] = dataclasses.replace(view, secrets=found)
    obs = dataclasses.replace(obs, clusters=clusters)
    held = tokens.token_plan(job, obs, "fresh")
    assert held.action is None and held.token == "new\n" + TOKEN  # the old key stays
    obs = with_home(obs, job, **{"tiny-evaluator-token": secret(job, keys)})
    done = tokens.token_plan(job, obs, "fresh")
    assert done.action is not None and done.token == "new"  # now it goes
    assert evaluator_workload.caught_up(job_with(None), ClusterView(), ["new"])


def evaluation(**over: Any) -> dict[str, Any]:
    e = {
        "loss": 2.345678,
        "perplexity": math.exp(2.345678),
        "global_version": 42,
        "tokens": 4096,
        "time": 1_800_000_000.0,
        "evaluator": "tiny-evaluator",
    }
    return {**e, **over}


def test_the_synchronizers_evaluation_reaches_the_job_status() -> None:
    job = job_with()
    job, _ = step(job, observe(job, sync={"global_version": 50, "evaluation": evaluation()}))
    e = job.status.evaluation
    assert e == api.EvaluationStatus(
        loss=2.346, perplexity=10.44, global_version=42, time="2027-01-15T08:00:00Z"
    )
    # the synchronizer away, or no evaluation in its answer: the last one stands
    job, _ = step(job, observe(job, sync=None))
    assert job.status.evaluation == e
    job, _ = step(job, observe(job, sync={"global_version": 51}))
    assert job.status.evaluation == e
    # a non-finite one is left out, and said so
    job, _ = step(
        job, observe(job, sync={"global_version": 52, "evaluation": evaluation(loss=math.nan)})
    )
    assert job.status.evaluation == e
    degraded = c.get(job.status.conditions, c.DEGRADED)
    assert degraded is not None and "evaluation" in degraded.message
    # the operator's own gauge follows the status it wrote
    metrics = OperatorMetrics()
    metrics.after_pass(job, job.status, None, observe(job), now=T0.timestamp())
    assert metrics.registry.get_sample_value(
        "ddiloco_operator_job_eval_loss", {"namespace": "ns", "job": "tiny"}
    ) == pytest.approx(2.346)
