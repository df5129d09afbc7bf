"""A wide-area link between two network namespaces, made of kernel parts and one relay.

    with WanLink(rate="50mbit", rtt_ms=40) as link:     # needs root and `ip netns`
        server = link.popen("home", [python, "-m", "http.server", "8000"])
        client = link.popen("remote", [python, "fetch.py", f"http://{link.home.ip}:8000/"])
        link.cut()                  # silence: packets both ways are dropped, connections stall
        link.heal()                 # the same connections carry on (TCP retransmits)
        link.set(rate="10mbit")     # change the rate (both directions) in place
        link.counters()             # {"home_to_remote": bytes, "remote_to_home": bytes}

Two sides, `home` and `remote`, each an `ip netns` namespace (created here, or `home` an
existing one passed as `home_ns`, so several links can fan out of one region). They are joined
by a veth pair with addresses `<subnet>.1` (home) and `<subnet>.2` (remote). Each veth end
sends through a `tbf` qdisc at `rate`, so each direction carries at most `rate` (full
duplex, counted in link-layer bytes as tc counts them: TCP payload gets about 95%).

The kernel here has no netem, so the delay is added in user space: every TCP connection
that enters a side over the link is sent by an iptables REDIRECT (nat PREROUTING, that
interface only) to a relay in that side's namespace (local/netcut.py's CutProxy, one per
side, threads of this process), which connects on to the address the connection was for
and holds each chunk rtt_ms / 2 in each direction. A connection thus crosses one relay and
gains rtt_ms in every round trip, whichever side opened it. Any TCP port works (gloo's
ephemeral ports, a NodePort), and processes need no relay address: they dial the other
side's IP. UDP and ICMP are not delayed. TCP's own round trip on the veth stays short, so
window growth and loss recovery are faster than on a real long link.

`cut()` adds iptables DROP rules on both interfaces: bytes stop, open connections stall and
new ones hang, as on a dead route; `heal()` removes them. `cut(reset=True)` also resets every
relayed connection (peers see an error at once). `loss` drops that share of arriving packets
both ways (iptables statistic), and recovers quickly for the reason above.

Processes: `link.popen(side, argv)` starts one inside a side's namespace, and
`link.argv(side, argv)` returns the `ip netns exec` command line for callers who start
processes themselves. Sockets of this process: `with in_netns(link.home.ns): ...`.
`available()` says whether this machine can build a link (root, `ip`, `tc`, `iptables`).

Tests: tests/e2e/test_wanlink.py (rate, round trip, cut and heal, measured).
"""

from __future__ import annotations

import itertools
import json
import os
import re
import shutil
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.local.netcut import CutProxy, in_netns

__all__ = ["Side", "WanLink", "available", "in_netns", "parse_rate"]

_counter = itertools.count()
_UNITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9}


def parse_rate(rate: str) -> float:
    """A tc rate ("50mbit", "2gbit", "800kbit") in bits per second."""
    m = re.fullmatch(r"\s*([0-9.]+)\s*([kmg]?)bit\s*", rate.lower())
    if not m:
        raise ValueError(f"rate must look like 50mbit, 800kbit or 2gbit, got {rate!r}")
    return float(m.group(1)) * _UNITS[m.group(2)]


def available() -> str | None:
    """None when this machine can build a link; else why not, in one line."""
    if os.geteuid() != 0:
        return "needs root (network namespaces, tc and iptables)"
    for tool in ("ip", "tc", "iptables"):
        if shutil.which(tool) is None:
            return f"`{tool}` is not installed"
    probe = f"wanprobe{os.getpid()}"
    done = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if done.returncode != 0:
        return f"`ip netns add` fails: {done.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


@dataclass(frozen=True)
class Side:
    """One end of the link: its namespace, its veth interface and its address."""

    name: str
    """"home" or "remote"."""
    ns: str
    dev: str
    ip: str


