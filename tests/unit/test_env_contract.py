"""The operator's pod env and the learner's and synchronizer's settings are one contract.

    .venv/bin/pytest tests/unit/test_env_contract.py

Pods are built with the operator's own builders (ddiloco.operator.builders) from jobs that set
every optional knob, or none, or a model entry. Each container's env (its token resolved
through the Secret the operator builds) is then read the way its command reads it: `ddiloco
learner` through learner/cli.py into LearnerConfig, strictly; `ddiloco synchronizer` into
SyncSettings. A test fails on a DDILOCO_* name the receiving side does not read, and on a
value that comes out other than the job meant (H, P, tau, K, eta, the merge rule, ...).
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path
from typing import Any

import pytest

from ddiloco.cli.main import SUBCOMMANDS
from ddiloco.learner.config import READ_ELSEWHERE, LearnerConfig
from ddiloco.operator import api, builders, sync_workload
from ddiloco.synchronizer.config import SyncSettings, TuningSettings

TOKEN = "contract-token-0123456789"
PREFIX = "DDILOCO_"
REMOTE_URL = "https://sync.contract.example.com:8470"

# DDILOCO_* names a synchronizer pod may carry that SyncSettings does not read, with their
# reader (the learner's counterpart is READ_ELSEWHERE in learner/config.py).
SYNC_READ_ELSEWHERE = {
    "DDILOCO_LOG_LEVEL": "`ddiloco synchronizer` (synchronizer/server.py): default of --log-level",
}

# Every optional knob set, to values none of which is a default of the receiving side, so an
# env var that is missing or not read cannot pass for one that is.
FULL: dict[str, Any] = {
    "image": "registry.example.com/ddiloco:contract",
    "imagePullPolicy": "Always",
    "training": {
        "model": "small",
        "data": "/data/corpus.bin",
        "innerSteps": 48,
        "fragments": 8,
        "overlapSteps": 3,
        "tokenizer": "/models/tokenizer",
        "dataField": "content",
        "sequenceLength": 96,
        "batchSize": 12,
        "gradientAccumulation": 4,
        "precision": "bf16",
        "parallel": "fsdp2",
        "seed": 7,
        "innerOptimizer": {
            "learningRate": 0.00025,
            "weightDecay": 0.05,
            "beta1": 0.85,
            "beta2": 0.99,
            "gradientClip": 0.5,
        },
        "schedule": {"warmupSteps": 300, "decay": "wsd", "decayFraction": 0.3, "minRatio": 0.05},
        "maxSteps": 5000,
        "maxTokens": 10_000_000_000,
        "maxSeconds": 7200.5,
        "initFrom": "/models/start",
        "totalTokens": 20_000_000_000,
    },
    "synchronizer": {
        "quorum": 3,
        "graceGamma": 0.3,
        "graceCapSteps": 1.5,
        "merge": "mean",
        "mergeScale": "contributors",
        "outerLearningRate": 0.8,
        "outerMomentum": 0.6,
        "maxStaleness": 7,
        "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
        "storage": {"size": "20Gi", "storageClassName": "fast"},
    },
    "learnerGroups": [
        {
            "name": "home",
            "replicas": 2,
            "gpusPerLearner": 2,
            "resources": {"requests": {"cpu": "16", "memory": "96Gi"}},
            "terminationGracePeriodSeconds": 120,
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [{"key": "nvidia.com/gpu", "operator": "Exists"}],
            "priorityClassName": "low",
        },
        {"name": "empty", "replicas": 0},
        {
            "name": "region-a",
            "replicas": 3,
            "cluster": {
                "kubeconfigSecret": {"name": "region-a-kubeconfig", "key": "config"},
                "namespace": "ml",
            },
            "syncUrl": REMOTE_URL,
            "gpusPerLearner": 8,
            "terminationGracePeriodSeconds": 15,
        },
    ],
    "failurePolicy": {"maxReplacementsPerSlot": 3, "backoffSeconds": 2, "maxBackoffSeconds": 60},
    "updateEncoding": "int8",
    "broadcastEncoding": "int4-delta",
    "managedBy": api.MANAGED_BY_US,
}
MINIMAL: dict[str, Any] = {
    "image": "ddiloco:dev",
    "training": {"model": "tiny"},
    "learnerGroups": [{"name": "a", "replicas": 2}],
}
ENTRY: dict[str, Any] = {
    **MINIMAL,
    "training": {"modelEntry": "ddiloco.learner.examples:char_mlp", "innerSteps": 12},
}
SPECS = {"full": FULL, "minimal": MINIMAL, "model-entry": ENTRY}


def _or(value: float | None, default: float) -> float:
    return default if value is None else value


def make_job(spec: dict[str, Any]) -> api.DecoupledDiLoCoJob:
    body = {"metadata": {"name": "contract", "namespace": "team-a", "uid": "u-1"}, "spec": spec}
    job = api.DecoupledDiLoCoJob.from_body(body)
    assert api.validate(job.spec) == [], "the test's job must be one the apiserver admits"
    return job


@pytest.fixture(params=sorted(SPECS), ids=sorted(SPECS))
def job(request: pytest.FixtureRequest) -> api.DecoupledDiLoCoJob:
    return make_job(SPECS[request.param])


def learner_pods(job: api.DecoupledDiLoCoJob) -> list[tuple[api.LearnerGroup, int, dict]]:
    return [
        (g, i, builders.build_learner_pod(job, g, i))
        for g in job.spec.learner_groups
        for i in range(g.replicas)
    ]


def sync_container(job: api.DecoupledDiLoCoJob) -> dict[str, Any]:
    (container,) = sync_workload.build_synchronizer_statefulset(job)["spec"]["template"]["spec"][
        "containers"
    ]
    return container


MOUNT_ROOT: list[Path] = []  # where mounted Secrets are materialized (the autouse fixture)


@pytest.fixture(autouse=True)
def _mount_root(tmp_path: Path) -> Any:
    MOUNT_ROOT[:] = [tmp_path / "mounts"]
    yield
    MOUNT_ROOT.clear()


def mounted(path: str) -> str:
    """Where a file under a container's Secret mount lies in this test (written if the token)."""
    return str(MOUNT_ROOT[0]) + path


