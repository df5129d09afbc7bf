"""Update encodings on the wire (synchronizer/encodings.py), and the synchronizer that takes them.

    .venv/bin/pytest -q tests/unit/test_wire.py

Each encoding round-trips through real safetensors bytes and the synchronizer's own header
check; every malformed quantized payload is refused with a PayloadError (422) and an
encoding the synchronizer was not configured for with Refusal.ENCODING (415), before
anything is written. The property: through `encode_update` with the learner's error
feedback (the anchor moves by `sent`), the sum of what the synchronizer decodes over T
hand-overs stays within one block scale of the sum the learner meant, however large T.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.synchronizer import update_passes
from ddiloco.synchronizer.config import SyncSettings
from ddiloco.synchronizer.metrics import encoding_of
from ddiloco.synchronizer.service import Synchronizer
from ddiloco.wire import codec, encodings, quant
from ddiloco.wire.errors import PayloadError, Refusal, SyncError
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

SPEC = FragmentSpec(
    index=0,
    tensors=[TensorSpec(name="w", shape=[3, 50]), TensorSpec(name="b", shape=[7])],
)
ALL = frozenset(encodings.ALL)
META = UpdateMeta(learner_id="l0", fragment=0, base_version=0, steps=4, tokens=64, learner_step=4)


def delta(seed: int = 0, scale: float = 1e-2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {t.name: torch.randn(t.shape, generator=g) * scale for t in SPEC.tensors}


def decode(payload: bytes, accepted: frozenset[str] = ALL) -> dict[str, update_passes.Term]:
    return encodings.decode_update(payload, codec.read_header(payload, codes=True), SPEC, accepted)


@pytest.mark.parametrize("encoding", ["float32", "bfloat16", "int8", "int4"])
@pytest.mark.parametrize("block", [16, 128])
def test_round_trip_decodes_exactly_what_was_sent(encoding: str, block: int) -> None:
    d = delta()
    payload, sent = encodings.encode_update(d, META, encoding, block)
    got = decode(payload)
    assert set(got) == {"w", "b"}
    for (
        name,
        t,
    ) in got.items():  # views of the payload, in its encoding (update_passes.py reads them)
        if encoding in encodings.QUANTIZED:
            assert isinstance(t, quant.Quantized) and t.encoding == encoding
        else:
            assert isinstance(t, torch.Tensor) and t.dtype == encodings.FLOAT_ENCODINGS[encoding]
        assert list(t.shape) == list(d[name].shape)
        assert torch.equal(update_passes.dense(t), sent[name])  # the learner's anchor moves by this
    header = codec.read_header(payload, codes=True)
    assert encodings.encoding_of(header) == encoding
    assert UpdateMeta.from_metadata(header.metadata).encoding == encoding
    err = max(float((sent[k] - d[k]).abs().max()) for k in d)
    bound = {"float32": 0.0, "bfloat16": 1e-4, "int8": 0.05 / 127, "int4": 0.05 / 7}[encoding]
    assert err <= bound  # |d| < 0.05 here: half a scale of 0.05 / qmax at most


def test_quantized_sizes_are_a_half_and_a_quarter_of_bfloat16() -> None:
    big = {"w": torch.randn(64, 1024) * 1e-2}
    spec = FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[64, 1024])])
    sizes = {e: len(encodings.encode_update(big, META, e, 128)[0]) for e in encodings.ALL}
    assert sizes["float32"] > 2 * sizes["bfloat16"] * 0.99
    assert 0.5 <= sizes["int8"] / sizes["bfloat16"] <= 0.52  # + a float32 scale per 128
    assert 0.25 <= sizes["int4"] / sizes["bfloat16"] <= 0.27
    payload, _ = encodings.encode_update(big, META, "int4", 128)
    header = codec.read_header(payload, codes=True)
    assert encodings.decode_update(payload, header, spec, frozenset({"int4"}))["w"].shape == (
        64,
        1024,
    )
    assert encoding_of(t.dtype for t in header.tensors.values()) == "int4"
    int8 = codec.read_header(encodings.encode_update(big, META, "int8", 128)[0], codes=True)
    assert encoding_of(t.dtype for t in int8.tensors.values()) == "int8"


def test_an_encoding_not_accepted_is_refused_with_415_naming_both() -> None:
    payload, _ = encodings.encode_update(delta(), META, "int4", 128)
    with pytest.raises(SyncError) as e:
        decode(payload, frozenset({"bfloat16"}))
    assert e.value.kind is Refusal.ENCODING and e.value.status == 415
    assert "accepts bfloat16" in str(e.value) and "the update is int4" in str(e.value)
    # an update whose metadata names no encoding is malformed, whatever its dtypes
    meta = {k: v for k, v in META.to_metadata().items() if k != "encoding"}
    unnamed = codec.encode({k: v.to(torch.bfloat16) for k, v in delta().items()}, meta)
    with pytest.raises(PayloadError, match="names no encoding"):
        decode(unnamed, frozenset({"bfloat16"}))


def quantized(
    encoding: str = "int4", block: int = 16, **change: object
) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """A valid quantized payload's tensors and metadata, to break one thing in."""
    payload, _ = encodings.encode_update(delta(), META, encoding, block)
    header = codec.read_header(payload, codes=True)
    return codec.decode(payload, header), dict(header.metadata)


