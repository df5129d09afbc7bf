"""The job's CEL rules, evaluated by the operator exactly as the apiserver evaluates them.

    problems(spec_json)     # ["training: training.innerSteps (H) must be a multiple ...", ...]

The rules are written once, as CEL (`x-kubernetes-validations` in api.py's models, carried into
the CRD by crd.py). The apiserver refuses a job that breaks one; the operator refuses it again
(phase Invalid) for a job that reached it without that check (an older CRD, a direct write to
etcd, a test), by evaluating the *same* expressions here with cel-python, against the same
structural schema: each rule runs where the schema attaches it, with `self` the value there,
typed by the schema (an `integer` is a CEL int, a `number` a double), over the spec as the
apiserver sees it (defaults applied). Two Kubernetes CEL library functions the rules use are
provided: `list.sum()` and `string.split(sep)`. Transition rules (those reading `oldSelf`)
need the previous object, which the operator does not keep: the apiserver alone enforces them.

A problem reads `<path>: <message>` (the rule's `messageExpression` when it has one, else its
`message`); the path is relative to `spec`, a list item named by its list-map key when the
schema gives one (`learnerGroups[a].env[0]`), else by its index.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import celpy
from celpy import celtypes

from ddiloco.operator import crd

__all__ = ["problems"]


def _sum(values: celtypes.ListType) -> Any:
    total: Any = celtypes.IntType(0)
    for v in values:
        total = total + v
    return total


def _split(text: celtypes.StringType, sep: celtypes.StringType) -> celtypes.ListType:
    return celtypes.ListType([celtypes.StringType(p) for p in str(text).split(str(sep))])


FUNCTIONS: dict[str, Callable[..., Any]] = {"sum": _sum, "split": _split}
"""Kubernetes' CEL extensions the rules use (the lists and strings libraries)."""


@functools.cache
def _env() -> celpy.Environment:
    return celpy.Environment()


@functools.cache
def _program(expression: str) -> Any:
    env = _env()
    return env.program(env.compile(expression), functions=FUNCTIONS)


@functools.cache
def _spec_schema() -> dict[str, Any]:
    return crd.openapi_schema()["properties"]["spec"]


def to_cel(value: Any, schema: dict[str, Any]) -> Any:
    """`value` (JSON) as the CEL value the apiserver gives a rule: typed by its schema."""
    if value is None:
        return None
    kind = schema.get("type")
    if kind == "integer":
        return celtypes.IntType(value)
    if kind == "number":
        return celtypes.DoubleType(value)
    if kind == "boolean":
        return celtypes.BoolType(value)
    if kind == "string":
        return celtypes.StringType(value)
    if kind == "array":
        item = schema.get("items", {})
        return celtypes.ListType([to_cel(v, item) for v in value])
    if kind == "object" and "properties" in schema:
        props = schema["properties"]
        return celtypes.MapType(
            {
                celtypes.StringType(k): to_cel(v, props.get(k, {}))
                for k, v in value.items()
                if v is not None
            }
        )
    if kind == "object" and isinstance(schema.get("additionalProperties"), dict):
        extra = schema["additionalProperties"]
        return celtypes.MapType(
            {celtypes.StringType(k): to_cel(v, extra) for k, v in value.items()}
        )
    return celpy.json_to_cel(value)  # x-kubernetes-preserve-unknown-fields: as it is


def _item_name(schema: dict[str, Any], item: Any, index: int) -> str:
    keys = schema.get("x-kubernetes-list-map-keys") or []
    if len(keys) == 1 and isinstance(item, dict) and item.get(keys[0]) is not None:
        return str(item[keys[0]])
    return str(index)


def _check(schema: dict[str, Any], value: Any, path: str, out: list[str]) -> None:
    rules = schema.get("x-kubernetes-validations") or []
    if rules:
        activation = {"self": to_cel(value, schema)}
        for rule in rules:
            if "oldSelf" in rule["rule"]:
                continue
            result = _program(rule["rule"]).evaluate(activation)
            if result is True or (isinstance(result, celtypes.BoolType) and bool(result)):
                continue
            message = rule.get("message", f"failed rule: {rule['rule']}")
            if "messageExpression" in rule:
                message = str(_program(rule["messageExpression"]).evaluate(activation))
            out.append(f"{path}: {message}" if path else message)
    if isinstance(value, dict):
        for key, sub in (schema.get("properties") or {}).items():
            if value.get(key) is not None:
                _check(sub, value[key], f"{path}.{key}" if path else key, out)
    elif isinstance(value, list) and "items" in schema:
        for i, item in enumerate(value):
            _check(schema["items"], item, f"{path}[{_item_name(schema, item, i)}]", out)


def problems(spec: dict[str, Any]) -> list[str]:
    """Every rule `spec` (a DecoupledDiLoCoJob's spec as JSON, defaults applied) breaks."""
    out: list[str] = []
    _check(_spec_schema(), spec, "", out)
    return out
