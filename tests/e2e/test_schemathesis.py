"""OpenAPI-driven fuzzing (schemathesis) of a real `ddiloco synchronizer` process.

    pytest tests/e2e/test_schemathesis.py -m e2e

Every operation of /openapi.json is called with generated inputs, valid and invalid, with
the job's bearer token; the binary bodies (init, updates) come from a safetensors-shaped
strategy (headers right, wrong, or garbage) registered for `application/vnd.safetensors`.
No answer may be a 5xx or take longer than the longest long poll allows, and no generated
update can be accepted (its tensors are never the layout's), so the fragments served at the
end are byte-identical to those served before. Bounded: `MAX_EXAMPLES` per operation and
generation mode (13 runs, about 1,000 requests), about 30 s on two cores.

The schemathesis pytest plugin (`schemathesis.pytest.from_fixture`) does not run under
pytest 9 (it sets `Node._nodeid`, which pytest 9 removed), so each operation's Hypothesis
strategy (`APIOperation.as_strategy`) drives a plain `@given` test instead.
"""

from __future__ import annotations

import http.client
import json
import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import hypothesis
import pytest
import schemathesis
import torch
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from ddiloco.learner.sync_client import SyncClient
from ddiloco.local.processes import terminate_all
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    CONTENT_TYPE,
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, pytest.mark.timeout(600)]
TOKEN = "fuzz-token"
MAX_EXAMPLES = 100
RESPONSE_BOUND_S = 10.0
"""The longest answer allowed: a heartbeat long poll waits up to 5 s by design."""
PARAMS = {"emb": torch.arange(12.0).reshape(3, 4), "w": torch.ones(4, 4), "b": torch.zeros(4)}
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, embedding=True, tensors=[TensorSpec(name="emb", shape=[3, 4])]),
        FragmentSpec(
            index=1,
            tensors=[TensorSpec(name="b", shape=[4]), TensorSpec(name="w", shape=[4, 4])],
        ),
    ]
)
DTYPES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I32": 4, "BOOL": 1, "F8_E8M0": 1, "F4": 1}
"""Wire dtypes and some safetensors allows but the wire does not, with a byte size that fits
shapes of an even count."""
CALLS: dict[str, int] = {}
"""Requests made, by status code (the last test checks the fuzzer did run)."""
DETAILS: set[str] = set()
"""Why updates were refused (the last test checks the fuzzer reached the codec's checks)."""


PLAUSIBLE = {
    "learner_id": "l0",
    "fragment": "1",
    "base_version": "0",
    "steps": "24",
    "tokens": "240",
    "learner_step": "1",
    "incarnation": "1",
    "encoding": "float32",
}
ODD_VALUES = st.one_of(
    st.sampled_from(["", "-1", "1e999", "NaN", "9" * 30, "l1"]),
    st.text(max_size=8),
    st.integers(),
    st.none(),
    st.lists(st.integers(), max_size=2),
)


@st.composite
def metadata(draw: st.DrawFn) -> dict[str, Any]:
    """Update metadata, mostly plausible (learner l0, fragment 1), with a few odd values;
    or an init's layout."""
    if draw(st.integers(0, 4)) == 0:
        return {LAYOUT_KEY: draw(st.sampled_from([LAYOUT.model_dump_json(), "[]", "{" * 300]))}
    meta: dict[str, Any] = dict(PLAUSIBLE)
    meta["learner_step"] = str(draw(st.integers(1, 10**6)))
    for key in draw(st.lists(st.sampled_from([*PLAUSIBLE, "x"]), max_size=2)):
        meta[key] = draw(ODD_VALUES)
    return meta


FLAWS = ["not_object", "deep", "entry", "length", "truncate", "extra"]