def raw(tensors: dict[str, torch.Tensor], metadata: dict[str, str]) -> bytes:
    return codec.encode(tensors, metadata)


def broken() -> list[tuple[str, bytes]]:
    cases = []
    t, m = quantized()
    cases.append(("codes too short", raw(t | {"w": t["w"][:-1]}, m)))
    cases.append(("codes too long", raw(t | {"b": torch.cat([t["b"], t["b"][:1]])}, m)))
    cases.append(("scales too short", raw(t | {"w#scales": t["w#scales"][:-1]}, m)))
    cases.append(("codes not flat", raw(t | {"w": t["w"].view(-1, 1)}, m)))
    cases.append(("codes of the other kind", raw(t | {"w": t["w"].view(torch.int8)}, m)))
    cases.append(("scales not float32", raw(t | {"w#scales": t["w#scales"].half()}, m)))
    nan = t["w#scales"].clone()
    nan[0] = float("nan")
    cases.append(("a NaN scale", raw(t | {"w#scales": nan}, m)))
    inf = t["w#scales"].clone()
    inf[1] = float("inf")
    cases.append(("an infinite scale", raw(t | {"w#scales": inf}, m)))
    neg = t["w#scales"].clone()
    neg[0] = -1.0
    cases.append(("a negative scale", raw(t | {"w#scales": neg}, m)))
    high = t["w"].clone()
    high[3] = 0xF0 | (high[3] & 0x0F)  # high nibble 15: above 14
    cases.append(("an int4 code of 15", raw(t | {"w": high}, m)))
    cases.append(("a missing tensor", raw({k: v for k, v in t.items() if k != "b"}, m)))
    cases.append(("missing scales", raw({k: v for k, v in t.items() if k != "b#scales"}, m)))
    cases.append(("an extra tensor", raw(t | {"x": t["b"]}, m)))
    for bad in ("", "sixteen", "16.0", "-16", "15", "0", "1e9", "99999999999999999999"):
        cases.append((f"block {bad!r}", raw(t, m | {encodings.BLOCK_KEY: bad})))
    cases.append(("no block", raw(t, {k: v for k, v in m.items() if k != encodings.BLOCK_KEY})))
    cases.append(("the wrong block", raw(t, m | {encodings.BLOCK_KEY: "32"})))
    cases.append(("an unknown encoding", raw(t, m | {"encoding": "int2"})))
    t8, m8 = quantized("int8")
    cases.append(("int8 codes too short", raw(t8 | {"w": t8["w"][:-2]}, m8)))
    cases.append(("int8 sent as uint8", raw(t8 | {"w": t8["w"].view(torch.uint8)}, m8)))
    f, fm = delta(), {**META.to_metadata(), "encoding": "bfloat16"}
    cases.append(
        ("a float update of int tensors", raw(f | {"w": torch.ones(3, 50).to(torch.int8)}, fm))
    )
    cases.append(("a float update of codes", raw(t, fm)))
    return cases


@pytest.mark.parametrize(("why", "payload"), broken(), ids=[c[0] for c in broken()])
def test_every_malformed_payload_is_refused_with_a_payload_error(why: str, payload: bytes) -> None:
    with pytest.raises(PayloadError) as e:
        decode(payload)
    assert e.value.status == 422, why


def test_the_header_admits_codes_only_on_the_update_route() -> None:
    payload, _ = encodings.encode_update(delta(), META, "int8", 128)
    with pytest.raises(PayloadError, match="I8"):
        codec.read_header(payload)  # init, and every other reader: float dtypes only
    assert set(codec.read_header(payload, codes=True).tensors) == {"w", "w#scales", "b", "b#scales"}


