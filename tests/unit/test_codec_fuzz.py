"""Property tests of the codec against hostile bytes: it returns, or raises PayloadError.

    pytest tests/unit/test_codec_fuzz.py

For arbitrary bytes, arbitrary JSON headers, and mutations of a valid update payload (a
header field replaced by any JSON value, nesting thousands deep, dtypes safetensors knows and
the wire does not, bad shapes and offsets, truncation, extra bytes, flipped bytes),
`read_metadata`, `decode` and admission's `check_fragment` either return or raise `PayloadError`, and
whatever `decode` returns is what the checked header says. Valid payloads still round-trip.
Bounded: a few hundred examples per property, seconds in all.
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.synchronizer import admission
from ddiloco.wire import codec
from ddiloco.wire.errors import PayloadError
from ddiloco.wire.protocol import FragmentSpec, TensorSpec, UpdateMeta

FUZZ = settings(
    max_examples=300,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
SPEC = FragmentSpec(
    index=1, tensors=[TensorSpec(name="b", shape=[4]), TensorSpec(name="w", shape=[4, 4])]
)
META = UpdateMeta(
    learner_id="l0", fragment=1, base_version=0, steps=24, tokens=240, learner_step=7
).to_metadata()
VALID = codec.encode({"b": torch.zeros(4), "w": torch.ones(4, 4)}, META)
ST_DTYPES = ["F32", "BF16", "F16", "F64", "I64", "I32", "I16", "I8", "U8", "BOOL", "U16"]
ST_DTYPES += ["U32", "U64", "F8_E5M2", "F8_E4M3", "F8_E8M0", "F4", "F6_E2M3", "F6_E3M2", "C64"]

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner, max_size=4)
    ),
    max_leaves=20,
)


def outcome(payload: bytes) -> dict[str, torch.Tensor] | None:
    """Run every entry point on `payload`; only PayloadError may escape them, as None."""
    with contextlib.suppress(PayloadError):
        codec.read_metadata(payload)
    try:
        tensors = codec.decode(payload)
    except PayloadError:
        return None
    header = codec.read_header(payload)  # decode passed: so does the header
    assert set(tensors) == set(header.tensors)
    for name, t in tensors.items():
        assert tuple(t.shape) == header.tensors[name].shape
        assert t.dtype in codec.WIRE_DTYPES.values()
    with contextlib.suppress(PayloadError):
        admission.check_fragment(tensors, SPEC)
    return tensors


def frame(header: bytes, data: bytes = b"") -> bytes:
    return len(header).to_bytes(8, "little") + header + data


def header_of(payload: bytes) -> dict[str, Any]:
    n = int.from_bytes(payload[:8], "little")
    return json.loads(payload[8 : 8 + n])


@FUZZ
@given(st.binary(max_size=2048))
def test_arbitrary_bytes(payload: bytes) -> None:
    outcome(payload)


@FUZZ
@given(json_values, st.binary(max_size=256))
def test_arbitrary_json_header(header: Any, data: bytes) -> None:
    outcome(frame(json.dumps(header).encode(), data))


@st.composite
def mutated_header(draw: st.DrawFn) -> bytes:
    """The valid update with its header changed in one place."""
    header = header_of(VALID)
    data = VALID[8 + int.from_bytes(VALID[:8], "little") :]
    name = draw(st.sampled_from(["b", "w", "__metadata__"]))
    where = draw(st.sampled_from(["whole", "dtype", "shape", "data_offsets", "extra_key"]))
    value = draw(
        st.one_of(
            json_values,
            st.sampled_from(ST_DTYPES),
            st.lists(st.integers(-(2**64), 2**64), max_size=4),
        )
    )
    if name == "__metadata__" or where == "whole":
        if name == "__metadata__" and where != "whole" and draw(st.booleans()):
            header[name][draw(st.sampled_from([*META, "x"]))] = value
        else:
            header[name] = value
    else:
        header[name][where] = value
    return frame(json.dumps(header).encode(), data)


@FUZZ
@given(mutated_header())
def test_mutated_header(payload: bytes) -> None:
    outcome(payload)


@FUZZ
@given(st.sampled_from(ST_DTYPES), st.lists(st.integers(0, 6), max_size=4), st.binary(max_size=300))
def test_any_safetensors_dtype_is_refused_unless_on_the_wire(
    dtype: str, shape: list[int], data: bytes
) -> None:
    n = len(data)
    header = {"t": {"dtype": dtype, "shape": shape, "data_offsets": [0, n]}}
    tensors = outcome(frame(json.dumps(header).encode(), data))
    if dtype not in ("F32", "BF16", "F16"):
        assert tensors is None


@FUZZ
@given(
    st.integers(4, 60_000),  # deeper than a header nests (codec.MAX_DEPTH)
    st.sampled_from(["[", "{", '{"a":', '{"__metadata__":{"x":', '{"w":{"shape":']),
)
def test_deep_nesting(depth: int, opener: str) -> None:
    close = {"[": "]", "{": "}", '{"a":': "}"}.get(opener, "}}")
    payload = frame((opener + "[" * depth + "]" * depth + close).encode())
    with pytest.raises(PayloadError):
        codec.read_metadata(payload)
    with pytest.raises(PayloadError):
        codec.decode(payload)


@FUZZ
@given(st.integers(0, len(VALID) + 64), st.binary(min_size=1, max_size=64), st.integers(0, 2))
def test_truncated_extended_or_flipped(at: int, noise: bytes, how: int) -> None:
    if how == 0:
        payload = VALID[:at]
    elif how == 1:
        payload = VALID + noise
    else:
        i = at % len(VALID)
        payload = VALID[:i] + bytes([VALID[i] ^ (noise[0] or 1)]) + VALID[i + 1 :]
    tensors = outcome(payload)
    if (how == 0 and at < len(VALID)) or how == 1:
        assert tensors is None  # a short or padded buffer never decodes


@FUZZ
@given(st.integers(0, 2**64 - 1))
def test_any_declared_header_length(n: int) -> None:
    outcome(n.to_bytes(8, "little") + VALID[8:])


wire_tensors = st.dictionaries(
    st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
    st.tuples(
        st.sampled_from(list(codec.WIRE_DTYPES.values())), st.lists(st.integers(0, 3), max_size=3)
    ),
    max_size=4,
)


@FUZZ
@given(wire_tensors, st.dictionaries(st.text(max_size=8), st.text(max_size=16), max_size=4))
def test_valid_payloads_still_round_trip(specs: dict, meta: dict[str, str]) -> None:
    tensors = {k: torch.randn(shape).to(dtype) for k, (dtype, shape) in specs.items()}
    payload = codec.encode(tensors, meta or None)
    assert codec.read_metadata(payload) == meta
    back = codec.decode(payload)
    assert set(back) == set(tensors)
    for k, t in tensors.items():
        assert back[k].dtype == t.dtype and torch.equal(back[k], t)


def test_the_probe_cases_are_refused() -> None:
    """The outside probe's payloads, by name (each was a 500 before)."""
    for header in ("[]", "null", "1", "[" * 100_000 + "]" * 100_000):
        with pytest.raises(PayloadError, match="not safetensors"):
            codec.read_metadata(frame(header.encode()))
    for dtype in ("F8_E8M0", "F4", "F6_E2M3", "F6_E3M2"):
        header = {"__metadata__": META, "w": {"dtype": dtype, "shape": [8], "data_offsets": [0, 8]}}
        with pytest.raises(PayloadError, match="dtype"):
            codec.decode(frame(json.dumps(header).encode(), b"\x00" * 8))


