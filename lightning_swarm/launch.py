"""Start a swarm of peer processes on this machine: for the demo and for tests.

Each peer runs in its own session (process group), so that stopping it also stops the DHT process and the p2pd
daemon it started, even after ``kill -9`` of the peer itself. Peers that run a script are forked from a template
process that imported torch and Lightning once (:mod:`~lightning_swarm.prefork`): each starts in a fraction of a
second instead of paying those imports.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

from lightning_swarm import prefork

log = logging.getLogger(__name__)

# the kernel list a torch dispatcher error ends with: hundreds of lines that push the error out of a log's tail,
# printed one per line, or escaped inside the repr of an error another peer sent back
_KERNEL_LISTING = re.compile(
    r"(?:^|(?<=\\n))\w+: (?:fallthrough )?registered at \S+ \[[^\]\n]*\](?:\n|\\n)", re.MULTILINE
)


@dataclass
class Peer:
    name: str
    process: Union[subprocess.Popen, prefork.ForkedProcess]
    log_path: Path
    address_path: Path

    def addresses(self) -> list[str]:
        return self.address_path.read_text().split() if self.address_path.exists() else []

    def alive(self) -> bool:
        return self.process.poll() is None

    def log(self) -> str:
        """What the peer printed, without torch's lists of registered kernels."""
        text = self.log_path.read_text(errors="replace") if self.log_path.exists() else ""
        return _KERNEL_LISTING.sub("", text)


