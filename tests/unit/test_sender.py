"""An update's parts sent from their own memory (learner/upload_sender.py), against the real
upload port of an in-process synchronizer on loopback: `SyncClient.post_update` of parts
over HTTP/1.1 keeps libcurl's contract.

    pytest tests/unit/test_sender.py

A refusal the port answers before it reads the body is heard as that refusal (not a broken
pipe); a kept-alive connection the server closed is made again; a port with nothing behind
it is `unreached`; a server that never answers is given up on after the client's timeout.
The TLS cases run in tests/e2e/test_tls.py (a learner's uploads over mutual TLS, refusals).
"""

from __future__ import annotations

import socket
import time

import pytest
import torch

from ddiloco.learner.sync_client import SyncClient, SyncRefused, SyncUnavailable
from ddiloco.learner.uploads import with_port
from ddiloco.local.processes import free_port
from ddiloco.synchronizer import upload_port
from ddiloco.wire import codec
from ddiloco.wire.protocol import (
    LAYOUT_KEY,
    FragmentSpec,
    JoinRequest,
    Layout,
    TensorSpec,
    UpdateMeta,
)

N = 1 << 20
LAYOUT = Layout(
    fragments=[FragmentSpec(index=i, tensors=[TensorSpec(name=f"w{i}", shape=[N])]) for i in (0, 1)]
)


def started(make_sync_server):
    server = make_sync_server(quorum=2, grace=False, upload_port=0)
    boss = SyncClient(server.url, server.token)
    boss.join(JoinRequest(learner_id="l0"))
    init = {f"w{i}": torch.zeros(N) for i in (0, 1)}
    boss.init(codec.encode(init, {LAYOUT_KEY: LAYOUT.model_dump_json()}))
    boss.close()
    return server, with_port(server.url, server.sync.upload_port)


def parts(step: int, fragment: int = 0) -> list[bytes | memoryview]:
    meta = UpdateMeta(
        learner_id="l0", fragment=fragment, base_version=0, steps=step, tokens=100 * step,
        learner_step=step,
    )  # fmt: skip
    out = codec.pieces({f"w{fragment}": torch.full((N,), 1e-3 * step)}, meta.to_metadata())
    assert out is not None
    return out


def test_a_refusal_before_the_body_is_heard_not_taken_for_a_broken_pipe(make_sync_server) -> None:
    """The port answers 401 (a wrong token) and 413 (a body over the fragment's size) before
    it reads a byte of the body, then closes: a 64 MB body is not all sent, and the client
    raises the refusal with the server's reason, as libcurl did."""
    server, up = started(make_sync_server)
    big = [bytes(1 << 20), memoryview(bytes(64 << 20))]
    wrong = SyncClient(up, "not-the-token", http2=False, timeout=30, sendmsg=True)
    t0 = time.monotonic()
    with pytest.raises(SyncRefused) as e:
        wrong.post_update(0, big)
    assert (e.value.status, e.value.kind) == (401, "unauthorized")
    over = SyncClient(up, server.token, http2=False, timeout=30, sendmsg=True)
    with pytest.raises(SyncRefused) as e:
        over.post_update(0, big)
    assert e.value.status == 413
    assert time.monotonic() - t0 < 20
    assert over.post_update(0, parts(1)).status == "accepted"  # the client goes on
    assert over.http_version == "HTTP/1.1"


def test_a_kept_alive_connection_the_server_closed_is_made_again(
    make_sync_server, monkeypatch
) -> None:
    """The port closes a connection idle for IDLE_S; the next post finds it closed and is
    sent again on a new one: answered, counted once."""
    monkeypatch.setattr(upload_port, "IDLE_S", 0.3)
    server, up = started(make_sync_server)
    c = SyncClient(up, server.token, http2=False, sendmsg=True)
    assert c.post_update(0, parts(1)).status == "accepted"
    assert c.sender is not None
    first = c.sender.sock
    time.sleep(1.0)  # the server has closed it
    assert c.post_update(1, parts(1, fragment=1)).status == "accepted"
    assert c.sender.sock is not None and c.sender.sock is not first
    assert c.post_update(0, parts(1)).status == "duplicate"  # the same connection again
    body = sum(memoryview(p).nbytes for p in parts(1)) + sum(
        memoryview(p).nbytes for p in parts(1, fragment=1)
    )
    assert c.bytes_up == body + sum(memoryview(p).nbytes for p in parts(1))
    assert server.server.config.app.state.uploads.requests == 3


def test_nothing_listening_is_unreached() -> None:
    c = SyncClient(f"http://127.0.0.1:{free_port()}", "t", http2=False, timeout=5, sendmsg=True)
    with pytest.raises(SyncUnavailable) as e:
        c.post_update(0, [b"x", b"y"])
    assert e.value.unreached


def test_a_server_that_never_answers_is_given_up_after_the_timeout() -> None:
    """A socket that accepts connections (its backlog) and never reads or answers: the post
    fails after the client's timeout as a reachable but failed request, never hangs."""
    with socket.create_server(("127.0.0.1", 0)) as silent:
        port = silent.getsockname()[1]
        c = SyncClient(f"http://127.0.0.1:{port}", "t", http2=False, timeout=1.5, sendmsg=True)
        t0 = time.monotonic()
        with pytest.raises(SyncUnavailable) as e:
            c.post_update(0, [b"head", memoryview(bytes(32 << 20))])
        assert not e.value.unreached
        assert 1.0 < time.monotonic() - t0 < 10
