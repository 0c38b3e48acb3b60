"""The direct tensor path: forward and backward requests travel between a router and a stage server over one ZeroMQ
connection between the two processes, not through the p2pd daemons (``benchmarks/transport.py``: ZeroMQ moved
4-25x more bytes per second than hivemind's P2P on loopback, and 3-4x more than gRPC). libp2p stays for the DHT,
the averagers, and as the fallback when a direct connection cannot be made.

A request is one multipart message: ``[request id, header, *tensor buffers]`` (the header, msgpack, names the
method, the stage, the request's metadata and each tensor's shape, dtype and codec); the reply is
``[request id, header, *tensor buffers]``, or a header naming the error the stage server raised. Received tensors
are views of the received frames (:class:`~lightning_swarm.compression.WireTensor`), and a stage server's reply is
sent from the bytes its codec wrote: no protobuf message is built on this path.

Membership is proven before any request is read, once per connection:

1. The caller asks the stage server's peer for a session over libp2p (``rpc_open_session``): libp2p authenticates
   the caller's peer id and encrypts the channel; the peer applies its allow-list and checks the swarm's secret
   token, as for every stage request, and answers a random session id and key.
2. The caller connects with ZeroMQ's PLAIN handshake: user name the session id, password a one-time token (the
   time, a random nonce and an HMAC of both under the session key). The server's ZAP handler accepts a connection
   only with a known, live session, a valid HMAC, a time within ``MAX_CLOCK_SKEW`` seconds and a nonce never seen,
   and tags the connection with the session's peer id: every request on it runs as that caller. A refused
   connection never gets a request through (ZeroMQ drops it at the handshake), and a token seen on the wire
   cannot open another connection.

Payloads are not encrypted on this path: see docs/multi_machine.md for the threat model and how to turn it off.
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import hmac
import ipaddress
import logging
import os
import time
import uuid
from typing import Any, Callable, NamedTuple, Optional, Sequence

import zmq
import zmq.asyncio
from hivemind.p2p import P2P, P2PContext, P2PHandlerError, PeerID, ServicerBase
from hivemind.proto import runtime_pb2
from hivemind.utils import MSGPackSerializer
from zmq.utils.monitor import parse_monitor_message

from lightning_swarm import protocol, security
from lightning_swarm.compression import WireTensor
from lightning_swarm.errors import NotServingError, PeerNotAllowedError, SwarmRequestError
from lightning_swarm.security import AccessPolicy

log = logging.getLogger(__name__)

SESSION_TTL = 3600.0  # seconds a session stays valid; callers open a new one before it ends
CONNECT_TIMEOUT = 5.0  # seconds to open a session (over libp2p), then again to connect
MAX_CLOCK_SKEW = 60.0  # seconds between a connection token's time and the server's clock
ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks for the verdict on each handshake (one per context)


class DirectPathError(RuntimeError):
    """The stage server failed a request on the direct path other than by one of the swarm's errors."""


class DirectUnreachable(ConnectionError):
    """No direct connection to the peer could be made: the caller uses libp2p instead."""


class DirectRequest(NamedTuple):
    """A request as :meth:`StageServer.answer_tensors` reads it (``runtime_pb2.ExpertRequest``'s fields)."""

    uid: str
    tensors: list[WireTensor]
    metadata: bytes


def describe(tensors: Sequence[Any]) -> list[list]:
    return [[list(t.size), t.dtype, int(t.compression)] for t in tensors]


def received(descriptions: Any, frames: Sequence[zmq.Frame]) -> list[WireTensor]:
    """The tensors of a message: ``descriptions`` (from its header) over its frames; ``SwarmRequestError`` if they
    do not match."""
    try:
        if len(descriptions) != len(frames):
            raise ValueError(f"{len(descriptions)} tensor(s) described, {len(frames)} sent")
        return [
            WireTensor(frame.buffer, [int(n) for n in size], str(dtype), int(codec))
            for (size, dtype, codec), frame in zip(descriptions, frames)
        ]
    except (TypeError, ValueError) as e:
        raise SwarmRequestError(f"malformed direct-path message: {e}") from None


def error_header(error: Exception) -> dict:
    """The reply header that carries a stage server's error to its caller: the error's class name and message."""
    return {"error": [type(error).__name__, str(error)]}


