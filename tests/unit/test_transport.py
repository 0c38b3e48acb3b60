"""The direct tensor path (lightning_swarm.transport) in-process: records with and without a direct address, the
addresses it listens on and calls, and a connection without a valid, fresh, unused proof of membership refused
before any request is read, the stage untouched."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import pytest
import torch
import zmq
import zmq.asyncio
from hivemind.p2p import P2P, P2PHandlerError
from hivemind.proto import runtime_pb2

from lightning_swarm import compression, protocol, transport
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.security import AccessPolicy, PeerNotAllowedError
from lightning_swarm.server.stage_server import StageServer


def test_records_with_and_without_a_direct_address():
    record = PeerRecord("p", 0, PeerState.SERVING, 2.5, 3, True, "10.0.0.1:4000")
    assert PeerRecord.from_value("p", 0, record.to_value()) == record
    old = (1, 2.5, 3, 1)  # a record published by a peer without the direct path
    assert PeerRecord.from_value("p", 0, old) == dataclasses.replace(record, address="")
    assert PeerRecord("p", 0, PeerState.SERVING, 2.5, 3, True).to_value() == old  # no address: the old format
    assert PeerRecord.from_value("p", 0, (*old, 5)) is None
    assert PeerRecord.from_value("p", 0, (*old, "x" * 65)) is None
    assert PeerRecord.from_value("p", 0, (*old, "a:1", "b:2")) is None


def test_addresses_of_the_direct_path():
    assert transport.listen_host(["/ip4/0.0.0.0/tcp/31337"]) == "0.0.0.0"
    assert transport.listen_host(["/ip6/::1/tcp/0"]) == "::1"
    assert transport.listen_host([]) == "127.0.0.1"
    assert transport.announced_host("0.0.0.0", ["/ip4/203.0.113.5/tcp/31337"], []) == "203.0.113.5"
    assert transport.announced_host("127.0.0.1", [], []) == "127.0.0.1"
    visible = ["/ip4/127.0.0.1/tcp/5/p2p/x", "/ip4/192.168.1.7/tcp/5/p2p/x"]
    assert transport.announced_host("0.0.0.0", [], visible) == "192.168.1.7"


# ---- refusals: an in-process stage server with the direct path, and raw ZeroMQ connections to it -----------------


async def handshake(port: int, credentials: tuple[bytes, bytes] | None, payload: bytes = b"") -> float:
    """Connect with ``credentials`` (None: no security mechanism) and send ``payload`` as a request; returns the
    seconds until the handshake succeeded, or raises PeerNotAllowedError / ConnectionError as the client would."""
    context = zmq.asyncio.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.RECONNECT_IVL, -1)
    if credentials is not None:
        socket.plain_username, socket.plain_password = credentials
    monitor = socket.get_monitor_socket()
    socket.connect(f"tcp://127.0.0.1:{port}")
    start = time.perf_counter()
    # sent beside the handshake, not before it: a connection refused before the request was queued leaves the socket
    # no peer to send to (reconnecting is off), and an awaited send would wait for one for ever
    sending = (
        asyncio.ensure_future(socket.send_multipart([b"\0" * 8, b"\x80", payload], copy=False)) if payload else None
    )
    try:
        await asyncio.wait_for(transport.await_handshake(monitor), 10)
        return time.perf_counter() - start
    finally:
        if sending is not None:
            sending.cancel()
        context.destroy(linger=0)


def test_connections_without_a_valid_proof_are_refused_and_the_stage_is_untouched():
    async def main() -> None:
        server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
        caller_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        outsider_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        allowed = [str(server_p2p.peer_id), str(caller_p2p.peer_id)]
        policy = AccessPolicy.create(allowed, secret="s3cret")
        torch.manual_seed(0)
        module = torch.nn.Sequential(torch.nn.Linear(8, 8))
        stage = StageServer("run", 0, module, torch.device("cpu"), policy=policy)
        direct = transport.DirectServer("run", lambda: stage, policy, max_request_bytes=2**27)
        received = []  # every request that reached the server past a connection's handshake
        answer = direct._answer
        direct._answer = lambda frames: received.append(len(frames)) or answer(frames)
        port = await direct.start(server_p2p)
        before = {k: v.clone() for k, v in module.state_dict().items()}
        try:
            server = str(server_p2p.peer_id)
            x = compression.serialize(torch.randn(2, 8), "none")

            # opening a session: the secret's token and the allow-list are checked (over libp2p)
            for p2p, key in [(caller_p2p, "wrong"), (outsider_p2p, "s3cret")]:
                wrong = transport.DirectClient(p2p, p2p.peer_id, "run", AccessPolicy.create(secret=key))
                stub = transport.DirectServer.get_stub(p2p, server_p2p.peer_id, namespace="run")
                metadata = wrong.policy.sign_metadata({}, "run", p2p.peer_id, server)
                request = runtime_pb2.ExpertRequest(metadata=protocol.encode_metadata(metadata))
                with pytest.raises(P2PHandlerError, match="PeerNotAllowedError"):
                    await asyncio.wait_for(stub.rpc_open_session(request), 10)
                with pytest.raises(transport.DirectUnreachable, match="opened no direct session"):
                    await wrong.call(server, f"127.0.0.1:{port}", "forward", stage.uid, [x], b"", 10)
                await wrong.close()

            # a member: a session, then connections with one-time tokens
            member = transport.DirectClient(caller_p2p, caller_p2p.peer_id, "run", policy)
            reply = await member.call(server, f"127.0.0.1:{port}", "forward", stage.uid, [x], b"", 10)
            assert torch.equal(compression.deserialize(reply[0]), module(compression.deserialize(x)).detach())
            assert received == [4]  # the member's request: id, header, one tensor (and the routing id)
            session, key = await member._session(server)
            name = session.hex().encode()
            fresh = transport.connection_token(key, session, time.time(), b"n" * 16)
            await handshake(port, (name, fresh))  # a valid token opens a connection...
            with pytest.raises(PeerNotAllowedError):  # ... once: the same token again is a replay
                await handshake(port, (name, fresh))
            stale = transport.connection_token(key, session, time.time() - 2 * transport.MAX_CLOCK_SKEW, b"o" * 16)
            forged = transport.connection_token(b"k" * 32, session, time.time(), b"p" * 16)
            unknown = transport.connection_token(key, b"u" * 16, time.time(), b"q" * 16)
            big = bytes(64 * 2**20)  # a refused connection never gets its request through, however large
            for credentials in [(name, stale), (name, forged), (b"75" * 16, unknown), (name, b"garbage")]:
                with pytest.raises(PeerNotAllowedError):
                    await handshake(port, credentials, big)
            start = time.perf_counter()
            with pytest.raises(PeerNotAllowedError):
                await handshake(port, (name, forged), big)
            refused_in = time.perf_counter() - start
            with pytest.raises((ConnectionError, PeerNotAllowedError)):  # no security mechanism at all
                await handshake(port, None, big)
            # an allowed session of a peer later taken off the allow-list
            outsider = direct.sessions[session]
            direct.sessions[b"o" * 16] = dataclasses.replace(outsider, caller=str(outsider_p2p.peer_id))
            with pytest.raises(PeerNotAllowedError):
                token = transport.connection_token(key, b"o" * 16, time.time(), b"r" * 16)
                await handshake(port, ((b"o" * 16).hex().encode(), token), big)

            # no refused connection got a request through: the server read only the member's, and the stage
            # computed only that forward: no backward, no kept graph, parameters unchanged
            assert received == [4], received
            info = stage.info()
            assert info["backward_samples"] == 0 and info["kept_bytes"] == 0, info
            assert stage.throughput.num_updates == 1
            for k, v in module.state_dict().items():
                assert torch.equal(v, before[k])
            print(f"a refused 64 MiB request: refused after {refused_in * 1000:.0f} ms")
            await member.close()
        finally:
            await direct.stop(server_p2p)
            stage.shutdown()
            for p2p in (outsider_p2p, caller_p2p, server_p2p):
                await p2p.shutdown()

    asyncio.run(main())


def test_a_connection_does_not_depend_on_monitor_endpoints_left_bound_in_its_context():
    """A connection's handshake is watched through a monitor socket. pyzmq names its endpoint after the socket's file
    descriptor, which a socket closed moments before may still hold bound: a peer's call to a healthy peer failed
    with EADDRINUSE (ZMQError) and banned it. With every such name taken in the client's context, calls still
    connect."""

    async def main() -> None:
        server_p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        maddrs = [str(m) for m in await server_p2p.get_visible_maddrs()]
        caller_p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        policy = AccessPolicy.create([str(server_p2p.peer_id), str(caller_p2p.peer_id)], secret="s3cret")
        torch.manual_seed(0)
        stage = StageServer("run", 0, torch.nn.Linear(8, 8), torch.device("cpu"), policy=policy)
        direct = transport.DirectServer("run", lambda: stage, policy)
        port = await direct.start(server_p2p)
        member = transport.DirectClient(caller_p2p, caller_p2p.peer_id, "run", policy)
        taken = member._context.socket(zmq.PAIR)
        try:
            for fd in range(4096):  # a new socket takes the lowest free descriptor
                taken.bind(f"inproc://monitor.s-{fd}")
            x = torch.randn(2, 8)
            server, wire = str(server_p2p.peer_id), compression.serialize(x, "none")
            reply = await member.call(server, f"127.0.0.1:{port}", "forward", stage.uid, [wire], b"", 10)
            assert torch.equal(compression.deserialize(reply[0]), stage.module(x).detach())
        finally:
            taken.close(linger=0)
            await member.close()
            await direct.stop(server_p2p)
            stage.shutdown()
            for p2p in (caller_p2p, server_p2p):
                await p2p.shutdown()

    asyncio.run(main())
