"""Generate the ddiloco chart's derived files, and check that the committed ones are fresh.

    python charts/hack/generate.py             # write them all
    python charts/hack/generate.py --check     # exit 1, naming the stale files (tests run this)
    python charts/hack/generate.py --helm /path/to/helm
    python charts/hack/generate.py --no-helm   # schema and CRD only (no helm at hand)

What it writes, and from what:
    charts/ddiloco/values.schema.json   values.yaml: the comment above each key is its
                                        description, a `# +schema: {...}` line in that comment
                                        gives its JSON schema (else the type of its default);
                                        every object is strict (additionalProperties: false),
                                        so a misspelt key fails `helm install`
    charts/ddiloco/crds/*.yaml          operator/api.py, through `ddiloco.operator.crd` (the same
                                        text as deploy/crds/)
    deploy/manifests/ddiloco.yaml       `helm template` of the home-cluster install (CRD included)
    deploy/manifests/remote-region.yaml `helm template` of the remote-region mode

helm is looked up as --helm, $HELM, the test control plane's build (tests/integration/k8senv.py
build), then PATH. A key without a comment, or an empty map or list without a `+schema` line,
is an error: the schema could not say what it accepts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any, Final

import yaml

from ddiloco.operator import crd

REPO: Final = Path(__file__).resolve().parents[2]
CHART: Final = REPO / "charts" / "ddiloco"
VALUES: Final = CHART / "values.yaml"
SCHEMA: Final = CHART / "values.schema.json"
CHART_CRD: Final = CHART / "crds" / crd.CRD_PATH.name
MANIFESTS: Final = REPO / "deploy" / "manifests"
RELEASE: Final = "ddiloco"
# The k8senv helm is built without helm's Kubernetes version stamp and would assume v1.20 (below
# the chart's kubeVersion); the tests' apiservers are v1.37. No test pods in plain manifests.
TEMPLATE_ARGS: Final = ("--kube-version", "v1.37.2", "--skip-tests")
HOME_NAMESPACE: Final = "ddiloco-system"
SCHEMA_TAG: Final = "+schema:"
KEY_LINE: Final = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z_][\w-]*):(\s|$)")

# The plain manifests, as (file, helm template arguments, what the header tells the reader).
RENDERS: Final = {
    "ddiloco.yaml": (
        ["--namespace", HOME_NAMESPACE, "--include-crds", "--set", "createNamespace=true"],
        "The DecoupledDiLoCoJob operator in its home cluster: namespace, CRD, ServiceAccount,\n"
        "# least-privilege RBAC, Deployment, health Service.\n#\n"
        "#   kubectl apply --server-side -f deploy/manifests/ddiloco.yaml\n"
        "#   kubectl -n ddiloco-system rollout status deployment/ddiloco-operator",
    ),
    "remote-region.yaml": (
        ["--namespace", "default", "--set", "remoteRegion.enabled=true"],
        "What the home cluster's operator needs in a remote region, for one namespace: a\n"
        "# ServiceAccount, its Role and RoleBinding, and a long-lived token Secret. The objects\n"
        "# carry no namespace; choose it when applying:\n#\n"
        "#   kubectl --context region-a create namespace team-a\n"
        "#   kubectl --context region-a -n team-a apply -f deploy/manifests/remote-region.yaml\n"
        "#\n# then build the kubeconfig Secret as charts/ddiloco/README.md, 'Across regions', says",
    ),
}


# --------------------------------------------------------------------------- values.schema.json


def key_comments(text: str) -> dict[tuple[str, ...], list[str]]:
    """Path of every mapping key in a block-style YAML file -> the comment lines right above it."""
    out: dict[tuple[str, ...], list[str]] = {}
    stack: list[tuple[int, str]] = []
    block: list[str] = []
    for line in text.splitlines():
        stripped = line.strip()
        if stripped.startswith("#"):
            block.append(stripped.lstrip("#").strip())
            continue
        match = KEY_LINE.match(line)
        if match:
            indent = len(match["indent"])
            while stack and stack[-1][0] >= indent:
                stack.pop()
            stack.append((indent, match["key"]))
            out[tuple(key for _, key in stack)] = block
        block = []
    return out


def _infer(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, bool):
        return {"type": "boolean"}
    if isinstance(value, int):
        return {"type": "integer"}
    if isinstance(value, float):
        return {"type": "number"}
    if isinstance(value, str):
        return {"type": "string"}
    if isinstance(value, dict | list) and not value:
        raise ValueError(f"{where}: an empty map or list needs a '# {SCHEMA_TAG} {{...}}' line")
    raise ValueError(f"{where}: cannot infer a schema from {value!r}; add a '# {SCHEMA_TAG}' line")


def _node(
    value: Any, path: tuple[str, ...], comments: dict[tuple[str, ...], list[str]]
) -> dict[str, Any]:
    where = ".".join(path)
    if path not in comments or not [c for c in comments[path] if c]:
        raise ValueError(f"{where}: every key of values.yaml needs a comment above it")
    lines = comments[path]
    tags = [c[len(SCHEMA_TAG) :] for c in lines if c.startswith(SCHEMA_TAG)]
    description = " ".join(c for c in lines if c and not c.startswith(SCHEMA_TAG))
    if tags:
        node: dict[str, Any] = json.loads(tags[0])  # the tag says it all: no recursion below
    elif isinstance(value, dict) and value:
        node = _object(value, path, comments)
    else:
        node = _infer(value, where)
    node = {"description": description, **node}
    if not isinstance(value, dict | list):
        node["default"] = value
    return node


def _object(
    values: dict[str, Any], path: tuple[str, ...], comments: dict[tuple[str, ...], list[str]]
) -> dict[str, Any]:
    return {
        "type": "object",
        "additionalProperties": False,
        "properties": {k: _node(v, (*path, k), comments) for k, v in values.items()},
    }


def values_schema(text: str) -> dict[str, Any]:
    """The strict JSON schema (draft-07, which helm 3 validates) of a commented values file."""
    values = yaml.safe_load(text) or {}
    return {
        "$schema": "http://json-schema.org/draft-07/schema#",
        "title": "Values of the ddiloco chart (generated by charts/hack/generate.py)",
        **_object(values, (), key_comments(text)),
    }


def render_schema() -> str:
    return json.dumps(values_schema(VALUES.read_text()), indent=2) + "\n"


# --------------------------------------------------------------------------- helm


def _k8senv() -> Any:
    """tests/integration/k8senv.py (the test control plane's harness), loaded by path."""
    if "k8senv" not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            "k8senv", REPO / "tests" / "integration" / "k8senv.py"
        )
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules["k8senv"] = module  # before exec: its dataclasses look themselves up there
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules["k8senv"]
            raise
    return sys.modules["k8senv"]


