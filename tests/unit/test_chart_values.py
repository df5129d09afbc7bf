"""The chart's generated files are fresh, and values.yaml is documented and strict, without helm.

    .venv/bin/pytest tests/unit/test_chart_values.py

helm itself (lint, template, install, the schema refusing a typo) is exercised in
tests/integration/test_chart_render.py and test_chart_install.py.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from ddiloco.operator import crd

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "charts" / "ddiloco"


def _load_generator() -> Any:
    """charts/hack/generate.py is a script, not a package: load it by path."""
    if "chart_generate" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "chart_generate", REPO / "charts" / "hack" / "generate.py"
        )
        assert spec is not None and spec.loader is not None
        sys.modules["chart_generate"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules["chart_generate"])
    return sys.modules["chart_generate"]


gen = _load_generator()
FIX = "run `python charts/hack/generate.py` (after `python -m ddiloco.operator.crd`)"


def load_schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def violations(value: Any, schema: dict[str, Any], where: str = "") -> list[str]:
    """The part of JSON schema the chart's schema uses: type, properties, additionalProperties,
    items, enum. Enough to show which keys a values file may hold."""
    kinds = {"object": dict, "array": list, "string": str, "boolean": bool}
    kind = schema.get("type")
    if kind in kinds and not isinstance(value, kinds[kind]):
        return [f"{where}: not {kind}"]
    if kind in ("integer", "number") and (
        isinstance(value, bool) or not isinstance(value, int if kind == "integer" else int | float)
    ):
        return [f"{where}: not {kind}"]
    if "enum" in schema and value not in schema["enum"]:
        return [f"{where}: {value!r} not in {schema['enum']}"]
    out: list[str] = []
    if isinstance(value, dict):
        props = schema.get("properties", {})
        extra = schema.get("additionalProperties", True)
        for key, sub in value.items():
            if key in props:
                out += violations(sub, props[key], f"{where}.{key}")
            elif extra is False:
                out.append(f"{where}.{key}: unknown key")
            elif isinstance(extra, dict):
                out += violations(sub, extra, f"{where}.{key}")
    if isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            out += violations(item, schema["items"], f"{where}[{i}]")
    return out


def test_schema_and_crd_in_the_chart_are_fresh() -> None:
    assert (CHART / "values.schema.json").read_text() == gen.render_schema(), FIX
    chart_crd = CHART / "crds" / crd.CRD_PATH.name
    assert chart_crd.read_text() == crd.render(), FIX
    assert chart_crd.read_text() == crd.CRD_PATH.read_text(), "chart and deploy/crds differ"
    assert sorted(p.name for p in (CHART / "crds").iterdir()) == [crd.CRD_PATH.name]


def test_generate_check_passes_and_catches_a_stale_schema(tmp_path: Path) -> None:
    assert gen.main(["--check", "--no-helm"]) == 0
    stale = tmp_path / "values.schema.json"
    stale.write_text("{}\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(gen, "SCHEMA", stale)
        mp.setattr(gen, "REPO", tmp_path)
        assert gen.main(["--check", "--no-helm"]) == 1


def test_every_object_in_the_schema_is_strict_and_every_key_described() -> None:
    def walk(node: dict[str, Any], where: str) -> None:
        if "properties" in node:
            assert node.get("additionalProperties") is False, f"{where} accepts unknown keys"
            for key, sub in node["properties"].items():
                if where:  # below the root every key carries its values.yaml comment
                    assert sub.get("description"), f"{where}.{key} has no description"
                walk(sub, f"{where}.{key}")

    schema = load_schema()
    walk(schema, "")
    top = set(yaml.safe_load((CHART / "values.yaml").read_text()))
    assert set(schema["properties"]) == top
    assert all(schema["properties"][k].get("description") for k in top)


def test_comments_become_descriptions_and_schema_tags() -> None:
    text = (
        "# header, not a key's\n\n"
        "# The image.\nimage:\n"
        "  # Where it is pulled from.\n  repository: r\n"
        '  # How often.\n  # +schema: {"enum": ["Always"]}\n  pullPolicy: Always\n'
    )
    assert gen.key_comments(text)[("image", "repository")] == ["Where it is pulled from."]
    schema = gen.values_schema(text)
    image = schema["properties"]["image"]
    assert image["description"] == "The image."
    assert image["properties"]["pullPolicy"] == {
        "description": "How often.",
        "enum": ["Always"],
        "default": "Always",
    }
    assert image["properties"]["repository"]["type"] == "string"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("# a\nimage:\n  tag: x\n", "image.tag: every key"),
        ("replicas: 1\n", "replicas: every key"),
        ("# things\nthings: {}\n", "empty map or list"),
        ("# things\nthings: []\n", "empty map or list"),
    ],
)
def test_undocumented_or_untyped_keys_are_refused(text: str, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        gen.values_schema(text)


@pytest.mark.parametrize(
    "values",
    [CHART / "values.yaml", *sorted((CHART / "ci").glob("*.yaml"))],
    ids=lambda p: p.name,
)
def test_values_and_ci_sets_hold_only_declared_keys(values: Path) -> None:
    data = yaml.safe_load(values.read_text())
    assert data, f"{values.name} is empty"
    assert violations(data, load_schema()) == []


def test_a_misspelt_key_is_not_declared() -> None:
    schema = load_schema()
    assert violations({"operator": {"resyncSecond": 2}}, schema) == [
        ".operator.resyncSecond: unknown key"
    ]
    assert violations({"image": {"pullPolicy": "Sometimes"}}, schema)
    assert violations({"remoteRegion": {"enabled": "yes"}}, schema)


def test_ci_sets_are_numbered_scenarios_each_explained() -> None:
    files = sorted((CHART / "ci").glob("*.yaml"))
    assert len(files) >= 3
    for path in files:
        assert path.name[:2].isdigit() and path.name.endswith("-values.yaml"), path.name
        assert path.read_text().startswith("#"), f"{path.name}: say what scenario it is"