@st.composite
def safetensors_payload(draw: st.DrawFn) -> bytes:
    """Bytes shaped like a safetensors update or init, mostly well framed, with at most one
    flaw drawn from the probe's list (not an object, deep nesting, bad dtype, shape, offsets,
    length, truncation, trailing bytes) or none. Tensor names are never the layout's, so no
    generated update can be accepted."""
    if draw(st.integers(0, 5)) == 0:
        return draw(st.binary(max_size=256))
    entries: dict[str, Any] = {}
    at = 0
    for i in range(draw(st.integers(0, 3))):
        shape = draw(st.lists(st.integers(0, 4).map(lambda d: 2 * d), max_size=3))
        dtype = draw(st.sampled_from(["F32"] * 6 + list(DTYPES)))
        size = math.prod(shape) * DTYPES[dtype] // (2 if dtype == "F4" else 1)
        entries[f"fuzz.{i}"] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + size]}
        at += size
    header: Any = {"__metadata__": draw(metadata()), **entries}
    flaw = draw(st.sampled_from(["none"] * 6 + FLAWS))
    name = draw(st.sampled_from(sorted(entries) or ["__metadata__"]))
    if flaw == "not_object":
        header = draw(st.sampled_from([[header], [], None, 1, "x", 1.5, True]))
    elif flaw == "entry" and name in entries:
        key = draw(st.sampled_from(["dtype", "shape", "data_offsets", "extra"]))
        entries[name][key] = draw(
            st.one_of(ODD_VALUES, st.lists(st.integers(-(2**64), 2**64), max_size=3))
        )
    elif flaw == "entry":
        header[name] = draw(st.sampled_from([[], 1, {"a": 1}, None]))
    raw = json.dumps(header).encode()
    if flaw == "deep":
        depth = draw(st.integers(4, 50_000))
        raw = b'{"x": ' + b"[" * depth + b"]" * depth + b"}"
    data = draw(st.binary(min_size=at, max_size=at)) if at <= 64 else b"\x01" * at
    length = len(raw)
    if flaw == "length":
        length = draw(st.sampled_from([0, len(raw) - 1, len(raw) + 1, 2**63, 2**64 - 1]))
    elif flaw == "truncate":
        data = data[: draw(st.integers(0, max(0, len(data) - 1)))]
        raw = raw if data else raw[:-1]
    elif flaw == "extra":
        data += draw(st.binary(min_size=1, max_size=8))
    return length.to_bytes(8, "little") + raw + data


schemathesis.openapi.media_type(CONTENT_TYPE, safetensors_payload())


class Sync:
    def __init__(self, port: int, log: Path) -> None:
        self.port, self.log = port, log
        self.url = f"http://127.0.0.1:{port}"
        self.client = SyncClient(self.url, TOKEN, timeout=10)

    def fragments(self) -> list[tuple[str | None, bytes]]:
        """What is served: (version header, body) of every fragment."""
        out = []
        for p in range(len(LAYOUT.fragments)):
            conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=10)
            conn.request("GET", f"/v1/fragments/{p}", headers={"Authorization": f"Bearer {TOKEN}"})
            resp = conn.getresponse()
            assert resp.status == 200
            out.append((resp.getheader("x-ddiloco-version"), resp.read()))
            conn.close()
        return out