def header_error(header: dict) -> Optional[Exception]:
    """The error a reply header carries, as its caller raises it: the swarm error the server raised (by its class
    name, :func:`~lightning_swarm.protocol.error_from_wire`), else :class:`DirectPathError`; None for a reply."""
    if "error" not in header:
        return None
    kind, message = header["error"]
    return protocol.error_from_wire(f"{kind}: {message}") or DirectPathError(f"{kind}: {message}")


def connection_token(key: bytes, session: bytes, at: float, nonce: bytes) -> bytes:
    """The one-time password of a connection: the time, the nonce and their HMAC under the session key."""
    stamp = repr(at).encode()
    mac = hmac.new(key, b"connect|" + session + b"|" + stamp + b"|" + nonce, hashlib.sha256).hexdigest()
    return b":".join([stamp, nonce.hex().encode(), mac.encode()])


def tcp_endpoint(host: str, port: int) -> str:
    return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def listen_host(host_maddrs: Sequence[str]) -> str:
    """The IP of the first ``/ip4`` or ``/ip6`` multiaddr libp2p listens on (loopback if none)."""
    for maddr in host_maddrs:
        parts = str(maddr).split("/")
        if len(parts) > 2 and parts[1] in ("ip4", "ip6"):
            return parts[2]
    return "127.0.0.1"


def announced_host(host: str, announce_maddrs: Sequence[str], visible_maddrs: Sequence[str]) -> str:
    """The IP other peers dial: the first announced one, else ``host`` unless it is a wildcard, else the first
    address libp2p reports that is not loopback."""
    if announce_maddrs:
        return listen_host(announce_maddrs)
    if not ipaddress.ip_address(host).is_unspecified:
        return host
    found = [listen_host([m]) for m in visible_maddrs]
    return next((ip for ip in found if not ipaddress.ip_address(ip).is_loopback), "127.0.0.1")


@dataclasses.dataclass
class Session:
    caller: str  # the peer id (base58) libp2p authenticated when the session was opened
    key: bytes
    expires: float  # time.time()


# ---- the server: one per peer, answering for whichever stage it serves ---------------------------------------------