def test_encode_refuses_what_it_cannot_send() -> None:
    with pytest.raises(ValueError, match="unknown update encoding"):
        encodings.encode_update(delta(), META, "float16", 128)
    with pytest.raises(ValueError, match="block"):
        encodings.encode_update(delta(), META, "int8", 3)
    with pytest.raises(ValueError, match="non-finite"):
        encodings.encode_update({"w": torch.tensor([float("inf")])}, META, "int4", 128)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    encoding=st.sampled_from(["int8", "int4"]),
    block=st.sampled_from([8, 32, 128]),
    seed=st.integers(0, 2**16),
    drift=st.floats(-0.02, 0.02),
)
def test_error_feedback_through_the_wire_converges_to_the_float_sum(
    encoding: str, block: int, seed: int, drift: float
) -> None:
    """The learner's loop as diloco.py runs it: theta takes T steps, each hand-over sends
    theta - anchor through encode_update, the anchor moves by what the synchronizer decodes.
    The gap between the sums (anchor - start against theta - start) is the last residual:
    within one block scale at every T (error feedback), while sending the same deltas without
    feedback drifts with T (shown, so the test could fail)."""
    g = torch.Generator().manual_seed(seed)
    theta = torch.zeros(3, 50)
    anchor = theta.clone()
    received = torch.zeros_like(theta)  # what the synchronizer summed
    naive = torch.zeros_like(theta)
    gaps = []
    for t in range(60):
        step = torch.randn(theta.shape, generator=g) * 1e-3 + drift * 1e-3
        theta += step
        payload, sent = encodings.encode_update({"w": theta - anchor}, META, encoding, block)
        spec = FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=[3, 50])])
        got = update_passes.dense(
            encodings.decode_update(payload, codec.read_header(payload, codes=True), spec, ALL)["w"]
        )
        assert torch.equal(got, sent["w"])
        anchor += got
        received += got
        _, plain = encodings.encode_update({"w": step}, META, encoding, block)
        naive += plain["w"]
        scales = codec.decode(payload, codec.read_header(payload, codes=True))["w#scales"]
        gap = float((received - theta).abs().max())
        assert gap <= float(scales.max()) / 2 + 1e-6, (t, gap)
        gaps.append(gap)
    # not growing with T: the last gap is no larger than the worst of the first ten
    assert gaps[-1] <= max(gaps[:10]) * 1.5 + 1e-6
    if encoding == "int4" and abs(drift) > 0.005:
        # without feedback a consistent drift is rounded away, T times over
        assert float((naive - theta).abs().max()) > gaps[-1]


# ---- the synchronizer, in-process ------------------------------------------------------

LAYOUT = Layout(fragments=[SPEC])


def sync_with(tmp_path: Path, encodings: list[str], merge: str = "mean") -> Synchronizer:
    s = SyncSettings(
        token="t",
        state_dir=tmp_path,
        outer_lr=1.0,
        outer_momentum=0.0,
        grace=False,
        merge=merge,  # type: ignore[arg-type]
        update_encodings=encodings,  # type: ignore[arg-type]
    )
    sync = Synchronizer(s)
    sync.join(JoinRequest(learner_id="l0"))
    init = {
        k: torch.randn(v.shape, generator=torch.Generator().manual_seed(9))
        for k, v in delta().items()
    }
    sync.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    return sync


def test_the_synchronizer_refuses_an_encoding_before_writing_anything(tmp_path: Path) -> None:
    sync = sync_with(tmp_path, ["bfloat16"])
    assert sync.join(JoinRequest(learner_id="l0")).update_encodings == ["bfloat16"]
    payload, _ = encodings.encode_update(delta(), META, "int4", 128)
    with pytest.raises(SyncError) as e:
        sync.submit(payload, 0)
    assert e.value.status == 415
    assert list(sync.store.pending(0).read()) == []  # nothing written
    assert sync.rounds.pending(0) == 0
    bf16, _ = encodings.encode_update(delta(), META, "bfloat16", 128)
    assert sync.submit(bf16, 0).status == "accepted"