class LocalSwarm:
    """Peers on loopback that run ``script`` with the ``SWARM_*`` environment set for them.

    The first peer started creates the swarm; later ones join through the addresses of a live peer.
    Use it as a context manager: leaving it stops every peer's whole process group. ``warm_start``: fork peers that
    run a script from a template process (:mod:`~lightning_swarm.prefork`); False starts each as a fresh interpreter.
    """

    def __init__(
        self,
        script: Sequence[str],
        workdir: Path,
        run_id: str,
        env: Optional[dict] = None,
        warm_start: bool = True,
    ) -> None:
        self.script, self.workdir, self.run_id = list(script), Path(workdir), run_id
        self.env = dict(env or {})
        self.warm_start = warm_start  # fork script peers from a template (prefork); False: fresh interpreters
        self.peers: dict[str, Peer] = {}
        self._previous_sigterm: Optional[Any] = None  # restored on leaving the context
        self.workdir.mkdir(parents=True, exist_ok=True)

    def start(
        self,
        name: str,
        args: Sequence[str] = (),
        env: Optional[dict] = None,
        wait: float = 120.0,
        script: Optional[Sequence[str]] = None,
        prefix: Sequence[str] = (),
    ) -> Peer:
        """Start a peer (running ``script`` instead of the swarm's, if given) and wait (up to ``wait`` seconds)
        until it is reachable. Peers may be started from several threads at once, to have them join together.
        ``prefix`` runs the peer through another command, which must exec it in the same process (``ip netns exec
        NS``: on an emulated host), so that signals and process groups reach the peer itself."""
        address_path = self.workdir / f"{name}.addr"
        address_path.unlink(missing_ok=True)
        peer_env = {**os.environ, **self.env, **(env or {})}
        peer_env.update(SWARM_RUN_ID=self.run_id, SWARM_ADDRESS_FILE=str(address_path), PYTHONUNBUFFERED="1")
        bootstrap = self.initial_peers()
        if bootstrap:
            peer_env["SWARM_INITIAL_PEERS"] = ",".join(bootstrap)
        log_path = self.workdir / f"{name}.log"
        process = self._launch([*(self.script if script is None else script), *args], peer_env, log_path, prefix)
        peer = self.peers[name] = Peer(name, process, log_path, address_path)
        deadline = time.monotonic() + wait
        while not peer.addresses():
            if not peer.alive():
                raise RuntimeError(
                    f"peer {name} exited with {process.returncode} before joining:\n{peer.log()[-3000:]}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(f"peer {name} did not join within {wait:.0f}s:\n{peer.log()[-3000:]}")
            time.sleep(0.2)
        return peer

    def _launch(
        self, command: list[str], env: dict, log_path: Path, prefix: Sequence[str]
    ) -> Union[subprocess.Popen, prefork.ForkedProcess]:
        """Start ``python *command``: forked from a template (:mod:`~lightning_swarm.prefork`) when the command is a
        script and no prefix wraps it, else as a fresh interpreter."""
        if self.warm_start and not prefix and command and command[0].endswith(".py"):
            try:
                return prefork.spawn(command, env, os.getcwd(), str(log_path))
            except prefork.TemplateError as e:
                log.warning("Starting peers as fresh interpreters: %s", e)
                self.warm_start = False
        with open(log_path, "wb") as log_file:
            return subprocess.Popen(
                [*prefix, sys.executable, *command],
                env=env,
                stdout=log_file,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def start_together(self, peers: dict[str, tuple[Sequence[str], Optional[dict]]], wait: float = 120.0) -> list[Peer]:
        """Start several peers at once, ``name: (args, env)`` each as ``start`` does, and wait until all are
        reachable. In an empty swarm the first one starts alone: it creates the swarm that the others join."""
        pending = list(peers.items())
        if not self.initial_peers():
            name, (args, env) = pending.pop(0)
            self.start(name, args, env, wait)
        with ThreadPoolExecutor(max(1, len(pending))) as pool:
            list(pool.map(lambda item: self.start(item[0], *item[1], wait=wait), pending))
        return [self.peers[name] for name in peers]

    def initial_peers(self) -> list[str]:
        """The addresses of every live peer: a newcomer bootstraps through whichever answers."""
        return [address for peer in list(self.peers.values()) if peer.alive() for address in peer.addresses()]

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` to the peer process alone (as a preemption or a crash would)."""
        peer = self.peers[name]
        if peer.alive():
            try:
                os.kill(peer.process.pid, sig)
            except ProcessLookupError:
                pass  # it exited meanwhile (a forked peer is reaped by its template, not here)

    def wait(self, name: str, timeout: float) -> int:
        """Wait for a peer to exit; returns its exit code."""
        return self.peers[name].process.wait(timeout=timeout)

    def stop(self, name: str, grace: float = 10.0) -> None:
        """Stop a peer and everything it started: SIGTERM to the peer (which then stops its own helper processes,
        as on a preemption), SIGKILL to its whole process group after ``grace`` seconds."""
        peer = self.peers[name]
        self.signal(name, signal.SIGTERM)
        try:
            peer.process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
        _signal_group(peer.process.pid, signal.SIGKILL)  # the DHT child and p2pd may outlive the peer itself
        peer.process.wait()

    def stop_all(self, grace: float = 10.0) -> None:
        for name in self.peers:  # all leave at once; signalling the group would kill their DHT processes first
            self.signal(name, signal.SIGTERM)
        for name in self.peers:
            self.stop(name, grace)

    def __enter__(self) -> LocalSwarm:
        if threading.current_thread() is threading.main_thread() and signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
            # a launcher stopped by SIGTERM (timeout, a job scheduler) leaves through __exit__, as on Ctrl-C: its peers
            # run in their own sessions and would outlive it
            self._previous_sigterm = signal.signal(signal.SIGTERM, _exit_on_sigterm)
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.stop_all()
        finally:
            if self._previous_sigterm is not None:
                signal.signal(signal.SIGTERM, self._previous_sigterm)
                self._previous_sigterm = None


def _exit_on_sigterm(signum: int, frame: object) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # one unwinding: a second SIGTERM must not interrupt the stopping
    sys.exit(128 + signum)


def _signal_group(pgid: int, sig: int) -> None:
    try:
        os.killpg(pgid, sig)
    except ProcessLookupError:
        pass