class DirectServer(ServicerBase):
    """Listens on ``host:port`` (0: any free port) for direct requests, answered by ``stage_server()`` (None while
    the peer serves no stage); hands out sessions over libp2p (namespace ``run_id``) to callers that ``policy``
    admits.

    Runs on the event loop of the peer's RPC (:meth:`start`, :meth:`stop`)."""

    def __init__(
        self,
        run_id: str,
        stage_server: Callable[[], Any],
        policy: Optional[AccessPolicy] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        max_request_bytes: int = 256 * 2**20,
    ) -> None:
        self.run_id, self.stage_server, self.policy = run_id, stage_server, policy
        self.host, self.port, self.max_request_bytes = host, port, max_request_bytes
        self.sessions: dict[bytes, Session] = {}
        self._nonces: dict[bytes, float] = {}  # connection nonces seen, until they are too old to be accepted
        self._context: Optional[zmq.asyncio.Context] = None
        self._socket: Optional[zmq.asyncio.Socket] = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self, p2p: P2P) -> int:
        """Listen and register the session handler; returns the port."""
        self._context = zmq.asyncio.Context()
        zap = self._context.socket(zmq.REP)
        zap.bind(ZAP_ENDPOINT)  # before the listener: no handshake happens without a verdict
        self._socket = self._context.socket(zmq.ROUTER)
        for option, value in [(zmq.PLAIN_SERVER, 1), (zmq.ZAP_DOMAIN, self.run_id.encode()), (zmq.LINGER, 0)]:
            self._socket.setsockopt(option, value)
        self._socket.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no ZAP handler, no connection
        self._socket.setsockopt(zmq.MAXMSGSIZE, self.max_request_bytes + 2**20)  # per frame; the sum is checked
        self._socket.setsockopt(zmq.IPV6, int(":" in self.host))
        self._socket.bind(tcp_endpoint(self.host, self.port))
        self.port = int(self._socket.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1])
        self._spawn(self._authenticate(zap))
        self._spawn(self._serve())
        await self.add_p2p_handlers(p2p, namespace=self.run_id)
        return self.port

    async def stop(self, p2p: Optional[P2P]) -> None:
        if p2p is not None:
            await self.remove_p2p_handlers(p2p, namespace=self.run_id)
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:  # the sockets are closed once no task is inside a call on them (bounded: stop has 5 s)
            await asyncio.wait(list(self._tasks), timeout=2.0)
        if self._context is not None:
            self._context.destroy(linger=0)
            self._context = None

    def _spawn(self, coroutine: Any) -> None:
        task = asyncio.create_task(coroutine)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # ---- sessions, over libp2p -------------------------------------------------------------------------------------

    async def rpc_open_session(
        self, request: runtime_pb2.ExpertRequest, context: P2PContext
    ) -> runtime_pb2.ExpertResponse:
        """A new session for the (libp2p-authenticated) caller, if it is admitted and proved the secret."""
        if self.policy is not None:
            self.policy.check_request(self.run_id, context, protocol.decode_metadata(request.metadata))
        now = time.time()
        self.sessions = {sid: s for sid, s in self.sessions.items() if s.expires > now}
        session_id, key = os.urandom(16), os.urandom(32)
        self.sessions[session_id] = Session(str(context.remote_id), key, now + SESSION_TTL)
        reply = {"session": session_id, "key": key, "ttl": SESSION_TTL}
        return runtime_pb2.ExpertResponse(metadata=protocol.encode_metadata(reply))

    async def _authenticate(self, zap: zmq.asyncio.Socket) -> None:
        """Answer libzmq's ZAP requests: one per connection handshake (RFC 27)."""
        while True:
            version, request_id, _domain, _address, _identity, mechanism, *credentials = await zap.recv_multipart()
            try:
                caller = self.check_connection(mechanism, credentials)
                verdict = [b"200", b"OK", caller.encode()]
            except Exception as e:  # PeerNotAllowedError, or anything unexpected: refuse, and keep answering
                verdict = [b"400", str(e).encode()[:200], b""]
            await zap.send_multipart([version, request_id, *verdict, b""])

    def check_connection(self, mechanism: bytes, credentials: Sequence[bytes]) -> str:
        """The caller's peer id, if the handshake's credentials open a connection; else PeerNotAllowedError."""
        if mechanism != b"PLAIN" or len(credentials) != 2:
            security.refuse("a direct connection without session credentials")
        name, token = credentials
        try:
            session_id, (stamp, nonce, _) = bytes.fromhex(name.decode()), token.split(b":")
            at, nonce = float(stamp), bytes.fromhex(nonce.decode())
        except ValueError:
            security.refuse("a direct connection with malformed session credentials")
        session, now = self.sessions.get(session_id), time.time()
        if session is None or session.expires < now:
            security.refuse("a direct connection with an unknown or expired session")
        if not hmac.compare_digest(token, connection_token(session.key, session_id, at, nonce)):
            security.refuse(f"a direct connection from {session.caller} with a wrong token")
        if abs(now - at) > MAX_CLOCK_SKEW or nonce in self._nonces:
            security.refuse(f"a direct connection from {session.caller}: replayed, or a clock too far apart")
        if self.policy is not None and not self.policy.admits(session.caller):
            security.refuse(f"peer {session.caller} is not on the allow-list of this swarm")
        if len(self._nonces) > 10000:
            self._nonces = {n: t for n, t in self._nonces.items() if t > now}
        self._nonces[nonce] = now + 2 * MAX_CLOCK_SKEW
        return session.caller

    # ---- requests ---------------------------------------------------------------------------------------------------

    async def _serve(self) -> None:
        while True:
            frames = await self._socket.recv_multipart(copy=False)
            self._spawn(self._answer(frames))

    async def _answer(self, frames: list[zmq.Frame]) -> None:
        routing, request_id = frames[0].bytes, frames[1].bytes if len(frames) > 1 else b""
        try:
            tensors = await self._reply(frames)
            header, buffers = {"tensors": describe(tensors)}, [t.buffer for t in tensors]
        except Exception as e:
            header, buffers = error_header(e), []
        await self._socket.send_multipart([routing, request_id, MSGPackSerializer.dumps(header), *buffers], copy=False)

    async def _reply(self, frames: list[zmq.Frame]) -> list[WireTensor]:
        caller = frames[0].get("User-Id")  # the session's peer id, set by the ZAP handler for this connection
        if len(frames) < 3:
            raise SwarmRequestError("a direct-path request needs an id, a header and its tensors")
        if sum(len(frame) for frame in frames[3:]) > self.max_request_bytes:
            raise SwarmRequestError(f"request exceeds the size cap of {self.max_request_bytes} bytes")
        header = protocol.decode_metadata(frames[2].bytes)
        kind, uid, metadata = header.get("kind"), header.get("uid"), header.get("metadata", b"")
        if kind not in ("forward", "backward") or not isinstance(uid, str) or not isinstance(metadata, bytes):
            raise SwarmRequestError("a direct-path request names forward or backward, a stage and its metadata")
        server = self.stage_server()
        if server is None:
            raise NotServingError("this peer serves no stage now")
        request = DirectRequest(uid, received(header.get("tensors"), frames[3:]), metadata)
        return await server.answer_tensors(kind, request, caller)


