"""A job across two regions on real nodes: region-a's learner reaches the synchronizer in home
only over a shaped wide-area link, and the link is cut and healed.

    python tests/integration/k8senv.py build      # kubelet, containerd, CoreDNS, ... (once)
    python tests/integration/image.py build       # the image (once per project change)
    .venv/bin/pytest tests/integration/test_realnode_regions.py -s

The plane is conftest's `real_regions`: clusters home and region-a, a real node each, region-a
joined to home by wanlink.RegionLink (50mbit each way by tbf, 40 ms round trip by a delaying
relay; no other route between the regions). What a user does to run across regions, done
here the same way: the synchronizer is exposed by a NodePort Service of the user's (the main
port and the upload port), the link's home side forwards both ports to it (the load balancer
in front of the NodePorts), the remote group names that address in its https syncUrl, and the
operator (a process on the home cluster's kubeconfig, as in test_operator_*.py) reaches
region-a through a kubeconfig Secret. TLS is mutual: the operator issues the server
certificate (with the link's address among its names) and one client certificate per learner
slot, in the slot's cluster. The tests run in file order and share one job. Measured times
are printed (`-s`), never asserted; timeouts only end a broken run.
"""

from __future__ import annotations

import base64
import contextlib
import importlib.util
import json
import ssl
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import k8senv
import operator_helpers as h
import pytest
import yaml

from ddiloco.wire import tls as x

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

if "image" not in sys.modules:  # image.py sits beside k8senv.py; loaded by path like it
    _spec = importlib.util.spec_from_file_location("image", Path(__file__).with_name("image.py"))
    assert _spec is not None and _spec.loader is not None
    sys.modules["image"] = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(sys.modules["image"])
import image  # noqa: E402

JOB = "wan"
REMOTE = "region-a"
MAIN_NODE_PORT, UPLOAD_NODE_PORT = 30470, 30471
MAIN_PORT, UPLOAD_PORT = 8470, 8471  # the synchronizer's ports: the link's home side uses them
LIVENESS_S = 10.0  # the synchronizer's default liveness window (synchronizer/config.py)


@dataclass
class Wan:
    """What the tests share: the plane, the namespace, the operator, the link's address."""

    plane: Any
    ns: str
    image: str
    operator: h.Operator
    sync_url: str
    status_url: str
    figures: dict[str, float] = field(default_factory=dict)
    _ctx: ssl.SSLContext | None = None

    @property
    def link(self) -> Any:
        return self.plane.links[REMOTE]

    def kubectl(self, cluster: str, *args: str) -> Any:
        out = self.plane.kubectl(cluster, "-n", self.ns, *args, "-o", "json").stdout
        return json.loads(out)

    def job(self) -> dict[str, Any]:
        return dict(self.kubectl("home", "get", "ddj", JOB))

    def learner_pods(self, cluster: str) -> list[dict[str, Any]]:
        sel = f"ddiloco.dev/job={JOB},app.kubernetes.io/component=learner"
        pods = self.kubectl(cluster, "get", "pods", "-l", sel)["items"]
        return [p for p in pods if not p["metadata"].get("deletionTimestamp")]

    def secret(self, name: str) -> dict[str, bytes]:
        data = self.kubectl("home", "get", "secret", name)["data"]
        return {k: base64.b64decode(v) for k, v in data.items()}

    def status(self) -> dict[str, Any]:
        """The synchronizer's GET /v1/status through the home NodePort, as the operator reads
        it: the job's key as bearer, TLS verified against the job's trust, and a client
        certificate from the job's CA (mutual TLS)."""
        if self._ctx is None:
            ca = self.secret(f"{JOB}-ca")
            trust = self.secret(f"{JOB}-trust")["ca.crt"].decode()
            client = x.issue_client(x.KeyPair.from_pem(ca["tls.crt"], ca["tls.key"]), "test")
            ctx = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cadata=trust)
            with tempfile.TemporaryDirectory() as d:
                crt, key = x.write_pair(client, Path(d) / "tls.crt", Path(d) / "tls.key")
                ctx.load_cert_chain(crt, key)
            self._ctx = ctx
        token = self.secret(f"{JOB}-token")["token"].decode().split()[0]
        req = urllib.request.Request(
            f"{self.status_url}/v1/status", headers={"Authorization": f"Bearer {token}"}
        )
        with urllib.request.urlopen(req, timeout=5, context=self._ctx) as r:
            return dict(json.load(r))