def test_an_int4_update_is_merged_and_survives_a_restart(tmp_path: Path) -> None:
    sync = sync_with(tmp_path, ["int4"])
    before = {k: v.clone() for k, v in sync.fragments[0].state.params.items()}
    payload, sent = encodings.encode_update(delta(), META, "int4", 64)
    assert sync.submit(payload, 0).status == "accepted"
    sync.close()
    # the accepted update is in the pending log: a restart replays it through encodings.py
    again = Synchronizer(sync.settings)
    assert again.rounds.pending(0) == 1
    assert again.merge(0) == 1
    for k, v in again.fragments[0].state.params.items():
        # outer lr 1, no momentum: Theta moves by the mean outer gradient, -delta
        assert torch.allclose(v, before[k] + sent[k], atol=1e-6)
    status = again.metrics.render().decode()
    assert 'ddiloco_bytes_received_total{encoding="int4"}' not in status  # counted pre-restart
    assert sync.metrics.render().decode().count('encoding="int4"') >= 1


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_quantized_terms_are_read_in_chunks_with_the_bits_of_dequantize(
    encoding: str,
) -> None:
    """A quantized update stays codes until read (update_passes.py): three and a bit chunks with a
    partial last block. Its norm (dequantized, pausing between chunks: three times), its
    dense form, its scaled copy and its axpy are those of `quant.dequantize`'s float32 bit
    for bit, so a merge of codes is the merge of the floats they stand for."""
    block = 64
    n = 3 * update_passes.CHUNK + 1000  # 1000 = 15 blocks and 40 values of a 16th
    x = torch.randn(n, generator=torch.Generator().manual_seed(3))
    q = quant.quantize(x, encoding, block)  # type: ignore[arg-type]
    ref = quant.dequantize(q)
    pauses: list[int] = []
    assert update_passes.norm(q, lambda: pauses.append(1)) == float(torch.linalg.vector_norm(ref))
    assert len(pauses) == 3
    assert torch.equal(update_passes.dense(q), ref)
    into, want = torch.empty(n), torch.empty(n)
    update_passes.scale_into(into, q, 0.37)
    torch.mul(ref, 0.37, out=want)
    assert torch.equal(into, want)
    acc = torch.randn(n, generator=torch.Generator().manual_seed(4))
    want = acc.clone().add_(ref, alpha=-1.5)
    update_passes.axpy(acc, q, -1.5)
    assert torch.equal(acc, want)


