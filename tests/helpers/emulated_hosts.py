"""Peers on emulated hosts: one Linux network namespace per host, with an address of its own, joined to a bridge.

Each host is a namespace with one veth link (``eth0``) to a bridge that lives in a namespace of its own (the
switch), so that the test's traffic never touches the machine's own namespace. Links can be shaped with ``tbf`` in
both directions, to emulate a host's uplink and downlink. A router namespace that masquerades (``iptables``) can put
hosts behind NAT. Addresses come from 198.18.0.0/15, reserved for benchmarking networks (RFC 2544): public hosts
are in 198.18.0.0/24, and each host behind NAT shares a /24 of 198.19.0.0/16 with its router. No namespace has a
route beyond these networks, so nothing can reach any other address.

Namespace names carry this test session's mark (see tests/conftest.py), so that the suite's leftover check finds
ours and never touches another run's. Everything is removed when the :class:`EmulatedHosts` context ends, processes
still running in its namespaces included.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import signal
import subprocess
import uuid
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Optional, Sequence

from lightning_swarm.launch import LocalSwarm, Peer

PUBLIC_NET = ipaddress.ip_network("198.18.0.0/24")
PRIVATE_NETS = ipaddress.ip_network("198.19.0.0/16")  # one /24 per host behind NAT
NETNS_PREFIX = "lsw"  # every namespace of this suite's: lsw-<session>-<hosts>-<name>
PORT = 31337  # libp2p's port on every host: each host has its own addresses, so the same port never collides


@cache
def session_prefix() -> str:
    """The start of the names of this test session's namespaces (of this process's, outside the suite)."""
    mark = os.environ.get("LIGHTNING_SWARM_TEST_SESSION") or uuid.uuid4().hex
    return f"{NETNS_PREFIX}-{mark[:8]}-"


def namespaces(prefix: str) -> list[str]:
    """Existing network namespaces whose name starts with ``prefix``."""
    listing = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, timeout=30).stdout
    return [line.split()[0] for line in listing.splitlines() if line.startswith(prefix)]


def remove_namespace(name: str) -> None:
    """Kill every process left in namespace ``name``, then delete it (its links go with it)."""
    pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30).stdout.split()
    for pid in pids:
        try:
            os.kill(int(pid), signal.SIGKILL)
        except ProcessLookupError:
            pass
    subprocess.run(["ip", "netns", "del", name], capture_output=True, timeout=30)


@cache
def unavailable_reason(nat: bool = False) -> Optional[str]:
    """Why emulated hosts (with ``nat``: and NAT) cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    for tool in ("ip", "tc", *(("iptables",) if nat else ())):
        if shutil.which(tool) is None:
            hint = " (Debian: apt-get install iptables)" if tool == "iptables" else ""
            return f"emulated hosts need the {tool!r} command{hint}"
    probe = f"{session_prefix()}probe{os.getpid()}"
    try:
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=30)
        if made.returncode != 0:
            return f"cannot create a network namespace: {made.stderr.strip()}"
        if nat:
            masquerade = ["iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "lo", "-j", "MASQUERADE"]
            tried = subprocess.run(
                ["ip", "netns", "exec", probe, *masquerade], capture_output=True, text=True, timeout=30
            )
            if tried.returncode != 0:
                return f"iptables cannot masquerade in a network namespace: {tried.stderr.strip()}"
        return None
    finally:
        remove_namespace(probe)


@dataclass
class Host:
    """An emulated machine: its namespace, its address, the rate its link is shaped to (None: unshaped), and the
    router it sits behind (None: on the public network)."""

    name: str
    netns: str
    ip: str
    rate_mbit: Optional[float] = None
    router: Optional[str] = None

    def command(self) -> list[str]:
        """The prefix that runs a command on this host."""
        return ["ip", "netns", "exec", self.netns]

    @property
    def maddr(self) -> str:
        """The multiaddr its peer listens on (and announces, when reachable)."""
        return f"/ip4/{self.ip}/tcp/{PORT}"

    @property
    def behind_nat(self) -> bool:
        return self.router is not None

    def link_bytes(self) -> int:
        """Bytes its link (``eth0``) carried so far, sent and received together, as its namespace counts them."""
        stats = "/sys/class/net/eth0/statistics"
        command = [*self.command(), "cat", f"{stats}/tx_bytes", f"{stats}/rx_bytes"]
        done = subprocess.run(command, capture_output=True, text=True, timeout=30, check=True)
        return sum(int(count) for count in done.stdout.split())


@dataclass
class EmulatedHosts:
    """Hosts on one emulated network. Use it as a context manager: leaving it removes every namespace it made."""

    tag: str = field(default_factory=lambda: uuid.uuid4().hex[:6])
    hosts: dict[str, Host] = field(default_factory=dict)
    _made: list[str] = field(default_factory=list)
    _public: int = 0  # addresses given out on the public network
    _private: int = 0  # private networks given out behind routers

    @property
    def switch(self) -> str:
        return f"{session_prefix()}{self.tag}-switch"

    def __enter__(self) -> EmulatedHosts:
        reason = unavailable_reason()
        if reason:
            raise RuntimeError(reason)
        try:
            self._add_namespace(self.switch)
            self._ip(self.switch, "link", "add", "br0", "type", "bridge")
            self._ip(self.switch, "link", "set", "br0", "up")
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for name in reversed(self._made):
            remove_namespace(name)
        self._made.clear()

    def add_host(self, name: str, rate_mbit: Optional[float] = None) -> Host:
        """A host on the public network, its link shaped to ``rate_mbit`` each way (None: unshaped)."""
        ip = self._public_ip()
        host = self.hosts[name] = Host(name, self._add_namespace(f"{session_prefix()}{self.tag}-{name}"), ip, rate_mbit)
        self._plug(host.netns, "eth0", ip, PUBLIC_NET.prefixlen, rate_mbit)
        return host

    def add_nat(self, name: str, router: str = "router", rate_mbit: Optional[float] = None) -> Host:
        """A host behind a router that masquerades (made on first use, its link to the public network shaped to
        ``rate_mbit``): the host can open connections to the public hosts, which cannot open any to it. Each such
        host has a private network of its own with the router, 198.19.<n>.0/24."""
        router_ns = f"{session_prefix()}{self.tag}-{router}"
        if router_ns not in self._made:
            reason = unavailable_reason(nat=True)
            if reason:
                raise RuntimeError(reason)
            self._add_namespace(router_ns)
            self._plug(router_ns, "eth0", self._public_ip(), PUBLIC_NET.prefixlen, rate_mbit)
            self._exec(router_ns, "sysctl", "-qw", "net.ipv4.ip_forward=1")
            self._exec(router_ns, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0", "-j", "MASQUERADE")
        self._private += 1
        subnet = list(PRIVATE_NETS.subnets(new_prefix=24))[self._private]
        gateway, ip, port = str(subnet[1]), str(subnet[2]), f"p{self._private}"
        netns = self._add_namespace(f"{session_prefix()}{self.tag}-{name}")
        self._ip(router_ns, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        self._ip(router_ns, "addr", "add", f"{gateway}/24", "dev", port)
        self._ip(router_ns, "link", "set", port, "up")
        self._ip(netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        self._ip(netns, "link", "set", "eth0", "up")
        self._ip(netns, "route", "add", "default", "via", gateway)
        host = self.hosts[name] = Host(name, netns, ip, rate_mbit, router)
        return host

    def processes(self) -> list[int]:
        """Processes running in any of these namespaces."""
        found = []
        for name in self._made:
            listing = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True, timeout=30)
            found += [int(pid) for pid in listing.stdout.split()]
        return found

    # ---- plumbing ------------------------------------------------------------------------------------------------

    def _public_ip(self) -> str:
        self._public += 1
        return str(PUBLIC_NET[self._public])

    def _add_namespace(self, name: str) -> str:
        self._run("ip", "netns", "add", name)
        self._made.append(name)
        self._ip(name, "link", "set", "lo", "up")
        return name

    def _plug(self, netns: str, device: str, ip: str, prefixlen: int, rate_mbit: Optional[float]) -> None:
        """Link ``netns`` to the switch's bridge by a veth pair, address it, and shape both directions."""
        port = f"v{len(self._made)}"
        self._ip(self.switch, "link", "add", port, "type", "veth", "peer", "name", device, "netns", netns)
        self._ip(self.switch, "link", "set", port, "master", "br0", "up")
        self._ip(netns, "addr", "add", f"{ip}/{prefixlen}", "dev", device)
        self._ip(netns, "link", "set", device, "up")
        if rate_mbit is not None:
            for where, dev in ((netns, device), (self.switch, port)):  # upload at the host, download at the switch
                self._exec(where, "tc", "qdisc", "add", "dev", dev, "root", *tbf(rate_mbit))

    def _ip(self, netns: str, *args: str) -> None:
        self._run("ip", "-n", netns, *args)

    def _exec(self, netns: str, *command: str) -> None:
        self._run("ip", "netns", "exec", netns, *command)

    @staticmethod
    def _run(*command: str) -> None:
        done = subprocess.run(command, capture_output=True, text=True, timeout=30)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(command)} failed: {done.stderr.strip()}")


def tbf(rate_mbit: float) -> list[str]:
    """``tc`` arguments of a token bucket at ``rate_mbit``: a burst of 10 ms of traffic (at least 64 KB, so that a
    segmentation-offloaded packet fits), and a queue of 50 ms."""
    burst = max(64 * 1024, int(rate_mbit * 1e6 / 8 * 0.01))
    return ["tbf", "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", "50ms"]


class HostSwarm(LocalSwarm):
    """A :class:`~lightning_swarm.launch.LocalSwarm` whose peer ``name`` runs on host ``name`` of ``hosts``: it listens
    on that host's address, announces it when the host is reachable, and newcomers join through the announced
    addresses of the reachable peers only."""

    def __init__(self, hosts: EmulatedHosts, script: Sequence[str], workdir: Path, run_id: str, env: dict) -> None:
        super().__init__(script, workdir, run_id, env)
        self.hosts = hosts

    def start(
        self,
        name: str,
        args: Sequence[str] = (),
        env: Optional[dict] = None,
        wait: float = 120.0,
        script: Optional[Sequence[str]] = None,
        prefix: Sequence[str] = (),
    ) -> Peer:
        """Start peer ``name`` on its host (``prefix``, if given, runs inside the host's namespace)."""
        host = self.hosts.hosts[name]
        placed = {"SWARM_HOST_MADDRS": host.maddr, "SWARM_ANNOUNCE_MADDRS": "" if host.behind_nat else host.maddr}
        return super().start(name, args, {**placed, **(env or {})}, wait, script, [*host.command(), *prefix])

    def initial_peers(self) -> list[str]:
        reachable = [p for name, p in list(self.peers.items()) if not self.hosts.hosts[name].behind_nat]
        return [address for peer in reachable if peer.alive() for address in peer.addresses()]