async def await_handshake(monitor: zmq.asyncio.Socket) -> None:
    """Wait until a connecting socket's handshake succeeded (its ``monitor`` tells); ``PeerNotAllowedError`` if the
    server refused the credentials, ``ConnectionError`` if the connection failed otherwise."""
    failures = (zmq.EVENT_CLOSED, zmq.EVENT_DISCONNECTED, zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL)
    while True:
        event = parse_monitor_message(await monitor.recv_multipart())["event"]
        if event == zmq.EVENT_HANDSHAKE_SUCCEEDED:
            return
        if event == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
            raise PeerNotAllowedError("the peer refused this connection's credentials")
        if event in (*failures, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL):
            raise ConnectionError(f"the connection failed (ZeroMQ event {event})")


# ---- the client: one connection per peer, shared by the router's calls --------------------------------------------


@dataclasses.dataclass
class _Connection:
    socket: zmq.asyncio.Socket
    pending: dict[bytes, asyncio.Future]
    alive: bool = True


class DirectClient:
    """Calls stage servers over their direct addresses. ``p2p``, ``peer_id`` and ``policy`` are this peer's: sessions
    are opened over libp2p with the secret's token. Runs on the event loop of the peer's RPC."""

    def __init__(
        self,
        p2p: P2P,
        peer_id: PeerID,
        run_id: str,
        policy: Optional[AccessPolicy],
        connect_timeout: float = CONNECT_TIMEOUT,
    ) -> None:
        self.p2p, self.peer_id, self.run_id, self.policy = p2p, peer_id, run_id, policy
        self.connect_timeout = connect_timeout
        self._context = zmq.asyncio.Context()
        self._sessions: dict[str, tuple[bytes, bytes, float]] = {}  # peer -> (session id, key, expiry)
        self._connections: dict[tuple[str, str], _Connection] = {}  # by (peer, address)
        self._locks: dict[tuple[str, str], asyncio.Lock] = {}
        self._tasks: set[asyncio.Task] = set()
        self._next_id = 0

    async def call(
        self, peer: str, address: str, kind: str, uid: str, tensors: Sequence[Any], metadata: bytes, timeout: float
    ) -> list[WireTensor]:
        """``kind`` (forward or backward) of stage ``uid`` on ``peer``, whose direct address is ``address``
        (``host:port``). Raises :class:`DirectUnreachable` if no connection could be made, else what the stage server
        raised (or :class:`DirectPathError`)."""
        connection = await self._connection(peer, address)
        self._next_id += 1
        request_id = self._next_id.to_bytes(8, "big")
        future = asyncio.get_running_loop().create_future()
        connection.pending[request_id] = future
        header = MSGPackSerializer.dumps({"kind": kind, "uid": uid, "metadata": metadata, "tensors": describe(tensors)})
        try:
            await connection.socket.send_multipart([request_id, header, *(t.buffer for t in tensors)], copy=False)
            frames = await asyncio.wait_for(future, timeout)
        finally:
            connection.pending.pop(request_id, None)
        reply = MSGPackSerializer.loads(frames[0].bytes)
        error = header_error(reply)
        if error is not None:
            raise error
        return received(reply["tensors"], frames[1:])

    async def _connection(self, peer: str, address: str) -> _Connection:
        lock = self._locks.setdefault((peer, address), asyncio.Lock())
        async with lock:
            connection = self._connections.get((peer, address))
            if connection is not None and connection.alive:
                return connection
            try:
                connection = await self._connect(peer, address)
            except PeerNotAllowedError:  # the session may have died with a restarted server: one more try
                self._sessions.pop(peer, None)
                try:
                    connection = await self._connect(peer, address)
                except PeerNotAllowedError as e:
                    raise DirectUnreachable(f"peer {peer} refused a direct connection: {e}") from None
            self._connections[peer, address] = connection
            return connection

    async def _connect(self, peer: str, address: str) -> _Connection:
        session, key = await self._session(peer)
        socket = self._context.socket(zmq.DEALER)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL, -1)  # a reconnection would replay the one-time token: reconnect anew
        socket.setsockopt(zmq.IPV6, int(address.startswith("[")))
        socket.plain_username = session.hex().encode()
        socket.plain_password = connection_token(key, session, time.time(), os.urandom(16))
        monitor: Optional[zmq.asyncio.Socket] = None
        try:
            # pyzmq's default endpoint names the socket's file descriptor, which a socket closed moments ago may have
            # held while its endpoint is still bound: that connection failed with EADDRINUSE, blaming a healthy peer
            monitor = socket.get_monitor_socket(addr=f"inproc://swarm-monitor-{uuid.uuid4().hex}")
            socket.connect(f"tcp://{address}")
            await asyncio.wait_for(await_handshake(monitor), self.connect_timeout)
        except BaseException as e:
            socket.close(linger=0)
            if monitor is not None:
                monitor.close(linger=0)
            if isinstance(e, (PeerNotAllowedError, asyncio.CancelledError)):
                raise
            raise DirectUnreachable(f"no direct connection to {peer} at {address}: {e!r}") from None
        connection = _Connection(socket, {})
        task = asyncio.create_task(self._receive(connection, monitor))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return connection

    async def _receive(self, connection: _Connection, monitor: zmq.asyncio.Socket) -> None:
        """Hand replies to their callers until the connection drops; then fail the calls still waiting."""
        watch = asyncio.create_task(self._watch(monitor))
        replies = asyncio.create_task(self._read_replies(connection))
        error: BaseException = ConnectionError("the peer closed the direct connection")
        try:
            done, _ = await asyncio.wait([watch, replies], return_when=asyncio.FIRST_COMPLETED)
            error = next(iter(done)).exception() or error
        finally:
            for task in (watch, replies):
                task.cancel()
            connection.alive = False
            for future in connection.pending.values():
                if not future.done():
                    future.set_exception(error)
            connection.socket.close(linger=0)
            monitor.close(linger=0)

    @staticmethod
    async def _read_replies(connection: _Connection) -> None:
        while True:
            request_id, *frames = await connection.socket.recv_multipart(copy=False)
            future = connection.pending.get(request_id.bytes)
            if future is not None and not future.done():
                future.set_result(frames)

    @staticmethod
    async def _watch(monitor: zmq.asyncio.Socket) -> None:
        """Return once the connection is gone."""
        while parse_monitor_message(await monitor.recv_multipart())["event"] not in (
            zmq.EVENT_DISCONNECTED,
            zmq.EVENT_CLOSED,
        ):
            pass

    async def _session(self, peer: str) -> tuple[bytes, bytes]:
        """A live session with ``peer`` (opened over libp2p if this client has none)."""
        found = self._sessions.get(peer)
        if found is not None and found[2] > time.monotonic():
            return found[0], found[1]
        metadata = {} if self.policy is None else self.policy.sign_metadata({}, self.run_id, self.peer_id, peer)
        request = runtime_pb2.ExpertRequest(metadata=protocol.encode_metadata(metadata))
        stub = DirectServer.get_stub(self.p2p, PeerID.from_base58(peer), namespace=self.run_id)
        try:
            response = await asyncio.wait_for(stub.rpc_open_session(request), self.connect_timeout)
            reply = protocol.decode_metadata(response.metadata)
            session, key, ttl = bytes(reply["session"]), bytes(reply["key"]), float(reply["ttl"])
        except (P2PHandlerError, asyncio.TimeoutError, KeyError, TypeError, ValueError) as e:
            raise DirectUnreachable(f"peer {peer} opened no direct session: {e!r}") from None
        self._sessions[peer] = (session, key, time.monotonic() + ttl / 2)
        return session, key

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._context.destroy(linger=0)