def container_env(
    job: api.DecoupledDiLoCoJob, container: dict[str, Any], pod_index: int = 0
) -> dict[str, str]:
    """name -> value as the process sees it; secret refs resolved through the operator's Secret,
    the StatefulSet's pod-index label (DDILOCO_SHARD) as `pod_index`, and the token Secret's
    mounted file written where the *_FILE variables point."""
    secrets = {builders.token_secret_name(job): builders.build_token_secret(job, TOKEN)}
    mounts = [m["mountPath"] for m in container.get("volumeMounts", [])]
    token_dir = Path(mounted(builders.TOKEN_DIR))
    token_dir.mkdir(parents=True, exist_ok=True)
    (token_dir / builders.TOKEN_KEY).write_text(TOKEN)
    env: dict[str, str] = {}
    for var in container["env"]:
        assert var["name"] not in env, f"{var['name']} is set twice"
        assert set(var) in ({"name", "value"}, {"name", "valueFrom"}), var
        if "value" in var:
            assert isinstance(var["value"], str), var  # the API wants strings
            env[var["name"]] = var["value"]
            if var["name"].endswith("_FILE"):  # a file of a mounted Secret, never a subPath
                assert any(var["value"].startswith(m + "/") for m in mounts), var
                env[var["name"]] = mounted(var["value"])
            continue
        if "fieldRef" in var["valueFrom"]:  # the downward API: only the pod-index label
            path = var["valueFrom"]["fieldRef"]["fieldPath"]
            assert path == f"metadata.labels['{builders.LABEL_POD_INDEX}']", var
            env[var["name"]] = str(pod_index)
            continue
        ref = var["valueFrom"]["secretKeyRef"]
        value = builders.secret_token(secrets[ref["name"]]) if ref["key"] == "token" else None
        assert value is not None, f"{var['name']} refers to {ref}, which the operator never writes"
        env[var["name"]] = value
    return env


