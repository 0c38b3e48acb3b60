"""The peer's connection to the swarm: a hivemind DHT, its libp2p daemon and one event loop for RPC.

Every network and DHT call made through :class:`SwarmNode` carries a timeout, so a dead DHT process or an
unreachable peer surfaces as an exception instead of a hang.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import os
import re
import shutil
import signal
import tempfile
import threading
import time
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

from hivemind.dht import DHT
from hivemind.dht.validation import RecordValidatorBase
from hivemind.p2p import P2P, P2PDaemonError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.multiaddr import Multiaddr

from lightning_swarm import security
from lightning_swarm.errors import JoinError
from lightning_swarm.security import AccessPolicy

log = logging.getLogger(__name__)
T = TypeVar("T")

LOOPBACK_MADDRS = ("/ip4/127.0.0.1/tcp/0",)


class _OrphansDropped:
    """The DHT process's end of its request pipe, that drops a request whose sender exited before it was read.

    A request carries the sender's end of a pipe for its answer, which the DHT process fetches from the sender (by
    multiprocessing's resource sharer) as it reads the request. A process that exits with requests still queued (an
    averager shut down while it looked for a group, on a rebalancing move) leaves requests that cannot be read:
    hivemind then sleeps its RPC wait timeout (3 s) per request, and every request behind them waits; a peer whose
    averagers left a dozen saw its DHT calls time out for minutes, its record expire, and the others leave it. Nobody
    waits for those answers, so they are dropped at once."""

    def __init__(self, pipe: Any) -> None:
        self._pipe = pipe

    def recv(self) -> Any:
        try:
            return self._pipe.recv()
        except (FileNotFoundError, ConnectionRefusedError, ConnectionResetError, EOFError) as e:  # the sender's
            # resource sharer is gone with it (reset, end of file: it went while handing over the pipe; hivemind
            # catches no EOFError there, and the DHT process died of one in a CI run)
            log.debug("Dropped a DHT request whose sender exited: %r", e)
            return "_drop_orphan", [], {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self._pipe, name)


class _SwarmDHT(DHT):
    """hivemind's DHT, reading its requests through :class:`_OrphansDropped`, that exits with the peer's process
    (its libp2p daemon with it)."""

    orphans_dropped = 0  # requests dropped so far, in the DHT process (read it with run_coroutine)

    def run(self) -> None:
        self._inner_pipe = _OrphansDropped(self._inner_pipe)
        exit_with_parent(self._parent_pid, lambda: kill_daemon(_own_daemon_pid(getattr(self, "_node", None))))
        super().run()

    async def _drop_orphan(self) -> None:
        """What a dropped request runs in the DHT process: nothing, but count it."""
        self.orphans_dropped += 1


class SwarmNode:
    """Starts (and stops) this process's DHT node and a replica of its P2P daemon for RPC."""

    def __init__(
        self,
        initial_peers: Sequence[str] = (),
        host_maddrs: Sequence[str] = LOOPBACK_MADDRS,
        announce_maddrs: Sequence[str] = (),
        identity_path: Optional[str] = None,
        timeout: float = 30.0,
        policy: Optional[AccessPolicy] = None,
        record_validators: Sequence[RecordValidatorBase] = (),
        client_mode: bool = False,
    ) -> None:
        self.initial_peers = list(initial_peers)
        self.policy = policy  # who may talk to this peer (allow-list, secret): see lightning_swarm.security
        self.host_maddrs = list(host_maddrs)
        self.announce_maddrs = list(announce_maddrs)
        self.identity_path = identity_path
        self.record_validators = list(record_validators)  # beyond those of the policy
        self.timeout = timeout
        self.client_mode = client_mode  # reachable by no one: the DHT and averagers only dial out
        self.dht: Optional[DHT] = None
        self.p2p: Optional[P2P] = None
        self.daemon_pid: Optional[int] = None  # the p2pd the DHT process started
        self._guarded_id: Optional[str] = None  # our peer id, while the allow-list guards its forked processes
        self._identity_dir: Optional[str] = None  # a temporary identity's, when the guard needs one
        self._stored_until: dict[tuple[str, str], float] = {}  # DHT time each record stored here expires
        self._loop: Optional[asyncio.AbstractEventLoop] = None  # this node's RPC event loop, in a thread of its own
        self._loop_thread: Optional[threading.Thread] = None
        self._loop_lock = threading.Lock()

    def start(self, attempts: int = 3) -> SwarmNode:
        """Start the DHT and the RPC replica. A failed join is retried: a busy initial peer can miss the DHT's
        3-second ping, for instance when many peers join through it at once."""
        for attempt in range(1, attempts + 1):
            try:
                self.dht = self._create_dht()
                break
            except (P2PDaemonError, RuntimeError) as e:
                unanswered = "bootstrap failed" in str(e)
                if not (unanswered or isinstance(e, P2PDaemonError)) or not self.initial_peers:
                    raise
                if attempt < attempts:
                    log.warning("Could not join the swarm (attempt %d of %d): %s", attempt, attempts, daemon_reason(e))
                    time.sleep(attempt)
                    continue
                tried = ", ".join(self.initial_peers)
                if unanswered:
                    raise JoinError(
                        f"DHT bootstrap failed: none of the initial peers answered ({attempts} attempt(s); tried "
                        f"{tried}). They may be down, unreachable or overloaded; if it is a private swarm, this peer "
                        "may be off its allow-list or lack its secret (set allowed_peers/identity_path or secret_path; "
                        "for the lightning-swarm command, pass --secret-path)",
                        "DHT bootstrap failed: none of the initial peers answered",
                    ) from None
                raise JoinError(
                    f"Could not join the swarm through {tried} ({attempts} attempt(s)): {daemon_reason(e)}. Check "
                    "that a peer still runs at that address (the peer that started the swarm may have exited: pass "
                    "the address of one that runs) and that this machine can reach it",
                    daemon_reason(e),
                ) from None
        self.p2p = self.run(self.dht.replicate_p2p())
        self.daemon_pid = self.dht.run_coroutine(_daemon_pid, return_future=True).result(timeout=self.timeout)
        return self

    def _create_dht(self) -> DHT:
        loopback_only = all(m.startswith("/ip4/127.") for m in self.host_maddrs)
        validators, authorizer, identity_path = list(self.record_validators), None, self.identity_path
        if self.policy is not None:
            if self.policy.allowed is not None:  # the guard needs our peer id before the DHT process forks
                identity_path = identity_path or self._temporary_identity()
                self._guarded_id = security.peer_id_of(identity_path)
                security.install_guard(self.policy, self._guarded_id)
            if self.policy.key is not None:
                validators.append(security.SecretRecordValidator(self.policy.key))
                authorizer = security.SecretAuthorizer(self.policy.key)
        dht = _SwarmDHT(
            record_validators=validators,
            authorizer=authorizer,
            initial_peers=self.initial_peers or None,
            host_maddrs=self.host_maddrs,
            announce_maddrs=self.announce_maddrs or None,
            identity_path=identity_path,
            startup_timeout=self.timeout,
            client_mode=self.client_mode,
            # never probe routers or public services (UPnP multicast, AutoNAT) unless we listen beyond loopback
            nat_port_map=False,
            auto_nat=not loopback_only,
            start=False,
        )
        try:
            dht.run_in_background(await_ready=True, timeout=self.timeout)
        except BaseException:
            dht.join(timeout=self.timeout)  # a DHT that failed to join exits: reap it, or it stays a zombie
            if dht.is_alive():
                dht.terminate()
            raise
        return dht

    def _temporary_identity(self) -> str:
        """A fresh identity file for this node's run (removed at shutdown)."""
        if self._identity_dir is None:
            self._identity_dir = tempfile.mkdtemp(prefix="swarm-identity-")
        path = os.path.join(self._identity_dir, "identity.key")
        security.create_identity(path)
        return path

    @property
    def peer_id(self) -> PeerID:
        assert self.p2p is not None, "SwarmNode.start() was not called"
        return self.p2p.peer_id

    def visible_maddrs(self) -> list[str]:
        """Full multiaddrs (with /p2p/<id>) that other peers pass as ``initial_peers``."""
        future = self.dht.run_coroutine(_visible_maddrs, return_future=True)
        return [str(m) for m in future.result(timeout=self.timeout)]

    def publish_addresses(self, address_file: Optional[str] = None) -> list[str]:
        """This peer's multiaddrs, written to ``address_file`` (one per line, replaced at once) if given."""
        addresses = self.visible_maddrs()
        if address_file:
            with open(address_file + ".tmp", "w") as f:
                f.write("\n".join(addresses) + "\n")
            os.replace(address_file + ".tmp", address_file)
        return addresses

    def dial(self, peers: dict[str, Sequence[str]], timeout: Optional[float] = None) -> list[str]:
        """Open a connection to each of ``peers`` (peer id: its multiaddrs) that this peer has none with. A peer
        behind NAT can be called only by the peers it dialed (libp2p carries their calls back over that
        connection), so such a peer dials those that may call it. Returns the peers that could not be dialed."""
        others = {peer: maddrs for peer, maddrs in peers.items() if peer != str(self.peer_id)}
        timeout = timeout or self.timeout  # each dial's; they run at once, after listing the connected peers
        return self.run(_dial(self.p2p, others, timeout), timeout=2 * timeout)

    def run(self, coro: Awaitable[T], timeout: Optional[float] = None) -> T:
        """Run a coroutine on this node's RPC event loop from synchronous code and wait for it, with a timeout."""
        future = self.submit(coro)
        try:
            return future.result(timeout=timeout or self.timeout)
        except TimeoutError:
            future.cancel()
            raise

    def submit(self, coro: Awaitable[T]) -> concurrent.futures.Future[T]:
        """Start a coroutine on this node's RPC event loop from synchronous code, without waiting for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._rpc_loop())

    def _rpc_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop this node's RPC runs on (the P2P replica, stage handlers, the direct path), started at
        first use in a thread of its own: the peer's, not a singleton shared with other users of hivemind."""
        with self._loop_lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                self._loop_thread = threading.Thread(target=self._loop.run_forever, name="swarm-rpc", daemon=True)
                self._loop_thread.start()
            return self._loop

    def _stop_loop(self) -> None:
        with self._loop_lock:
            loop, thread, self._loop, self._loop_thread = self._loop, self._loop_thread, None, None
        if loop is None:
            return
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=5)
        if not thread.is_alive():
            loop.close()

    def dht_get(self, key: str, timeout: Optional[float] = None) -> Optional[Any]:
        """The newest value under ``key`` (a dict of subkeys to values for dictionary records), or None."""
        found = self.dht.get(key, latest=True, return_future=True).result(timeout=timeout or self.timeout)
        if found is None:
            return None
        value = found.value
        if isinstance(value, dict):
            return {subkey: item.value for subkey, item in value.items()}
        return value

    def dht_store(self, key: str, subkey: str, value: Any, ttl: float, timeout: Optional[float] = None) -> bool:
        """Store a small record under ``key``/``subkey`` that expires ``ttl`` seconds from now, or just after the
        record this node stored there before, if that one lasts longer: the DHT keeps the value that expires last,
        so a shorter-lived store (say, "leaving" after a long-lived "joining") would be dropped."""
        expiration = max(get_dht_time() + ttl, self._stored_until.get((key, subkey), 0.0) + 0.001)
        self._stored_until[(key, subkey)] = expiration
        future = self.dht.store(key, value, expiration, subkey=subkey, return_future=True)
        return bool(future.result(timeout=timeout or self.timeout))

    def shutdown(self) -> None:
        if self.p2p is not None:
            try:
                self.run(self.p2p.shutdown(), timeout=5)
            except Exception as e:  # the daemon may already be gone; the DHT shutdown below reaps it
                log.debug("P2P replica shutdown failed: %r", e)
            self.p2p = None
        self._stop_loop()
        if self.dht is not None:
            self.dht.shutdown()
            self.dht = None
        kill_daemon(self.daemon_pid)  # a DHT process terminated "the hard way" leaves its p2pd running
        self.daemon_pid = None
        if self._guarded_id is not None:
            security.remove_guard(self._guarded_id)  # this process may later join another swarm, or none
            self._guarded_id = None
        if self._identity_dir is not None:
            shutil.rmtree(self._identity_dir, ignore_errors=True)
            self._identity_dir = None