def test_an_int4_code_of_15_in_either_nibble_is_refused_where_it_is_decoded() -> None:
    """Both nibbles of a byte are checked, past the first chunk too (quant.check_codes)."""
    x = torch.randn(2 * update_passes.CHUNK + 10, generator=torch.Generator().manual_seed(5))
    for bad in (0x0F, 0xF0):
        q = quant.quantize(x, "int4", 64)
        q.codes[update_passes.CHUNK // 2 + 7] |= bad
        with pytest.raises(ValueError, match="int4 code above 14"):
            quant.check_codes(q)
        with pytest.raises(ValueError, match="int4 code above 14"):
            update_passes.dense(q)


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_a_round_keeps_only_codes_and_a_replay_merges_the_same_bits(
    tmp_path: Path, encoding: str
) -> None:
    """Three learners' quantized updates, RDA: the round holds their codes (views of the
    bodies), not float32. The live merge (terms summed from float32 dequantized once at
    admission), a restart's replay of the same pending log (terms read from the codes) and
    the merge of the float32 they stand for, sent as float32, give the same bits."""
    live = sync_with(tmp_path / "live", [encoding], merge="rda")
    replayed = sync_with(tmp_path / "replayed", [encoding], merge="rda")
    floats = sync_with(tmp_path / "floats", ["float32"], merge="rda")
    for i in range(3):
        lid = f"l{i + 1}"
        meta = META.model_copy(update={"learner_id": lid, "tokens": 64 * (i + 1)})
        payload, sent = encodings.encode_update(delta(seed=i), meta, encoding, 64)
        as_float, _ = encodings.encode_update(sent, meta, "float32")
        for s, body in ((live, payload), (replayed, payload), (floats, as_float)):
            s.join(JoinRequest(learner_id=lid))
            assert s.submit(body, 0).status == "accepted"
    held = [c.delta for c in live.rounds.rounds[0].contributions.values()]
    assert len(held) == 3
    assert all(isinstance(t, quant.Quantized) for d in held for t in d.values())
    replayed.close()
    replayed = Synchronizer(replayed.settings)
    assert replayed.rounds.pending(0) == 3
    for s in (live, replayed, floats):
        assert s.merge(0) == 1  # the new version, with all three in it
        assert s.rounds.pending(0) == 0
    for k, v in floats.fragments[0].state.params.items():
        assert torch.equal(live.fragments[0].state.params[k], v), k
        assert torch.equal(replayed.fragments[0].state.params[k], v), k
    assert not torch.equal(floats.fragments[0].state.params["w"], torch.zeros(3, 50))


@pytest.mark.parametrize("merge_first", [True, False])
def test_a_quantized_update_waits_between_chunks_while_a_merge_computes(
    tmp_path: Path, merge_first: bool
) -> None:
    """`merge_first`: admission dequantizes a quantized update a chunk at a time and waits
    between chunks while a merge computes (the gate is held here as a merge holds it, and
    each wait lasts at most 1 s); off, it goes straight on."""
    shape = [3 * update_passes.CHUNK]
    layout = Layout(fragments=[FragmentSpec(index=0, tensors=[TensorSpec(name="w", shape=shape)])])
    settings = SyncSettings(
        token="t",
        state_dir=tmp_path,
        grace=False,
        update_encodings=["int4"],  # type: ignore[list-item]
        merge_first=merge_first,
    )
    sync = Synchronizer(settings)
    sync.join(JoinRequest(learner_id="l0"))
    sync.init(codec.encode({"w": torch.ones(shape)}, {LAYOUT_KEY: layout.model_dump_json()}))
    payload, _ = encodings.encode_update({"w": torch.full(shape, 1e-3)}, META, "int4", 128)
    answers: list[str] = []
    poster = threading.Thread(target=lambda: answers.append(sync.submit(payload, 0).status))
    with sync.computing:  # a merge computing
        poster.start()
        poster.join(0.6)
        assert answers == ([] if merge_first else ["accepted"])
    poster.join(10)
    assert answers == ["accepted"]
    sync.close()


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_a_learners_second_quantized_update_in_a_round_adds_the_floats_it_stands_for(
    tmp_path: Path, encoding: str
) -> None:
    """Two updates of one learner in one round are summed into its contribution (the
    second from the float32 admission made of it): the same bits as the same two updates
    sent as float32, live and after a restart's replay."""
    live = sync_with(tmp_path / "live", [encoding], merge="rda")
    replayed = sync_with(tmp_path / "replayed", [encoding], merge="rda")
    floats = sync_with(tmp_path / "floats", ["float32"], merge="rda")
    for step in (4, 8):
        meta = META.model_copy(update={"learner_step": step})
        payload, sent = encodings.encode_update(delta(seed=step), meta, encoding, 64)
        as_float, _ = encodings.encode_update(sent, meta, "float32")
        for s, body in ((live, payload), (replayed, payload), (floats, as_float)):
            assert s.submit(body, 0).status == "accepted"
    replayed.close()
    replayed = Synchronizer(replayed.settings)
    for s in (live, replayed, floats):
        assert s.merge(0) == 1
    for k, v in floats.fragments[0].state.params.items():
        assert torch.equal(live.fragments[0].state.params[k], v), k
        assert torch.equal(replayed.fragments[0].state.params[k], v), k


@pytest.mark.parametrize("encoding", ["int8", "int4"])
def test_a_merge_that_replaced_a_learners_quantized_term_replays_to_the_served_bits(
    tmp_path: Path, encoding: str
) -> None:
    """l1, l2, then l1 again in one round: l1's term in the round's sum (from the float32
    admission dequantized) is replaced; the merge takes the sum and is journaled. A crash
    (the writer stopped, the object dropped) and a restart: the replay forms the sum again
    from the log's codes, in the log's order, and serves the same bits under the same
    version (a replay that differed would take one version more)."""
    live = sync_with(tmp_path, [encoding], merge="rda")
    assert live.snapshots is not None
    live.snapshots.abandon()  # the file stays behind the served version
    for lid, step, seed in (("l1", 4, 1), ("l2", 4, 2), ("l1", 8, 3)):
        live.join(JoinRequest(learner_id=lid))
        meta = META.model_copy(update={"learner_id": lid, "learner_step": step})
        payload, _ = encodings.encode_update(delta(seed=seed), meta, encoding, 64)
        assert live.submit(payload, 0).status == "accepted"
    assert live.fragments[0].sum.valid and len(live.fragments[0].sum.keys) == 2
    assert live.merge(0) == 1
    assert [r.stream for r in live.fragments[0].journal.records()] == [True]
    served = {k: v.clone() for k, v in live.fragments[0].state.params.items()}
    again = Synchronizer(live.settings)
    assert again.versions() == [1]
    for k, v in served.items():
        assert torch.equal(again.fragments[0].state.params[k], v), k
