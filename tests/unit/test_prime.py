"""Buffers a fragment's first merges and uploads take, made when the layout is adopted
(synchronizer/prefault.py): the pools' `prime`, and the synchronizer priming at init and at
a restart, so that its first merge computes in buffers already touched.

    pytest tests/unit/test_prime.py
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ddiloco.synchronizer.buffers import BODIES, POOL, BytePool, Float32Pool
from ddiloco.synchronizer.prefault import BODY_SLACK, PER_MERGE, adopt, body_size
from ddiloco.synchronizer.served_buffers import KEEP, Served
from ddiloco.wire import codec, encodings
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)
from tests.unit.test_contract import Clock, make

SHAPE = (613, 1019)
"""Fragment 1's one tensor: a shape no other test gives the process-wide `POOL`, and a
bf16 update of it is over one `BODIES` grain (1 MiB)."""
LAYOUT = Layout(
    fragments=[
        FragmentSpec(index=0, embedding=True, tensors=[TensorSpec(name="emb", shape=[4])]),
        FragmentSpec(index=1, tensors=[TensorSpec(name="w", shape=list(SHAPE))]),
    ]
)


def test_float_pool_primes_up_to_count_once_within_its_room() -> None:
    pool = Float32Pool(max_bytes=10 * 5 * 7 * 4)
    assert pool.prime((5, 7), 3) == 3
    assert pool.idle_bytes == 3 * 140
    assert pool.prime((5, 7), 3) == 0  # already idle
    primed = {t.data_ptr() for t in pool.idle[(5, 7)]}
    taken = [pool.take((5, 7)) for _ in range(3)]
    assert {t.data_ptr() for t in taken} == primed
    assert all(bool((t == 0).all()) for t in taken)  # touched: written, not just mapped
    assert pool.prime((5, 7), 20) == 10  # as far as its room goes
    assert pool.idle_bytes == 10 * 140
    assert pool.prime((0, 7), 3) == 0  # nothing to touch


def test_byte_pool_primes_the_capacity_a_body_takes() -> None:
    grain = 1 << 20
    pool = BytePool(max_bytes=5 * grain, grain=grain)
    size = grain + 100  # with its 4 KiB in front: a 2-grain buffer
    assert pool.capacity(size) == 2 * grain
    assert pool.prime(size, 2) == 2
    primed = {id(b) for b in pool.idle[2 * grain]}
    assert pool.prime(size + 1000, 2) == 0  # the same capacity, already idle
    views = [pool.take(size), pool.take(size + 7)]
    assert {id(v.obj) for v in views} == primed
    assert pool.prime(size, 5) == 2  # both taken: 5 grains of room hold 2 more
    assert pool.prime(grain - 5000, 3) == 0  # bodies under a grain are not pooled


def test_served_primes_payload_buffers_its_encodes_reuse() -> None:
    served = Served("bfloat16", 2)
    params = {"w": torch.randn(300, 7)}
    assert served.prime(1, params) == KEEP
    assert served.prime(1, params) == 0
    assert served.prime(5, params) == 0  # no such fragment
    served.encode(1, params)
    served.encode(1, params)
    assert served.reused == 2
    served.encode(1, params)
    assert served.reused == 2  # both primed ones are served now: nothing retired them


def init_body() -> bytes:
    tensors = {"emb": torch.zeros(4), "w": torch.randn(SHAPE) * 0.02}
    return codec.encode(tensors, {LAYOUT_KEY: LAYOUT.model_dump_json()})


def update_body(lid: str, base: int = 0) -> bytes:
    meta = UpdateMeta(
        learner_id=lid,
        fragment=1,
        base_version=base,
        steps=10,
        tokens=100,
        learner_step=1 + base,
        encoding="bfloat16",
    )
    return codec.encode({"w": torch.randn(SHAPE).to(torch.bfloat16) * 1e-3}, meta.to_metadata())


def test_init_primes_what_the_first_merge_takes_and_a_restart_primes_again(
    tmp_path: Path,
) -> None:
    """The merge computes into primed tensors: its new Theta is one of them."""
    POOL.idle.pop(SHAPE, None)
    sync = make(tmp_path, Clock(), update_encodings=["bfloat16"])
    sync.join(JoinRequest(learner_id="a"))
    body = init_body()
    sync.init(body)
    assert sync.primings["served"] == 2 * KEEP and sync.primings["bodies"] == 2
    assert sync.primings["adopted"] == 4  # emb and w, Theta and momentum
    assert sync.primings["pool"] >= PER_MERGE  # and the embedding's, unless idle already
    assert all(f.journal.path.exists() for f in sync.fragments)  # made before the first merge
    primed = {t.data_ptr() for t in POOL.idle[SHAPE]}
    assert len(primed) == PER_MERGE
    sync.submit(update_body("a"))
    assert sync.merge(1) == 1
    assert sync.fragments[1].state.params["w"].data_ptr() in primed
    assert sync.fragments[1].state.momentum["w"].data_ptr() in primed
    sync.close()
    again = make(tmp_path, Clock(), update_encodings=["bfloat16"])
    assert again.primings["served"] == 2 * KEEP  # new payload buffers; the pool's are idle
    again.close()


def test_priming_off_makes_nothing(tmp_path: Path) -> None:
    POOL.idle.pop(SHAPE, None)
    sync = make(tmp_path, Clock(), prime_buffers=False)
    sync.join(JoinRequest(learner_id="a"))
    sync.init(init_body())
    assert sync.primings == {}
    assert SHAPE not in POOL.idle
    assert not any(f.journal.path.exists() for f in sync.fragments)  # the first merge makes it
    sync.close()


def test_a_loaded_state_goes_back_to_the_pool_so_the_second_merge_takes_no_fresh_tensor(
    tmp_path: Path,
) -> None:
    """Theta and momentum as init or a restart loads them move into the pool's tensors
    (the same values), and the first merge's install gives them back, so that the second
    merge computes in them and not in fresh, unfaulted memory (prime.adopt)."""
    POOL.idle.pop(SHAPE, None)
    sync = make(tmp_path, Clock(), update_encodings=["bfloat16"])
    sync.join(JoinRequest(learner_id="a"))
    body = init_body()
    sync.init(body)
    header = codec.read_header(body)
    start = len(body) - header.data_bytes
    w = header.tensors["w"]
    sent = torch.frombuffer(bytearray(body[start + w.begin : start + w.end]), dtype=torch.float32)
    v0 = sync.fragments[1].state
    assert torch.equal(v0.params["w"].reshape(-1), sent)  # the same values, moved
    assert not bool(v0.momentum["w"].any())
    loaded = {v0.params["w"].data_ptr(), v0.momentum["w"].data_ptr()}
    assert loaded <= POOL.ours  # the pool's own: given back when superseded
    known = loaded | {t.data_ptr() for t in POOL.idle[SHAPE]}
    for version in (1, 2):
        sync.submit(update_body("a", base=version - 1))
        assert sync.merge(1) == version
        now = sync.fragments[1].state
        assert {now.params["w"].data_ptr(), now.momentum["w"].data_ptr()} <= known
    sync.close()
    again = make(tmp_path, Clock(), update_encodings=["bfloat16"])
    assert again.primings["adopted"] == 4  # loaded from the files, moved again
    assert again.fragments[1].state.params["w"].data_ptr() in POOL.ours
    again.close()


def test_adopt_moves_float32_tensors_only() -> None:
    bf16 = torch.randn(10).to(torch.bfloat16)
    f32 = torch.randn(3, 4)
    tensors = {"a": bf16, "b": f32.clone(), "c": torch.zeros(0)}
    assert adopt(tensors) == 1
    assert tensors["a"] is bf16  # not the pool's kind: left where it is
    assert torch.equal(tensors["b"], f32) and tensors["b"].data_ptr() in POOL.ours
    POOL.give([tensors["b"]])


@pytest.mark.parametrize("encoding", ["float32", "bfloat16", "int8", "int4"])
def test_a_body_is_primed_at_the_capacity_its_encoding_takes(encoding: str) -> None:
    """A quantized update's body is held until its merge as a float one's is (its codes are
    read there), so priming makes bodies for every accepted encoding; the size it assumes
    takes the same buffer capacity as a learner's real payload at the default block."""
    shapes = [(1500, 1024), (1024,), (333, 777)]
    delta = {f"t{i}": torch.randn(s) * 1e-2 for i, s in enumerate(shapes)}
    meta = UpdateMeta(learner_id="a", fragment=0, base_version=0, steps=1, tokens=1, learner_step=1)
    payload, _ = encodings.encode_update(delta, meta, encoding)
    guess = body_size([t.numel() for t in delta.values()], encoding)
    assert 0 <= guess - len(payload) <= BODY_SLACK
    assert BODIES.capacity(guess) == BODIES.capacity(len(payload))