def _run(*argv: str) -> None:
    done = subprocess.run(argv, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")


class WanLink:
    """State: the two sides, the relays, whether the link is cut. Created on `__enter__`
    (or `up()`), removed with everything it made on `__exit__` (or `down()`)."""

    def __init__(
        self,
        rate: str = "50mbit",
        rtt_ms: float = 40.0,
        *,
        loss: float = 0.0,
        subnet: str = "10.77.0",
        home_ns: str | None = None,
        tag: str | None = None,
    ) -> None:
        parse_rate(rate)
        if rtt_ms < 0 or not 0.0 <= loss < 1.0:
            raise ValueError(f"rtt_ms must be >= 0 and loss in [0, 1), got {rtt_ms}, {loss}")
        tag = tag or f"w{os.getpid() % 100000}x{next(_counter)}"
        self.rate, self.rtt_ms, self.loss = rate, rtt_ms, loss
        self.own_home = home_ns is None
        self.home = Side("home", home_ns or f"{tag}-home", f"{tag}h", f"{subnet}.1")
        self.remote = Side("remote", f"{tag}-remote", f"{tag}r", f"{subnet}.2")
        self.relays: dict[str, CutProxy] = {}
        self.is_cut = False
        self.made: list[str] = []
        """Namespaces this link created (and removes)."""

    # --- lifecycle ---
    def __enter__(self) -> WanLink:
        self.up()
        return self

    def __exit__(self, *exc: object) -> None:
        self.down()

    def up(self) -> None:
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        h, r = self.home, self.remote
        for side in (h, r):
            if side is r or self.own_home:
                _run("ip", "netns", "add", side.ns)
                self.made.append(side.ns)
            # the relay dials the local address through lo
            _run("ip", "-n", side.ns, "link", "set", "lo", "up")
        _run("ip", "link", "add", h.dev, "type", "veth", "peer", "name", r.dev)
        for side in (h, r):
            _run("ip", "link", "set", side.dev, "netns", side.ns)
            _run("ip", "-n", side.ns, "addr", "add", f"{side.ip}/24", "dev", side.dev)
            _run("ip", "-n", side.ns, "link", "set", side.dev, "up")
            self._shape(side, "add")
        delay = self.rtt_ms / 2000.0
        for side in (h, r):
            relay = CutProxy(None, listen_host="0.0.0.0", netns=side.ns, delay_s=delay)
            relay.start()
            self.relays[side.name] = relay
            self._iptables(
                side, "-t", "nat", "-A", "PREROUTING", "-i", side.dev, "-p", "tcp",
                "-j", "REDIRECT", "--to-ports", str(relay.port),
            )  # fmt: skip
            if self.loss > 0:
                self._iptables(
                    side, "-A", "INPUT", "-i", side.dev, "-m", "statistic", "--mode", "random",
                    "--probability", f"{self.loss:.6f}", "-j", "DROP",
                )  # fmt: skip

    def down(self) -> None:
        """Remove what `up` made: relays, the veth pair, the namespaces created here (a
        namespace passed in as `home_ns` stays, with the rules of this link removed)."""
        for relay in self.relays.values():
            relay.close()
        self.relays = {}
        if not self.own_home:
            subprocess.run(
                ["ip", "-n", self.home.ns, "link", "del", self.home.dev], capture_output=True
            )
            for table in ("nat", "filter"):
                self._drop_rules_of(self.home, table)
        for ns in reversed(self.made):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.made = []

    # --- what a test or a bench does with it ---
    def argv(self, side: str, argv: Sequence[str]) -> list[str]:
        """`argv` run inside `side`'s namespace ("home" or "remote")."""
        return ["ip", "netns", "exec", self.side(side).ns, *argv]

    def popen(self, side: str, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside `side`'s namespace; kwargs go to subprocess.Popen. `ip netns
        exec` execs the command, so the process's pid is the command's own."""
        return subprocess.Popen(self.argv(side, argv), **kwargs)

    def side(self, name: str) -> Side:
        if name not in ("home", "remote"):
            raise ValueError(f"side must be home or remote, got {name!r}")
        return self.home if name == "home" else self.remote

    def cut(self, *, reset: bool = False) -> None:
        """Drop every packet arriving over the link, both ways; `reset` also aborts every
        relayed connection (its peers see a reset)."""
        if not self.is_cut:
            for side in (self.home, self.remote):
                self._iptables(side, "-I", "INPUT", "1", "-i", side.dev, "-j", "DROP")
            self.is_cut = True
        if reset:
            for relay in self.relays.values():
                relay.cut()
                relay.restore()  # resets what was open; what dials after the heal passes

    def heal(self) -> None:
        if self.is_cut:
            for side in (self.home, self.remote):
                self._iptables(side, "-D", "INPUT", "-i", side.dev, "-j", "DROP")
            self.is_cut = False

    def set(self, *, rate: str | None = None, rtt_ms: float | None = None) -> None:
        """Change the rate and/or the round trip of the running link (new chunks only)."""
        if rate is not None:
            parse_rate(rate)
            self.rate = rate
            for side in (self.home, self.remote):
                self._shape(side, "change")
        if rtt_ms is not None:
            self.rtt_ms = rtt_ms
            for relay in self.relays.values():
                relay.delay_s = rtt_ms / 2000.0

    def counters(self) -> dict[str, int]:
        """Bytes sent over the link so far, per direction (link layer, the veth's counters)."""
        return {
            "home_to_remote": self._tx_bytes(self.home),
            "remote_to_home": self._tx_bytes(self.remote),
        }

    # --- kernel parts ---
    def _shape(self, side: Side, verb: str) -> None:
        bps = parse_rate(self.rate)
        # a burst of 5 ms of traffic (at least a few full frames), a queue of 50 ms
        burst = max(int(bps / 8 * 0.005), 15_000)
        _run(
            "tc", "-n", side.ns, "qdisc", verb, "dev", side.dev, "root", "tbf",
            "rate", self.rate, "burst", str(burst), "latency", "50ms",
        )  # fmt: skip

    def _iptables(self, side: Side, *args: str) -> None:
        _run("ip", "netns", "exec", side.ns, "iptables", "-w", *args)

    def _drop_rules_of(self, side: Side, table: str) -> None:
        """Delete the rules of `table` in `side`'s namespace that name this link's device."""
        done = subprocess.run(
            ["ip", "netns", "exec", side.ns, "iptables", "-w", "-t", table, "-S"],
            capture_output=True,
            text=True,
        )
        for line in done.stdout.splitlines():
            if line.startswith("-A ") and f"-i {side.dev} " in f"{line} ":
                rule = line[3:].split()
                subprocess.run(
                    ["ip", "netns", "exec", side.ns, "iptables", "-w", "-t", table, "-D", *rule],
                    capture_output=True,
                )

    def _tx_bytes(self, side: Side) -> int:
        done = subprocess.run(
            ["ip", "-n", side.ns, "-j", "-s", "link", "show", "dev", side.dev],
            capture_output=True,
            text=True,
            check=True,
        )
        return int(json.loads(done.stdout)[0]["stats64"]["tx"]["bytes"])
