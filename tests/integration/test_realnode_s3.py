"""Which address of the host a pod on the k8senv real node reaches an S3 server at.

    python tests/integration/k8senv.py build && python tests/s3server.py build   # once
    .venv/bin/pytest tests/integration/test_realnode_s3.py

The real node (realnode.py) is a network namespace joined to the host by a veth pair: host end
`host_ip` (10.213.<slot>.1), node end `node_ip`; pods sit on a bridge inside the node, and their
default route leads through it to the host end. So a server on the host that pods must reach
listens on `host_ip` (tests/s3server.py: start(dir, hosts=("127.0.0.1", node.host_ip))), and a
pod is given `server.env(host=node.host_ip)`. The host's 127.0.0.1 is not reachable: in a pod,
127.0.0.1 is the pod's own loopback. Both are shown here with the probe image's `get`.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator
from pathlib import Path

import k8senv
import pytest
import realnode
import s3server

from tests.integration.test_realnode import create, logs, pod, wait_phase

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture
def ns(real_plane: k8senv.ControlPlane) -> Iterator[str]:
    """A fresh namespace on the real node's cluster, with its default ServiceAccount."""
    cl = real_plane.home
    name = f"s3-{uuid.uuid4().hex[:8]}"
    cl.api("POST", "/api/v1/namespaces", {"metadata": {"name": name}})
    k8senv.wait_until(
        f"ServiceAccount {name}/default",
        lambda: cl.api("GET", f"/api/v1/namespaces/{name}/serviceaccounts/default"),
        timeout=30,
    )
    try:
        yield name
    finally:
        with contextlib.suppress(OSError):
            cl.api("DELETE", f"/api/v1/namespaces/{name}")


@pytest.fixture
def host_s3(real_plane: k8senv.ControlPlane, tmp_path: Path) -> Iterator[s3server.S3Server]:
    """An S3 server listening on the host's loopback and on the host end of the node's veth."""
    if s3server.find_built() is None:
        pytest.skip(s3server.missing_message())
    node = real_plane.real_node
    assert node is not None
    server = s3server.start(tmp_path, hosts=("127.0.0.1", node.host_ip), access_log=True)
    try:
        yield server
    finally:
        server.stop()


def test_a_pod_reaches_the_host_s3_server_at_the_veth_host_address(
    real_plane: k8senv.ControlPlane, ns: str, host_s3: s3server.S3Server
) -> None:
    node = real_plane.real_node
    assert node is not None
    reachable = host_s3.endpoint_on(node.host_ip) + s3server.HEALTH_PATH
    assert host_s3.env(host=node.host_ip)["AWS_ENDPOINT_URL"] == host_s3.endpoint_on(node.host_ip)
    loopback = f"http://127.0.0.1:{host_s3.port}{s3server.HEALTH_PATH}"
    create(
        real_plane,
        ns,
        pod(
            "veth",
            ("get", ["get", "-expect", "OK", "-tries", "20", reachable]),
        ),
    )
    wait_phase(real_plane, ns, "veth", "Succeeded")
    assert f"get {reachable}: OK" in logs(real_plane, ns, "veth", "get")
    create(real_plane, ns, pod("loopback", ("get", ["get", "-tries", "3", loopback])))
    wait_phase(real_plane, ns, "loopback", "Failed")  # the pod's own loopback: nothing there
    assert realnode.PROBE_IMAGE in node.images()
    print(f"\npods reach the host's S3 server at {node.host_ip}; not at the host's 127.0.0.1")
