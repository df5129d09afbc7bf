"""wanlink: the wide-area link between the home region and a remote region of k8senv.

A remote region's real node (realnode.py) reaches the home region only through this link:

* a second veth pair, host end `ddkw<slot>` 10.215.<slot>.1/30, node end `wan0`
  10.215.<slot>.2/30 (slot = the node's address slot), with a `tbf` qdisc on both ends: the
  kernel holds each direction to the link's rate. The node masquerades what its pods send out
  of `wan0`, so replies come back over the same shaped pair.
* a relay on the host end (`expose`, local/netcut.py's CutProxy): a TCP port of 10.215.<slot>.1
  forwarded to an address of the home region (a NodePort of the home node), each direction
  delayed by half the round trip (this kernel has no netem; latency comes from user space). Nothing else routes between the
  regions: the nodes' network namespaces have no route to each other.
* `cut()` drops every packet on `wan0` inside the node's namespace (iptables), both ways: open
  connections stall and retransmit, new ones time out, as on a link that went dark; `heal()`
  lets packets through again, and TCP resumes where it stopped.

    link = RegionLink(node, LinkSpec.parse("50mbit,40ms"))
    link.create()                                  # after node.create_network()
    url = link.expose(8470, home_node.node_ip, 30470)   # "10.215.1.1:8470" for the remote pods
    link.cut(); link.heal()
    link.close()

The namespace, the veth pair and the iptables rules go with the node; `close()` stops the relays.
Root, `ip`, `tc` (sch_tbf) and `iptables` are needed, like realnode.py.
"""

from __future__ import annotations

import importlib.util
import logging
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from realnode import RealNode

    from ddiloco.local.netcut import CutProxy

log = logging.getLogger("k8senv.wanlink")

HOST_LINK_PREFIX: Final = "ddkw"
NODE_LINK: Final = "wan0"
_RATE: Final = re.compile(r"(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)", re.IGNORECASE)
_RATE_UNIT: Final = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}


@dataclass(frozen=True)
class LinkSpec:
    """A link's rate (tc's spelling, e.g. "50mbit", each direction) and round-trip time."""

    rate: str
    rtt_ms: float

    @classmethod
    def parse(cls, text: str) -> LinkSpec:
        """`RATE,RTT`, e.g. "50mbit,40ms" (RTT in ms, the unit optional)."""
        rate, _, rtt = text.partition(",")
        rate, rtt = rate.strip().lower(), rtt.strip().lower().removesuffix("ms")
        if not _RATE.fullmatch(rate) or not rtt:
            raise ValueError(f"link {text!r}: expected RATE,RTT such as 50mbit,40ms")
        spec = cls(rate, float(rtt))
        if spec.bits_per_s <= 0 or spec.rtt_ms < 0:
            raise ValueError(f"link {text!r}: the rate must be > 0 and the RTT >= 0")
        return spec

    @property
    def bits_per_s(self) -> float:
        m = _RATE.fullmatch(self.rate)
        assert m is not None
        return float(m.group(1)) * _RATE_UNIT[m.group(2).lower()]

    def __str__(self) -> str:
        return f"{self.rate},{self.rtt_ms:g}ms"


