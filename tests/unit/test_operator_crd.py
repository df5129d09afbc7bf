"""The DecoupledDiLoCoJob models and the CRD rendered from them (ddiloco.operator.api, .crd).

    .venv/bin/pytest tests/unit/test_operator_crd.py

The drift test fails when deploy/crds/ no longer matches the models: run
`python -m ddiloco.operator.crd` and commit the result.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml

from ddiloco.operator import api, crd
from ddiloco.synchronizer.config import SyncSettings

EXAMPLES = Path(__file__).resolve().parents[2] / "deploy" / "examples"


def minimal(**spec: Any) -> dict[str, Any]:
    body = {
        "apiVersion": api.API_VERSION,
        "kind": api.KIND,
        "metadata": {"name": "tiny", "namespace": "default", "uid": "u1", "generation": 1},
        "spec": {
            "image": "ddiloco:dev",
            "training": {"model": "tiny"},
            "learnerGroups": [{"name": "a", "replicas": 2}],
        },
    }
    body["spec"].update(spec)
    return body


def test_committed_crd_matches_the_models() -> None:
    assert crd.CRD_PATH.read_text() == crd.render(), (
        "deploy/crds is stale: run `python -m ddiloco.operator.crd` and commit it"
    )


def _walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    out = []
    if isinstance(node, dict):
        out.append((path, node))
        for key, sub in (node.get("properties") or {}).items():
            out += _walk(sub, f"{path}.{key}")
        if isinstance(node.get("items"), dict):
            out += _walk(node["items"], f"{path}[]")
        if isinstance(node.get("additionalProperties"), dict):
            out += _walk(node["additionalProperties"], f"{path}{{}}")
    return out


def test_schema_is_structural() -> None:
    schema = crd.openapi_schema()
    for path, node in _walk(schema):
        assert not {"$ref", "$defs", "anyOf", "title"} & node.keys(), path
        assert "type" in node or node.get("x-kubernetes-int-or-string"), f"untyped node {path}"
        if "properties" in node:
            assert "additionalProperties" not in node, path
        for bound in ("exclusiveMinimum", "exclusiveMaximum"):
            if bound in node:
                assert node[bound] is True, path  # OpenAPI v3.0 booleans, not 2020-12 numbers
        if node.get("type") == "object" and "default" in node and "properties" in node:
            assert node["default"] == {}, path


def test_crd_has_names_columns_status_and_rules() -> None:
    doc = crd.crd()
    spec = doc["spec"]
    assert spec["names"]["shortNames"] == ["ddj"] and spec["scope"] == "Namespaced"
    version = spec["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert [c["name"] for c in version["additionalPrinterColumns"]] == [
        "Phase",
        "Ready",
        "Desired",
        "Version",
        "Goodput",
        "Merged",
        "Live",
        "Progress",
        "Remaining",
        "Eval Loss",
        "Age",
    ]
    props = version["schema"]["openAPIV3Schema"]["properties"]
    rules = [r["rule"] for r in props["spec"]["x-kubernetes-validations"]]
    assert any("quorum" in r and ".sum()" in r for r in rules)
    training_rules = [
        r["rule"] for r in props["spec"]["properties"]["training"]["x-kubernetes-validations"]
    ]
    assert "self.innerSteps % self.fragments == 0" in training_rules
    assert "!has(self.modelEntry) || !has(self.data)" in training_rules
    groups = props["spec"]["properties"]["learnerGroups"]
    assert groups["x-kubernetes-list-type"] == "map" and groups["maxItems"] == api.MAX_GROUPS
    assert (
        props["spec"]["properties"]["learnerGroups"]["items"]["properties"]["replicas"]["minimum"]
        == 0
    )
    # optional fields are nullable; required ones are listed
    assert props["spec"]["properties"]["managedBy"]["nullable"] is True
    assert set(props["spec"]["required"]) == {"image", "training", "learnerGroups"}


def test_defaults_in_schema_match_the_models() -> None:
    props = crd.openapi_schema()["properties"]["spec"]["properties"]
    sync = props["synchronizer"]["properties"]
    assert sync["quorum"]["default"] == api.Synchronizer().quorum
    assert sync["merge"]["default"] == "rda"
    # the product's default is the synchronizer's (the quality study's winner)
    assert sync["mergeScale"]["default"] == SyncSettings.model_fields["merge_scale"].default
    assert sync["mergeScale"]["enum"] == ["live", "contributors"]
    assert (
        props["failurePolicy"]["properties"]["maxReplacementsPerSlot"]["default"]
        == api.FailurePolicy().max_replacements_per_slot
    )


def test_minimal_job_parses_with_defaults() -> None:
    job = api.DecoupledDiLoCoJob.from_body(minimal())
    assert job.spec.synchronizer.quorum == 1 and job.spec.failure_policy.backoff_seconds == 1.0
    assert job.spec.total_replicas() == 2 and job.is_ours()
    assert api.validate(job.spec) == []


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"synchronizer": {"quorum": 3}}, "quorum"),
        ({"training": {"model": "tiny", "innerSteps": 10, "fragments": 4}}, "multiple"),
        ({"training": {"model": "tiny", "modelEntry": "a.b:c"}}, "exactly one"),
        ({"training": {}}, "exactly one"),
        # a model entry loads its own data (learner/task.py): training.data would change nothing
        ({"training": {"modelEntry": "a.b:c", "data": "/data/x.bin"}}, "training.data"),
        ({"training": {"model": "tiny", "schedule": {"decay": "wsd"}}}, "decays over a budget"),
        ({"training": {"modelEntry": "a.b:c", "sequenceLength": 9}}, "training.sequenceLength"),
        (
            {
                "learnerGroups": [
                    {"name": "a", "replicas": 2, "cluster": {"kubeconfigSecret": {"name": "k"}}}
                ]
            },
            "syncUrl",
        ),
    ],
)
def test_validate_repeats_the_cel_rules(spec: dict[str, Any], needle: str) -> None:
    job = api.DecoupledDiLoCoJob.from_body(minimal(**spec))
    problems = api.validate(job.spec)
    assert problems and needle in problems[0]


@pytest.mark.parametrize(
    "spec",
    [
        {"image": ""},
        {"learnerGroups": [{"name": "a", "replicas": -1}]},
        {"learnerGroups": [{"name": "A_bad"}]},
        {"learnerGroups": []},
        {"bogus": 1},
    ],
)
def test_models_refuse_what_the_schema_refuses(spec: dict[str, Any]) -> None:
    with pytest.raises(pydantic.ValidationError):
        api.DecoupledDiLoCoJob.from_body(minimal(**spec))


def test_status_from_another_version_does_not_break_parsing() -> None:
    body = minimal()
    body["status"] = {"phase": "Running", "someOldField": 1, "groups": [{"bad": True}]}
    job = api.DecoupledDiLoCoJob.from_body(body)
    assert job.status == api.JobStatus()


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_are_valid_jobs(path: Path) -> None:
    docs = [d for d in yaml.safe_load_all(path.read_text()) if d and d.get("kind") == api.KIND]
    assert docs, f"{path} holds no {api.KIND}"
    for doc in docs:
        doc["metadata"].setdefault("namespace", "default")
        job = api.DecoupledDiLoCoJob.from_body(doc)
        assert api.validate(job.spec) == [], path
        assert len(job.name) <= api.MAX_JOB_NAME


def test_the_operator_never_imports_torch() -> None:
    # The operator image stays small: no torch, however the operator is started.
    code = (
        "import sys, ddiloco.operator.handlers, ddiloco.operator.cli, ddiloco.operator.crd; "
        "sys.exit('torch' in sys.modules)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr or "torch was imported"