def command_module(container: dict[str, Any]) -> Any:
    """The module `ddiloco <subcommand>` runs (cli/main.py), for the container's command."""
    command = container["command"]
    assert command[0] == "ddiloco" and len(command) == 2, command
    return importlib.import_module(SUBCOMMANDS[command[1]][0])


def learner_config(job: api.DecoupledDiLoCoJob, pod: dict[str, Any]) -> LearnerConfig:
    (container,) = pod["spec"]["containers"]
    cli = command_module(container)
    assert cli.__name__ == "ddiloco.learner.cli"
    args = cli.parse(container.get("args", []))
    return cli.build_config(args, environ=container_env(job, container), strict=True)


def sync_env_names() -> dict[str, str]:
    """Field -> the variable pydantic-settings reads it from (env_prefix + name, or an alias),
    for the method's settings and the tuning knobs (`SyncSettings.tuning`) alike."""
    out = {}
    for group in (SyncSettings, TuningSettings):
        prefix = group.model_config.get("env_prefix", "")
        for name, f in group.model_fields.items():
            if group is SyncSettings and name == "tuning":
                continue  # read as its own fields' names
            alias = f.validation_alias or f.alias
            out[name] = (alias if isinstance(alias, str) else prefix + name).upper()
    return out


def sync_settings(
    monkeypatch: pytest.MonkeyPatch, job: api.DecoupledDiLoCoJob, pod_index: int = 0
) -> tuple[SyncSettings, dict[str, Any]]:
    container = sync_container(job)
    server = command_module(container)
    assert server.__name__ == "ddiloco.synchronizer.server"
    # server.main turns these flags into overrides; the pod must not need any
    args = vars(server.parse(container.get("args", [])))
    assert [k for k, v in args.items() if v not in (None, False) and k != "log_level"] == []
    for name in [k for k in os.environ if k.upper().startswith(PREFIX)]:
        monkeypatch.delenv(name)
    for name, value in container_env(job, container, pod_index).items():
        monkeypatch.setenv(name, value)
    return SyncSettings(_env_file=None), container  # type: ignore[call-arg]


# ---- names ---------------------------------------------------------------------------------


def test_every_name_a_learner_pod_carries_is_read(job: api.DecoupledDiLoCoJob) -> None:
    read = set(LearnerConfig.env_names().values()) | set(READ_ELSEWHERE)
    for _, _, pod in learner_pods(job):
        (container,) = pod["spec"]["containers"]
        names = {v["name"] for v in container["env"] if v["name"].startswith(PREFIX)}
        assert names - read == set(), pod["metadata"]["name"]
        learner_config(job, pod)  # strict: would raise naming any unread DDILOCO_* name


def test_every_name_the_synchronizer_pod_carries_is_read(job: api.DecoupledDiLoCoJob) -> None:
    read = set(sync_env_names().values()) | set(SYNC_READ_ELSEWHERE)
    names = {v["name"] for v in sync_container(job)["env"] if v["name"].startswith(PREFIX)}
    assert names - read == set()


def test_the_strict_learner_refuses_a_name_nothing_reads() -> None:
    # what the name check above catches: e.g. the CRD's spelling instead of the learner's
    job = make_job(FULL)
    (container,) = learner_pods(job)[0][2]["spec"]["containers"]
    env = container_env(job, container) | {"DDILOCO_INNER_STEPS": "48"}
    with pytest.raises(ValueError, match="DDILOCO_INNER_STEPS"):
        LearnerConfig.from_env(env, strict=True)
    assert LearnerConfig.from_env(env).h == 48  # not strict: read from DDILOCO_H, the rest ignored


def test_the_names_read_elsewhere_are_read_there(monkeypatch: pytest.MonkeyPatch) -> None:
    from ddiloco.learner import cli
    from ddiloco.synchronizer import server

    assert set(READ_ELSEWHERE) == set(SYNC_READ_ELSEWHERE) == {"DDILOCO_LOG_LEVEL"}
    monkeypatch.setenv("DDILOCO_LOG_LEVEL", "DEBUG")
    assert cli.parse([]).log_level == "DEBUG"
    assert server.parse([]).log_level == "DEBUG"
    # and no LearnerConfig or SyncSettings field claims them too
    assert not set(READ_ELSEWHERE) & set(LearnerConfig.env_names().values())
    assert not set(SYNC_READ_ELSEWHERE) & set(sync_env_names().values())