def _netcut() -> ModuleType:
    """local/netcut.py (the relay; standard library only), loaded by path once: k8senv.py runs
    on a bare Python, where the project is not installed."""
    if (mod := sys.modules.get("netcut")) is None:
        path = Path(__file__).resolve().parents[2] / "local" / "netcut.py"
        spec = importlib.util.spec_from_file_location("netcut", path)
        assert spec is not None and spec.loader is not None
        mod = sys.modules["netcut"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
    return mod


def _run(*argv: str) -> str:
    p = subprocess.run(list(argv), capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise RuntimeError(f"wanlink: `{' '.join(argv)}` failed: {p.stderr.strip()}")
    return p.stdout


def tbf_args(spec: LinkSpec) -> list[str]:
    """`tc qdisc ... tbf` arguments: the rate, a burst of 10 ms at that rate (at least 16 KiB:
    a GSO packet larger than it is segmented by tbf), a queue of 50 ms."""
    burst = max(16 * 1024, int(spec.bits_per_s / 8 * 0.010))
    return ["tbf", "rate", spec.rate, "burst", str(burst), "latency", "50ms"]


class RegionLink:
    """The link of one remote region's real node to the home region (see the module doc).

    State: the node, the spec, the relays `expose` started, whether the link is cut.
    """

    def __init__(self, node: RealNode, spec: LinkSpec) -> None:
        self.node, self.spec = node, spec
        self.relays: list[CutProxy] = []
        self.is_cut = False
        self.cuts = 0

    @property
    def slot(self) -> int:
        assert self.node.slot is not None, "the node's create_network() first"
        return self.node.slot.index

    @property
    def host_ip(self) -> str:
        """The home side of the link: where the remote region's pods reach exposed ports."""
        return f"10.215.{self.slot}.1"

    @property
    def node_ip(self) -> str:
        return f"10.215.{self.slot}.2"

    @property
    def host_link(self) -> str:
        return f"{HOST_LINK_PREFIX}{self.slot}"

    def create(self) -> None:
        """The shaped veth pair, its addresses, and masquerading out of it in the node."""
        pid = str(self.node.holder_pid)
        _run("ip", "link", "add", self.host_link, "type", "veth",
             "peer", "name", NODE_LINK, "netns", pid)  # fmt: skip
        _run("ip", "addr", "add", f"{self.host_ip}/30", "dev", self.host_link)
        _run("ip", "link", "set", self.host_link, "up")
        _run("tc", "qdisc", "add", "dev", self.host_link, "root", *tbf_args(self.spec))
        self.node.run("ip", "addr", "add", f"{self.node_ip}/30", "dev", NODE_LINK)
        self.node.run("ip", "link", "set", NODE_LINK, "up")
        self.node.run("tc", "qdisc", "add", "dev", NODE_LINK, "root", *tbf_args(self.spec))
        self.node.run("iptables", "-t", "nat", "-A", "POSTROUTING", "-o", NODE_LINK,
                      "-j", "MASQUERADE")  # fmt: skip
        log.info("wanlink: %s <-> %s (%s) for %s", self.host_ip, self.node_ip, self.spec,
                 self.node.name)  # fmt: skip

    def expose(self, port: int, target_host: str, target_port: int) -> str:
        """Relay host_ip:port (0: any free port) over the link to target; returns
        "host:port", the address the remote region's pods use."""
        relay: CutProxy = _netcut().CutProxy(
            target_port,
            target_host,
            listen_host=self.host_ip,
            listen_port=port,
            delay_s=self.spec.rtt_ms / 2000,
        )
        relay.start()
        self.relays.append(relay)
        return relay.address

    def _rules(self, op: str) -> None:
        for chain, flag in (
            ("INPUT", "-i"),
            ("OUTPUT", "-o"),
            ("FORWARD", "-i"),
            ("FORWARD", "-o"),
        ):
            self.node.run("iptables", op, chain, flag, NODE_LINK, "-j", "DROP")

    def cut(self) -> None:
        """Drop every packet on the link, both ways, until heal()."""
        if not self.is_cut:
            self._rules("-I")
            self.is_cut, self.cuts = True, self.cuts + 1

    def heal(self) -> None:
        if self.is_cut:
            self._rules("-D")
            self.is_cut = False

    def bytes_relayed(self) -> tuple[int, int]:
        """(toward home, toward the region) over all relays, closed connections included."""
        up = sum(r.bytes_to_target for r in self.relays)
        down = sum(r.bytes_to_client for r in self.relays)
        return up, down

    def close(self) -> None:
        """Stop the relays (the veth pair and the rules go with the node's namespace)."""
        for r in self.relays:
            r.close()
        self.relays.clear()
        subprocess.run(["ip", "link", "del", self.host_link], capture_output=True, check=False)