def find_helm(explicit: str | None = None) -> str | None:
    if explicit or os.environ.get("HELM"):
        return explicit or os.environ["HELM"]
    try:
        bindir = _k8senv().find_built()
    except Exception:  # a broken or half-written build: fall back to PATH
        bindir = None
    if bindir is not None and (Path(bindir) / "helm").is_file():
        return str(Path(bindir) / "helm")
    return shutil.which("helm")


def helm_template(helm: str, *args: str) -> str:
    proc = subprocess.run(
        [helm, "template", RELEASE, str(CHART), *TEMPLATE_ARGS, *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HELM_CACHE_HOME": "/tmp/ddiloco-helm/cache",
             "HELM_CONFIG_HOME": "/tmp/ddiloco-helm/config",
             "HELM_DATA_HOME": "/tmp/ddiloco-helm/data"},
    )  # fmt: skip
    if proc.returncode != 0:
        raise RuntimeError(f"helm template {' '.join(args)} failed:\n{proc.stderr}")
    return proc.stdout


def render_manifests(helm: str) -> dict[Path, str]:
    out = {}
    for name, (args, about) in RENDERS.items():
        command = " ".join(("helm template", RELEASE, "charts/ddiloco", *TEMPLATE_ARGS, *args))
        header = (
            f"# {about}\n#\n# Generated by `python charts/hack/generate.py`, as\n"
            f"#   {command}\n"
            "# Do not edit: change the chart and run it again (tests/integration/test_chart_render.py\n"
            "# checks).\n"
        )
        out[MANIFESTS / name] = header + helm_template(helm, *args)
    return out


# --------------------------------------------------------------------------- main


def expected(helm: str | None) -> dict[Path, str]:
    files = {SCHEMA: render_schema(), CHART_CRD: crd.render()}
    if helm is not None:
        files.update(render_manifests(helm))
    return files


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python charts/hack/generate.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--check", action="store_true", help="fail if a committed file is stale")
    parser.add_argument("--helm", help="helm binary (default: $HELM, the k8senv build, PATH)")
    parser.add_argument("--no-helm", action="store_true", help="leave deploy/manifests/ alone")
    args = parser.parse_args(argv)
    helm = None if args.no_helm else find_helm(args.helm)
    if helm is not None and not Path(helm).is_file():
        parser.error(f"helm binary {helm} does not exist")
    if helm is None and not args.no_helm:
        sys.stderr.write("helm not found: deploy/manifests/ left as they are (see --helm)\n")
    if not args.check:  # helm renders against the schema on disk: a new key needs it first
        for path, text in expected(None).items():
            if not path.is_file() or path.read_text() != text:
                path.write_text(text)
                sys.stderr.write(f"wrote {path.relative_to(REPO)}\n")
    files = expected(helm)
    if args.check:
        stale = [p for p, text in files.items() if not p.is_file() or p.read_text() != text]
        for path in stale:
            sys.stderr.write(f"{path.relative_to(REPO)} is stale: run {parser.prog}\n")
        return 1 if stale else 0
    for _ in range(2):  # the manifests render the chart as it is on disk: write, then render again
        for path, text in files.items():
            if not path.is_file() or path.read_text() != text:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
                sys.stderr.write(f"wrote {path.relative_to(REPO)}\n")
        files = expected(helm)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