@pytest.mark.parametrize(
    "header",
    [
        '{"' + '\\"' * 2_000_000,  # an unterminated string full of escaped quotes
        "{" + "[]" * 2_000_000 + "}",
        "{" + "[" * 4_000_000,
        '{"a":' + '"x",' * 1_000_000 + "}",
    ],
)
def test_big_hostile_headers_are_refused_quickly(header: str) -> None:
    t0 = time.perf_counter()
    with pytest.raises(PayloadError):
        codec.decode(frame(header.encode()))
    assert time.perf_counter() - t0 < 3.0


HEADER_B = {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}
BAD_ENTRIES: dict[str, tuple[Any, int]] = {
    "negative_dim": ({"dtype": "F32", "shape": [-4, -4], "data_offsets": [16, 80]}, 80),
    "string_dim": ({"dtype": "F32", "shape": ["4", 4], "data_offsets": [16, 80]}, 80),
    "bool_dim": ({"dtype": "F32", "shape": [True, 16], "data_offsets": [16, 80]}, 80),
    "float_dim": ({"dtype": "F32", "shape": [4.0, 4], "data_offsets": [16, 80]}, 80),
    "shape_not_list": ({"dtype": "F32", "shape": 16, "data_offsets": [16, 80]}, 80),
    "too_many_dims": ({"dtype": "F32", "shape": [1] * 17, "data_offsets": [16, 20]}, 20),
    "past_the_buffer": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80]}, 40),
    "short_of_the_buffer": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80]}, 96),
    "overlap": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [8, 72]}, 72),
    "gap": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [24, 88]}, 88),
    "reversed": ({"dtype": "F32", "shape": [0], "data_offsets": [16, 8]}, 16),
    "one_offset": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16]}, 80),
    "size_mismatch": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 48]}, 48),
    "huge_dim": ({"dtype": "F32", "shape": [1 << 70, 0], "data_offsets": [16, 16]}, 16),
    "extra_key": ({"dtype": "F32", "shape": [4, 4], "data_offsets": [16, 80], "x": 1}, 80),
    "missing_key": ({"dtype": "F32", "shape": [4, 4]}, 80),
    "dtype_not_string": ({"dtype": 32, "shape": [4, 4], "data_offsets": [16, 80]}, 80),
    "entry_not_object": ([], 16),
}


@pytest.mark.parametrize("name", list(BAD_ENTRIES))
def test_bad_header_entry_is_refused(name: str) -> None:
    w, data_len = BAD_ENTRIES[name]
    header = json.dumps({"__metadata__": META, "b": HEADER_B, "w": w}).encode()
    payload = frame(header, b"\x00" * data_len)
    with pytest.raises(PayloadError):
        codec.read_metadata(payload)
    with pytest.raises(PayloadError):
        codec.decode(payload)


@pytest.mark.parametrize(
    "header",
    [
        '{"__metadata__": {"learner_id": "l0", "fragment": 1, "steps": 24}}',  # not strings
        '{"__metadata__": []}',
        '{"__metadata__": {"learner_id": "\\ud800"}}',  # a lone surrogate
        '{"\\udfff": {"dtype": "F32", "shape": [0], "data_offsets": [0, 0]}}',
        '{"a": NaN}',
        '{"__metadata__": {}, "__metadata__": {}}',  # a repeated key
        ' {"__metadata__": {}}',  # safetensors wants the "{" first
        '{"__metadata__": {}} x',
    ],
)
def test_bad_header_json_is_refused(header: str) -> None:
    with pytest.raises(PayloadError, match="not safetensors"):
        codec.read_metadata(frame(header.encode()))


def test_header_over_the_cap_is_refused_before_parsing() -> None:
    raw = b"{" + b" " * codec.MAX_HEADER_BYTES + b"}"
    with pytest.raises(PayloadError, match="larger than"):
        codec.read_metadata(frame(raw))