def daemon_reason(error: BaseException) -> str:
    """What a libp2p daemon error says, without the daemon's prefixes and log timestamp."""
    reason = str(error).split(": ", 1)[-1] if isinstance(error, P2PDaemonError) else str(error)
    return re.sub(r"^(Daemon failed to start: )?\d{4}/\d\d/\d\d \d\d:\d\d:\d\d ", "", reason).strip()


def exit_with_parent(parent: int, on_exit: Callable[[], None] = lambda: None, period: float = 1.0) -> None:
    """In a helper process the peer forked (its DHT, an averager): call ``on_exit`` and exit once the peer's process,
    ``parent``, is gone. A peer killed by SIGKILL (the OOM killer, a crash) cleans nothing up: its helpers and libp2p
    daemon would live on, keep its identity reachable over libp2p and its averagers answering, for as long as the
    machine runs. Checked every ``period`` seconds."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(period)
        on_exit()
        os._exit(1)

    threading.Thread(target=watch, name="swarm-exit-with-parent", daemon=True).start()


def kill_daemon(pid: Optional[int]) -> None:
    """Kill the p2pd daemon with this pid if it still runs (checked by its command line, where /proc exists)."""
    if pid is None:
        return
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            if b"p2pd" not in f.read():
                return  # gone, and the pid reused
        os.kill(pid, signal.SIGKILL)
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        pass


async def _dial(p2p: P2P, peers: dict[str, Sequence[str]], timeout: float) -> list[str]:
    connected = {str(info.peer_id) for info in await asyncio.wait_for(p2p.list_peers(), timeout)}
    missing = sorted(peers.keys() - connected)

    async def connect(peer: str) -> None:
        maddrs = [Multiaddr(maddr) for maddr in peers[peer]]
        await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(peer), maddrs), timeout)

    results = await asyncio.gather(*(connect(peer) for peer in missing), return_exceptions=True)
    for peer, result in zip(missing, results):
        if isinstance(result, BaseException):
            log.debug("Could not dial peer %s: %r", peer, result)
    return [peer for peer, result in zip(missing, results) if isinstance(result, BaseException)]


async def _daemon_pid(dht: DHT, node: Any) -> Optional[int]:
    return _own_daemon_pid(node)


def _own_daemon_pid(node: Any) -> Optional[int]:
    """The pid of the p2pd that the DHT process's ``node`` (a ``DHTNode``, or None before it starts) runs."""
    return getattr(getattr(getattr(node, "p2p", None), "_child", None), "pid", None)


async def _visible_maddrs(dht: DHT, node: Any) -> list:
    return await node.p2p.get_visible_maddrs()