def learners(status: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {lr["learner_id"]: lr for lr in status["learners"]}


def running_ready(pod: dict[str, Any]) -> bool:
    st = pod.get("status", {})
    conds = {c["type"]: c["status"] for c in st.get("conditions", [])}
    return st.get("phase") == "Running" and conds.get("Ready") == "True"


def import_image(plane: Any, tag: str, tmp: Path) -> None:
    """Our image into each region's node that lacks it: one archive, imported into both
    nodes at once (each import is mostly disk and hashing, minutes for this image)."""
    lacking = [
        cluster
        for cluster, node in plane.real_nodes.items()
        if not any(name.endswith(tag) for name in node.images())
    ]
    if not lacking:
        return
    archive = image.save_archive(tag, tmp / "ddiloco.tar")
    t0 = time.monotonic()
    with ThreadPoolExecutor(len(lacking)) as pool:
        list(pool.map(lambda c: plane.import_image(archive, cluster=c), lacking))
    print(f"\nimage {tag}: imported into {lacking} in {time.monotonic() - t0:.1f}s")
    archive.unlink()


def node_port_service() -> dict[str, Any]:
    """The user's Service exposing the synchronizer to other regions: both ports."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": f"{JOB}-synchronizer-wan"},
        "spec": {
            "type": "NodePort",
            "selector": {
                "ddiloco.dev/job": JOB,
                "app.kubernetes.io/component": "synchronizer",
            },
            "ports": [
                {"name": "http", "port": MAIN_PORT, "nodePort": MAIN_NODE_PORT},
                {"name": "upload", "port": UPLOAD_PORT, "nodePort": UPLOAD_NODE_PORT},
            ],
        },
    }


def job_manifest(tag: str, sync_url: str, home_ip: str) -> dict[str, Any]:
    small = {"requests": {"cpu": "250m", "memory": "512Mi"}, "limits": {"memory": "2Gi"}}
    return {
        "apiVersion": f"{h.GROUP}/{h.VERSION}",
        "kind": "DecoupledDiLoCoJob",
        "metadata": {"name": JOB},
        "spec": {
            "image": tag,
            "imagePullPolicy": "Never",
            "training": {
                "model": "tiny",
                "innerSteps": 24,
                "fragments": 4,
                "overlapSteps": 2,
                "maxSteps": 1_000_000,  # runs until the module ends
            },
            "synchronizer": {
                "quorum": 1,
                "tls": {"mutual": True},
                "externalNames": [home_ip],  # the operator reads its status at the NodePort
                "resources": {"requests": {"cpu": "250m", "memory": "512Mi"}},
                "storage": {"size": "1Gi"},
            },
            "learnerGroups": [
                {"name": "home", "replicas": 1, "resources": small},
                {
                    "name": REMOTE,
                    "replicas": 1,
                    "cluster": {"kubeconfigSecret": {"name": f"{REMOTE}-kubeconfig"}},
                    "syncUrl": sync_url,
                    "resources": small,
                },
            ],
            "failurePolicy": {"maxReplacementsPerSlot": 5, "backoffSeconds": 1},
        },
    }


@pytest.fixture(scope="module")
def wan(real_regions: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Wan]:
    plane = real_regions
    tmp = tmp_path_factory.mktemp("wan")
    tag = image.ensure_image()
    import_image(plane, tag, tmp)
    ns = f"t-wan-{uuid.uuid4().hex[:6]}"
    plane.create_namespace(ns, plane.names)
    # (the plane is the session's: the chart's release in another module may own the CRD)
    plane.kubectl("home", "apply", "--server-side", "--force-conflicts", "-f", str(h.CRD_FILE))
    plane.kubectl(
        "home", "wait", "--for=condition=Established", "--timeout=60s", f"crd/{h.PLURAL}.{h.GROUP}"
    )
    plane.kubectl("home", "-n", ns, "apply", "-f", "-", input=yaml.safe_dump(node_port_service()))
    home_ip = plane.real_node.node_ip
    link = plane.links[REMOTE]
    main = link.expose(MAIN_PORT, home_ip, MAIN_NODE_PORT)
    link.expose(UPLOAD_PORT, home_ip, UPLOAD_NODE_PORT)
    secret = {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": {"name": f"{REMOTE}-kubeconfig"},
        "stringData": {"kubeconfig": h.flat_kubeconfig(plane.clusters[REMOTE])},
    }
    plane.kubectl("home", "-n", ns, "apply", "-f", "-", input=yaml.safe_dump(secret))
    status_url = f"https://{home_ip}:{MAIN_NODE_PORT}"
    op = h.Operator(
        plane.home.kubeconfig,
        ns,
        tmp,
        env={
            "DDILOCO_OPERATOR_STATUS_URL_TEMPLATE": status_url,
            "DDILOCO_OPERATOR_SHARD_URL_TEMPLATE": status_url,
        },
    )
    op.start()
    w = Wan(plane, ns, tag, op, f"https://{main}", status_url)
    try:
        yield w
    finally:
        if w.figures:
            print("\nregions figures: " + json.dumps(w.figures, indent=1))
        link.heal()
        t0 = time.monotonic()
        with contextlib.suppress(Exception):
            plane.kubectl("home", "-n", ns, "delete", "ddj", "--all", "--wait=true",
                          "--timeout=90s", check=False)  # fmt: skip
        print(f"\nregions: the job deleted in {time.monotonic() - t0:.1f}s")
        op.stop()
        for cluster in plane.names:
            plane.kubectl(cluster, "delete", "namespace", ns, "--wait=false", check=False)


# ---------------------------------------------------------------------------------------------
def test_a_job_across_two_regions_merges_both_over_the_link(wan: Wan) -> None:
    t0 = time.monotonic()
    body = job_manifest(wan.image, wan.sync_url, wan.plane.real_node.node_ip)
    wan.plane.kubectl("home", "-n", wan.ns, "apply", "-f", "-", input=yaml.safe_dump(body))

    def both_running() -> bool:
        return all(
            len(pods := wan.learner_pods(c)) == 1 and running_ready(pods[0])
            for c in ("home", REMOTE)
        )

    k8senv.wait_until("a learner pod Running and Ready in each region", both_running, 240)
    remote = wan.learner_pods(REMOTE)[0]
    assert remote["spec"]["nodeName"] == wan.plane.real_nodes[REMOTE].name
    assert remote["status"]["containerStatuses"][0]["containerID"].startswith("containerd://")
    env = {e["name"]: e.get("value") for e in remote["spec"]["containers"][0]["env"]}
    assert env["DDILOCO_SYNC_URL"] == wan.sync_url, env["DDILOCO_SYNC_URL"]
    # its own client certificate, issued into its cluster (mutual TLS)
    secrets = wan.kubectl(REMOTE, "get", "secrets")["items"]
    assert any(s["metadata"]["name"].endswith("-client") for s in secrets), secrets

    def both_merged() -> dict[str, Any] | None:
        s = wan.status()
        got = learners(s)
        ok = all(got.get(lid, {}).get("contributions", 0) > 0 for lid in ("home-0", "region-a-0"))
        return s if ok and s["global_version"] >= 4 else None

    s = k8senv.wait_until("merges with both regions' contributions", both_merged, 300)
    wan.figures["apply_to_both_regions_merged_s"] = round(time.monotonic() - t0, 1)
    counts = {lid: lr["contributions"] for lid, lr in learners(s).items()}
    print(f"\nboth regions merged after {time.monotonic() - t0:.1f}s: contributions {counts}")
    up, down = wan.link.bytes_relayed()
    wan.figures["link_bytes_up"], wan.figures["link_bytes_down"] = up, down
    assert up > 0 and down > 0
    # both ports crossed the link: the main one (join, heartbeats, fragments) and the upload one
    assert all(r.connections > 0 for r in wan.link.relays), [
        (r.address, r.connections) for r in wan.link.relays
    ]
    k8senv.wait_until(
        "the job Ready",
        lambda: h.condition(wan.job(), "Ready")["status"] == "True",
        120,
    )


def test_a_cut_link_degrades_the_region_home_goes_on_and_nothing_is_lost(wan: Wan) -> None:
    before = wan.status()
    lr0 = learners(before)["region-a-0"]
    remote_uid = wan.learner_pods(REMOTE)[0]["metadata"]["uid"]
    t_cut = time.monotonic()
    wan.link.cut()
    try:
        try:
            job = k8senv.wait_until(
                "the job Degraded for region-a",
                lambda: (
                    (j := wan.job())
                    and h.condition(j, "Degraded")["reason"] == "LearnerGroupUnheard"
                    and j
                ),
                LIVENESS_S + 60,
            )
        except TimeoutError as e:  # what the operator and the synchronizer said meanwhile
            conds = wan.job().get("status", {}).get("conditions")
            raise TimeoutError(f"{e}\n{conds}\n{learners(wan.status())}") from None
        wan.figures["cut_to_degraded_s"] = round(time.monotonic() - t_cut, 1)
        message = h.condition(job, "Degraded")["message"]
        assert f"learner group {REMOTE}" in message and "learner group home" not in message
        assert job["status"]["phase"] == "Degraded"
        # (updates already past the cut when it fell may still have landed; from here on the
        # link is silent: region-a's contributions stay where they are until the heal)
        cut = wan.status()
        lr_cut = learners(cut)["region-a-0"]
        home_cut = learners(cut)["home-0"]
        assert lr_cut["alive"] is False
        # the home region never waits: merges go on, with home's contributions, during the cut
        during = k8senv.wait_until(
            "merges at home during the cut",
            lambda: (
                (s := wan.status())["global_version"] >= cut["global_version"] + 2
                and learners(s)["home-0"]["contributions"] > home_cut["contributions"]
                and s
            ),
            60,
        )
        assert learners(during)["region-a-0"]["alive"] is False
        assert learners(during)["region-a-0"]["contributions"] == lr_cut["contributions"]
        left = LIVENESS_S * 2 - (time.monotonic() - t_cut)
        if left > 0:
            time.sleep(left)  # the cut lasts twice the liveness window
        wan.figures["cut_s"] = round(time.monotonic() - t_cut, 1)
    finally:
        wan.link.heal()
    t_heal = time.monotonic()

    def handed_over() -> dict[str, Any] | None:
        s = wan.status()
        lr = learners(s)["region-a-0"]
        # its updates accepted, and a heartbeat since (the step it reports moved on)
        handed = lr["contributions"] > lr_cut["contributions"] and lr["step"] > lr_cut["step"]
        return s if lr["alive"] and handed else None

    after = k8senv.wait_until("region-a's queued work accepted after the heal", handed_over, 120)
    wan.figures["heal_to_handover_s"] = round(time.monotonic() - t_heal, 1)
    lr1 = learners(after)["region-a-0"]
    # it kept computing through the cut, in the same process (same incarnation, same pod)
    assert lr1["incarnation"] == lr0["incarnation"]
    assert lr1["step"] > lr_cut["step"]
    assert wan.learner_pods(REMOTE)[0]["metadata"]["uid"] == remote_uid
    # nothing accepted is lost: every count only grew
    assert after["global_version"] > before["global_version"]
    assert after["tokens_merged"] >= before["tokens_merged"]
    for lid, lr in learners(before).items():
        assert learners(after)[lid]["contributions"] >= lr["contributions"], lid
    print(
        f"\ncut {wan.figures['cut_s']}s: Degraded after {wan.figures['cut_to_degraded_s']}s; "
        f"region-a steps {lr_cut['step']} -> {lr1['step']}, contributions "
        f"{lr_cut['contributions']} -> {lr1['contributions']}; versions "
        f"{before['global_version']} -> {after['global_version']}"
    )
    k8senv.wait_until(
        "the job Ready again",
        lambda: h.condition(wan.job(), "Ready")["status"] == "True",
        90,
    )
    wan.figures["heal_to_ready_s"] = round(time.monotonic() - t_heal, 1)
    assert h.condition(wan.job(), "Degraded")["status"] == "False"
    assert wan.operator.running()