@pytest.fixture(scope="module")
def sync(
    tmp_path_factory: pytest.TempPathFactory, synchronizer_process: Callable[..., Any]
) -> Iterator[Sync]:
    tmp = tmp_path_factory.mktemp("fuzz")
    proc = synchronizer_process(tmp, TOKEN, "--no-grace", DDILOCO_BODY_TIMEOUT_S="2")
    s = Sync(proc.port, proc.log)
    try:
        proc.start()
        s.client.join(JoinRequest(learner_id="l0", layout_digest=LAYOUT.digest()))
        s.client.init(codec.encode(PARAMS, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
        s.before = s.fragments()  # type: ignore[attr-defined]
        yield s
        log = s.log.read_text()
        assert "Traceback" not in log and "Exception in ASGI" not in log, log[-5000:]
    finally:
        terminate_all([proc.child])


OPERATIONS = [
    ("POST", "/v1/join"),
    ("PUT", "/v1/init"),
    ("GET", "/v1/fragments/{p}"),
    ("GET", "/v1/fragments/{p}/float32"),
    ("POST", "/v1/fragments/{p}/updates"),
    ("POST", "/v1/heartbeat"),
    ("GET", "/v1/model"),
    ("GET", "/v1/status"),
    ("POST", "/v1/evaluations"),
    ("GET", "/healthz"),
    ("GET", "/metrics"),
]

NEGATABLE = {
    "/v1/join",
    "/v1/fragments/{p}",
    "/v1/fragments/{p}/float32",
    "/v1/fragments/{p}/updates",
    "/v1/heartbeat",
    "/v1/evaluations",
}
"""Operations with an input schemathesis can make invalid (a parameter or a JSON body)."""


@pytest.fixture(scope="module")
def api_schema(sync: Sync) -> schemathesis.BaseSchema:
    schema = schemathesis.openapi.from_url(f"{sync.url}/openapi.json")
    schema.config.update(
        base_url=sync.url,
        headers={"Authorization": f"Bearer {TOKEN}"},
        request_timeout=RESPONSE_BOUND_S * 2,
    )
    return schema


def test_every_operation_is_fuzzed(api_schema: schemathesis.BaseSchema) -> None:
    listed = {(op.ok().method.upper(), op.ok().path) for op in api_schema.get_all_operations()}
    assert listed == set(OPERATIONS)


POSITIVE, NEGATIVE = schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE
RUNS = [
    *[(m, p, POSITIVE, None) for m, p in OPERATIONS],
    *[(m, p, NEGATIVE, None) for m, p in OPERATIONS if p in NEGATABLE],
    ("POST", "/v1/fragments/{p}/updates", POSITIVE, 1),  # p matches the metadata: deeper
]


@pytest.mark.parametrize(
    ("method", "path", "mode", "pin"),
    RUNS,
    ids=[f"{m} {p} {mode.value}{'' if pin is None else f' p={pin}'}" for m, p, mode, pin in RUNS],
)
def test_no_server_error_and_no_hang(
    api_schema: schemathesis.BaseSchema,
    method: str,
    path: str,
    mode: schemathesis.GenerationMode,
    pin: int | None,
) -> None:
    operation = api_schema[path][method]
    pinned = None if pin is None else {"p": pin}

    @hypothesis.settings(
        max_examples=MAX_EXAMPLES,
        deadline=None,
        database=None,
        suppress_health_check=list(hypothesis.HealthCheck),
        print_blob=True,
    )
    @hypothesis.given(case=operation.as_strategy(generation_mode=mode, path_parameters=pinned))
    def fuzz(case: schemathesis.Case) -> None:
        response = case.call_and_validate(checks=[not_a_server_error])
        CALLS[str(response.status_code)] = CALLS.get(str(response.status_code), 0) + 1
        assert response.elapsed < RESPONSE_BOUND_S, (case.operation.label, response.elapsed)
        if response.status_code >= 400:
            err = response.json()  # every refusal is {"error": <reason>, "detail": <why>}
            assert isinstance(err.get("error"), str), err
            assert isinstance(err.get("detail"), str), err
            if path.endswith("/updates"):
                DETAILS.add(err["detail"])

    fuzz()


def test_fuzzing_changed_no_fragment(sync: Sync) -> None:
    """Runs after the fuzzer (file order): it made many calls, many were refused, and the
    served fragments are byte-identical to those served before it ran."""
    total = sum(CALLS.values())
    assert total >= len(OPERATIONS) * MAX_EXAMPLES, CALLS
    assert sum(n for code, n in CALLS.items() if code.startswith("4")) >= 100, CALLS
    assert sync.fragments() == sync.before  # type: ignore[attr-defined]
    for reached in ("not a JSON object", "nests deeper", "dtype", "do not match the layout"):
        assert any(reached in d for d in DETAILS), (reached, sorted(DETAILS)[:50])
    status = sync.client.status()
    assert status.merges == 0 and status.contributions_rejected > 0
    assert {"invalid", "unknown_learner"} <= set(status.refusals), status.refusals