def test_the_tuning_knobs_are_read_apart_from_the_methods_settings(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Each performance knob from its own DDILOCO_ name into `SyncSettings.tuning`, none of
    them a field of the method's settings; one given by name (the CLI's flags) lands there
    too, the others still from the environment, and their rule still holds."""
    for name in [k for k in os.environ if k.upper().startswith(PREFIX)]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DDILOCO_TOKEN", TOKEN)
    values = {"cpu_slots": 3, "merge_first": False, "prime_buffers": False, "snapshot_lag": 6,
              "snapshot_every": 2, "torch_threads": 5, "merge_threads": 7}  # fmt: skip
    assert set(values) == set(TuningSettings.model_fields)
    assert not set(values) & set(SyncSettings.model_fields)
    for name, value in values.items():
        monkeypatch.setenv(PREFIX + name.upper(), str(int(value)))
    settings = SyncSettings(_env_file=None)  # type: ignore[call-arg]
    assert settings.tuning.model_dump() == values
    given = SyncSettings(_env_file=None, snapshot_lag=0)  # type: ignore[call-arg]
    assert given.tuning.model_dump() == values | {"snapshot_lag": 0}
    with pytest.raises(ValueError, match="DDILOCO_SNAPSHOT_EVERY=2 exceeds"):
        SyncSettings(_env_file=None, snapshot_lag=1)  # type: ignore[call-arg]


# ---- values --------------------------------------------------------------------------------


def expected_learner(
    job: api.DecoupledDiLoCoJob, group: api.LearnerGroup, index: int
) -> dict[str, Any]:
    """What the operator means for a learner slot, from the job alone (not from the builders)."""
    t, default = job.spec.training, LearnerConfig()
    svc = sync_workload.build_synchronizer_service(job)
    scheme = "https" if job.spec.synchronizer.tls.enabled else "http"  # TLS is on by default
    in_cluster = (
        f"{scheme}://{svc['metadata']['name']}.{job.namespace}.svc:"
        f"{svc['spec']['ports'][0]['port']}"
    )
    url = group.sync_url or in_cluster
    out = {
        "token_file": mounted(f"{builders.TOKEN_DIR}/{builders.TOKEN_KEY}"),
        "sync_url": url,
        # an https synchronizer of this job is verified against the job's CA (a mounted Secret)
        "ca_file": mounted(f"{builders.TRUST_DIR}/{builders.CA_KEY}")
        if url.startswith("https://") and job.spec.synchronizer.tls.enabled
        else None,
        "learner_id": f"{group.name}-{index}",
        "num_learners": sum(g.replicas for g in job.spec.learner_groups),
        "model_entry": t.model_entry,
        "data": t.data,
        "init_from": t.init_from,
        "h": t.inner_steps,
        "num_fragments": t.fragments,
        "tokenizer": t.tokenizer,
        "data_field": t.data_field or default.data_field,
        "seq_len": t.sequence_length,
        "batch_size": t.batch_size or default.batch_size,
        "grad_accum": t.gradient_accumulation,
        "precision": t.precision,
        "parallel": t.parallel,
        "seed": default.seed if t.seed is None else t.seed,
        "inner_lr": t.inner_optimizer.learning_rate or default.inner_lr,
        "weight_decay": _or(t.inner_optimizer.weight_decay, default.weight_decay),
        "beta1": _or(t.inner_optimizer.beta1, default.beta1),
        "beta2": _or(t.inner_optimizer.beta2, default.beta2),
        "grad_clip": _or(t.inner_optimizer.gradient_clip, default.grad_clip),
        "warmup_steps": t.schedule.warmup_steps or default.warmup_steps,
        "lr_schedule": t.schedule.decay,
        "decay_fraction": _or(t.schedule.decay_fraction, default.decay_fraction),
        "min_lr_ratio": _or(t.schedule.min_ratio, default.min_lr_ratio),
        "max_steps": t.max_steps or 0,
        "max_tokens": t.max_tokens or 0,
        "max_seconds": t.max_seconds or 0.0,
        "nproc_per_node": group.gpus_per_learner or 1,  # one rank per GPU
        "metrics_port": builders.LEARNER_METRICS_PORT,  # the pod's port named "metrics"
        "update_encoding": job.spec.update_encoding,
    }
    if t.model is not None:  # with a model entry the preset is not used (learner/task.py)
        out["model"] = t.model
    return out


def test_each_learner_reads_what_the_operator_meant(job: api.DecoupledDiLoCoJob) -> None:
    indices = []
    for group, index, pod in learner_pods(job):
        cfg = learner_config(job, pod)
        want = expected_learner(job, group, index)
        got = {k: getattr(cfg, k) for k in want}
        assert got == want, pod["metadata"]["name"]
        assert cfg.token_source().current() == TOKEN  # read from the mounted Secret
        assert [type(got[k]) for k in want] == [type(want[k]) for k in want]
        assert cfg.learner_id == pod["metadata"]["labels"][builders.LABEL_LEARNER_ID]
        (metrics,) = pod["spec"]["containers"][0]["ports"]  # what a PodMonitor scrapes
        assert (metrics["name"], metrics["containerPort"]) == ("metrics", cfg.metrics_port)
        # the SIGTERM flush waits at most drain_s: it must end before the kubelet's SIGKILL
        grace = pod["spec"]["terminationGracePeriodSeconds"]
        assert grace == group.termination_grace_period_seconds
        assert grace / 2 <= cfg.drain_s <= grace - 5, (grace, cfg.drain_s)
        indices.append(cfg.learner_index)
    # data parts: every slot its own, none left out
    assert indices == list(range(job.spec.total_replicas()))


def test_the_synchronizer_reads_what_the_operator_meant(
    monkeypatch: pytest.MonkeyPatch, job: api.DecoupledDiLoCoJob
) -> None:
    settings, container = sync_settings(monkeypatch, job)
    sync, t = job.spec.synchronizer, job.spec.training
    ports = {p["name"]: p for p in container["ports"]}
    assert sorted(ports) == ["http", "upload"]
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "state"]
    want = {
        "host": "0.0.0.0",
        "port": ports["http"]["containerPort"],
        "upload_port": ports["upload"]["containerPort"],  # the upload listener is on
        "state_dir": Path(mount["mountPath"]),
        "quorum": sync.quorum,
        "grace_gamma": sync.grace_gamma,
        "grace_cap_steps": sync.grace_cap_steps,
        "merge": sync.merge,
        "merge_scale": sync.merge_scale,
        "outer_lr": sync.outer_learning_rate,
        "outer_momentum": sync.outer_momentum,
        "max_staleness": sync.max_staleness,
        "tau": t.overlap_steps,
        "counter_cap_steps": 4 * t.inner_steps,  # docs/design.md: "counters capped at 4H"
        "shard": 0,
        "shards": sync.shards,
        "update_encodings": [job.spec.update_encoding],  # only the job's encoding
        "broadcast_encoding": job.spec.broadcast_encoding,
        "total_tokens": t.total_tokens,
    }
    assert {k: getattr(settings, k) for k in want} == want
    assert settings.bearer_token() == TOKEN
    # both Services send each of their ports to the container port the synchronizer serves it on
    for build in (sync_workload.build_synchronizer_service, sync_workload.build_shards_service):
        svc = {p["name"]: p for p in build(job)["spec"]["ports"]}
        got = {name: (p["targetPort"], p["port"]) for name, p in svc.items()}
        assert got == {"http": ("http", settings.port), "upload": ("upload", settings.upload_port)}


def test_the_jobs_set_no_value_to_a_default() -> None:
    # the value tests above prove a knob travels only where its value is not also the
    # receiving side's default. FULL sets every knob but modelEntry (exclusive with model):
    # ENTRY sets that one.
    full = make_job(FULL)
    last = full.spec.learner_groups[-1]
    want = expected_learner(full, last, last.replicas - 1)
    want["model_entry"] = make_job(ENTRY).spec.training.model_entry
    default = LearnerConfig()
    for field, value in want.items():
        assert getattr(default, field) != value, field
    assert default.drain_s != learner_config(full, learner_pods(full)[-1][2]).drain_s
    job = make_job(FULL)
    sync_default = {k: f.default for k, f in SyncSettings.model_fields.items()}
    spec_sync = job.spec.synchronizer.model_dump(
        exclude={
            "resources",
            "storage",
            "tls",
            "external_names",
            "token_rotation_grace_seconds",
            "shards",  # test_a_sharded_job_tells_each_shard_its_place checks S > 1
            *api.PodTemplate.model_fields,  # merged into the pod, not read as settings
        }
    )  # TLS reaches the synchronizer as files (test_operator_tls.py checks those)
    renamed = {"outer_learning_rate": "outer_lr"}
    for field, value in spec_sync.items():
        assert sync_default[renamed.get(field, field)] != value, field
    assert sync_default["tau"] != job.spec.training.overlap_steps
    assert sync_default["counter_cap_steps"] != 4 * job.spec.training.inner_steps


def test_the_jobs_here_make_the_builders_emit_every_name(monkeypatch: pytest.MonkeyPatch) -> None:
    # a name the builders drop when its value is None (an unset optional field) must still be
    # set by one of the jobs above, or the name and value checks never see it
    offered: dict[str, set[bool]] = {}
    real = builders._env

    def spy(pairs: dict[str, Any]) -> list[dict[str, Any]]:
        for name, value in pairs.items():
            offered.setdefault(name, set()).add(value is not None)
        return real(pairs)

    monkeypatch.setattr(builders, "_env", spy)
    monkeypatch.setattr(sync_workload, "_env", spy)  # the synchronizer's builder (its seam)
    for spec in SPECS.values():
        job = make_job(spec)
        learner_pods(job)
        sync_container(job)
    assert "DDILOCO_MODEL_ENTRY" in offered and "DDILOCO_COUNTER_CAP_STEPS" in offered
    assert sorted(name for name, seen in offered.items() if True not in seen) == []


def test_the_counter_cap_follows_h(monkeypatch: pytest.MonkeyPatch) -> None:
    # Without DDILOCO_COUNTER_CAP_STEPS the synchronizer caps every contribution at 96 steps
    # (4H for H = 24 only): with H = 200 each ordinary hand-over would claim less than it did.
    caps = {}
    for h in (24, 200):
        spec = {**MINIMAL, "training": {"model": "tiny", "innerSteps": h, "fragments": 4}}
        caps[h] = sync_settings(monkeypatch, make_job(spec))[0].counter_cap_steps
    assert caps == {24: 96, 200: 800}


def test_the_builders_emit_only_strings_the_receivers_round_trip() -> None:
    # str() of a float must parse back to the same float on both sides (no rounding on the way)
    spec = {
        **FULL,
        "training": {
            **FULL["training"],
            "innerOptimizer": {"learningRate": 1 / 3},
            "maxSeconds": 1e-3,
        },
    }
    job = make_job(spec)
    cfg = learner_config(job, learner_pods(job)[0][2])
    assert (cfg.inner_lr, cfg.max_seconds) == (1 / 3, 1e-3)


def test_a_sharded_job_tells_each_shard_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # S = 3: shard i reads i from its pod-index label, and every learner gets the 3 shards'
    # headless names in shard order, each a name in the synchronizer's certificate
    job = make_job({**MINIMAL, "synchronizer": {"shards": 3}})
    for i in range(3):
        settings, _ = sync_settings(monkeypatch, job, pod_index=i)
        assert (settings.shard, settings.shards) == (i, 3)
    cfg = learner_config(job, learner_pods(job)[0][2])
    sync = builders.synchronizer_name(job)
    want = [f"https://{sync}-{i}.{sync}-shards.team-a.svc:{builders.SYNC_PORT}" for i in range(3)]
    assert cfg.sync_urls == want
    hosts = {u.split("//")[1].split(":")[0] for u in want}
    assert hosts <= set(builders.service_dns_names(job))
    assert cfg.ca_file is not None  # https: verified against the job's CA
