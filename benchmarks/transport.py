"""Transport throughput: payload MB/s each way between two processes on loopback, for the ways a tensor can travel
from a trainer to a stage server.

Each call is an echo: the client sends N bytes and the server answers with the same N bytes. MB/s each way is
N / (t / 2), in MB (10^6 bytes), from the median time t of several echoes; the transports take turns, so that the
load of this shared machine falls on all of them alike (one untimed warm-up echo each).

- ``hivemind P2P``: through the p2pd daemons as ``lightning_swarm.protocol.call`` does it: one unary message up to
  2 MiB, a stream of 2 MiB chunks above.
- ``gRPC``: ``grpc.aio``, raw bytes (no protobuf), unlimited message sizes, one message per call.
- ``ZeroMQ``: a REQ/REP pair of ``pyzmq`` sockets, zero-copy frames.
- ``direct path``: ``lightning_swarm.transport`` as routers and stage servers use it (ZeroMQ, its session opened
  over libp2p once; the server copies the payload once into its reply, as a stage server's codec does).
- ``asyncio TCP``: a plain socket with a length prefix, read into one buffer (the ceiling).

    python benchmarks/transport.py            # writes benchmarks/RESULTS.md and benchmarks/results/transport.json
    python benchmarks/transport.py --smoke    # seconds-long check that the script works
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing as mp
import socket
import statistics
import sys
import time
from pathlib import Path
from typing import AsyncIterator, Awaitable, Callable

from hivemind.p2p import P2P, PeerID, ServicerBase
from hivemind.proto import runtime_pb2

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))
from harness import script_parser  # noqa: E402
from report import RESULTS, machine, save_data, table, update_section  # noqa: E402

from lightning_swarm import protocol, transport  # noqa: E402
from lightning_swarm.compression import WireTensor  # noqa: E402

MiB = 2**20
TRANSPORTS = ["hivemind P2P", "gRPC", "ZeroMQ", "direct path", "asyncio TCP"]
CEILING = "asyncio TCP"
GRPC_OPTIONS = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
Echo = Callable[[bytes], Awaitable[int]]  # sends a payload, returns the size of the reply


# ---- servers (each in a process of its own; it sends its address back, then serves until killed) ------------------


def serve(transport: str, address: mp.Queue) -> None:
    asyncio.run(SERVERS[transport](address))


async def serve_p2p(address: mp.Queue) -> None:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    await EchoServicer().add_p2p_handlers(p2p, namespace="bench")
    address.put([str(m) for m in await p2p.get_visible_maddrs()])
    await asyncio.Event().wait()


async def serve_grpc(address: mp.Queue) -> None:
    import grpc

    async def echo(request: bytes, context) -> bytes:
        return request

    server = grpc.aio.server(options=GRPC_OPTIONS)
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address.put(port)
    await server.wait_for_termination()


async def serve_zmq(address: mp.Queue) -> None:
    import zmq

    socket = zmq.Context().socket(zmq.REP)
    address.put(socket.bind_to_random_port("tcp://127.0.0.1"))
    while True:
        socket.send(socket.recv(copy=False), copy=False)


async def serve_tcp(address: mp.Queue) -> None:
    loop = asyncio.get_running_loop()
    listener = socket.create_server(("127.0.0.1", 0))
    listener.setblocking(False)
    address.put(listener.getsockname()[1])
    connection, _ = await loop.sock_accept(listener)
    while header := await receive(connection, 8):
        await loop.sock_sendall(connection, header + await receive(connection, int.from_bytes(header, "big")))


async def receive(connection: socket.socket, size: int) -> bytearray:
    """Exactly ``size`` bytes (empty at the end of the stream), read into one buffer without further copies."""
    buffer, loop = bytearray(size), asyncio.get_running_loop()
    view, received = memoryview(buffer), 0
    while received < size:
        count = await loop.sock_recv_into(connection, view[received:])
        if not count:
            return bytearray()
        received += count
    return buffer


async def serve_direct(address: mp.Queue) -> None:
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    direct = transport.DirectServer("bench", lambda: EchoStage(), max_request_bytes=2**30)
    port = await direct.start(p2p)
    address.put(([str(m) for m in await p2p.get_visible_maddrs()], port))
    await asyncio.Event().wait()


class EchoStage:
    """Answers like a stage server, with the request's tensors (copied once, as its codec writes a reply)."""

    async def answer_tensors(self, kind: str, request: transport.DirectRequest, caller: str) -> list[WireTensor]:
        return [WireTensor(bytes(t.buffer), t.size, t.dtype, t.compression) for t in request.tensors]


SERVERS = {
    "hivemind P2P": serve_p2p,
    "gRPC": serve_grpc,
    "ZeroMQ": serve_zmq,
    "direct path": serve_direct,
    "asyncio TCP": serve_tcp,
}


class EchoServicer(ServicerBase):
    async def rpc_echo(self, request: runtime_pb2.ExpertRequest, context) -> runtime_pb2.ExpertResponse:
        return runtime_pb2.ExpertResponse(tensors=request.tensors)

    async def rpc_echo_stream(
        self, requests: AsyncIterator[runtime_pb2.ExpertRequest], context
    ) -> AsyncIterator[runtime_pb2.ExpertResponse]:
        request = await protocol.gather_request(requests, 2**40, lambda metadata: None)
        for part in protocol.stream_response(runtime_pb2.ExpertResponse(tensors=request.tensors)):
            yield part


# ---- clients: each returns an echo coroutine function -------------------------------------------------------------


@functools.lru_cache(maxsize=1)
def as_tensor(payload: bytes) -> runtime_pb2.Tensor:
    """The payload as the message a serializer builds (once per payload: building it is the codec's work)."""
    return runtime_pb2.Tensor(buffer=payload, size=[len(payload)], dtype="uint8")


async def connect_p2p(address: list[str]) -> tuple[Echo, Callable[[], Awaitable]]:
    p2p = await P2P.create(initial_peers=address, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    stub = EchoServicer.get_stub(p2p, PeerID.from_base58(address[0].rsplit("/", 1)[1]), namespace="bench")

    async def echo(payload: bytes) -> int:
        reply, _ = await protocol.call(stub, "echo", "bench", [as_tensor(payload)], {}, timeout=600)
        return sum(len(t.buffer) for t in reply)

    return echo, p2p.shutdown


async def connect_grpc(port: int) -> tuple[Echo, Callable[[], Awaitable]]:
    import grpc

    channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}", options=GRPC_OPTIONS)
    call = channel.unary_unary("/bench/Echo")

    async def echo(payload: bytes) -> int:
        return len(await call(payload, timeout=600))

    return echo, channel.close


async def connect_zmq(port: int) -> tuple[Echo, Callable[[], Awaitable]]:
    import zmq
    import zmq.asyncio

    socket = zmq.asyncio.Context().socket(zmq.REQ)
    socket.connect(f"tcp://127.0.0.1:{port}")

    async def echo(payload: bytes) -> int:
        await socket.send(payload, copy=False)
        return len((await socket.recv(copy=False)).buffer)

    async def close() -> None:
        socket.close(linger=0)

    return echo, close


async def connect_tcp(port: int) -> tuple[Echo, Callable[[], Awaitable]]:
    loop = asyncio.get_running_loop()
    connection = socket.create_connection(("127.0.0.1", port))
    connection.setblocking(False)

    async def echo(payload: bytes) -> int:
        await loop.sock_sendall(connection, len(payload).to_bytes(8, "big"))
        await loop.sock_sendall(connection, payload)
        return len(await receive(connection, int.from_bytes(await receive(connection, 8), "big")))

    async def close() -> None:
        connection.close()

    return echo, close


async def connect_direct(address: tuple[list[str], int]) -> tuple[Echo, Callable[[], Awaitable]]:
    maddrs, port = address
    p2p = await P2P.create(initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = transport.DirectClient(p2p, p2p.peer_id, "bench", None)
    server = maddrs[0].rsplit("/", 1)[1]

    async def echo(payload: bytes) -> int:
        tensor = WireTensor(payload, [len(payload)], "uint8", 0)  # what the codec hands the router
        reply = await client.call(server, f"127.0.0.1:{port}", "forward", "bench", [tensor], b"", 600)
        return sum(len(t.buffer) for t in reply)

    async def close() -> None:
        await client.close()
        await p2p.shutdown()

    return echo, close


CLIENTS = {
    "hivemind P2P": connect_p2p,
    "gRPC": connect_grpc,
    "ZeroMQ": connect_zmq,
    "direct path": connect_direct,
    "asyncio TCP": connect_tcp,
}


# ---- measurement -------------------------------------------------------------------------------------------------


async def measure(addresses: dict, sizes: list[int], repeats: int) -> list[dict]:
    """One row per (size, transport): the median echo time and MB/s each way."""
    clients = {name: await CLIENTS[name](address) for name, address in addresses.items()}
    try:
        return await _measure({name: echo for name, (echo, _) in clients.items()}, sizes, repeats)
    finally:
        for _, close in clients.values():
            await close()


async def _measure(echoes: dict[str, Echo], sizes: list[int], repeats: int) -> list[dict]:
    rows = []
    for size in sizes:
        payload = bytes(size)
        times: dict[str, list[float]] = {name: [] for name in echoes}
        for round_ in range(repeats + 1):
            for name, echo in echoes.items():
                start = time.perf_counter()
                received = await echo(payload)
                if received != size:
                    raise RuntimeError(f"{name}: echoed {received} bytes of {size}")
                if round_:
                    times[name].append(time.perf_counter() - start)
        for name, seconds in times.items():
            median = statistics.median(seconds)
            rows.append(dict(transport=name, bytes=size, seconds=median, mb_s=size / (median / 2) / 1e6))
            print(f"{size / MiB:6.2f} MiB  {name:14s} {rows[-1]['mb_s']:8.1f} MB/s each way", flush=True)
    return rows


def main() -> None:
    parser = script_parser(__doc__, "small payloads and one repeat, to check the script")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[1, 4, 16, 64])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=str(RESULTS))
    a = parser.parse_args()
    sizes = [int(s * MiB) for s in ([0.25, 4] if a.smoke else a.sizes_mib)]
    repeats = 1 if a.smoke else a.repeats
    context = mp.get_context("fork")  # the servers start with this process's imports (a spawned one re-imports them)
    servers, addresses = [], {}
    try:
        for name in TRANSPORTS:
            queue = context.Queue()
            servers.append(context.Process(target=serve, args=(name, queue), daemon=True))
            servers[-1].start()
            addresses[name] = queue.get(timeout=60)
        rows = asyncio.run(measure(addresses, sizes, repeats))
    finally:
        for server in servers:
            server.kill()
            server.join(timeout=10)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write(rows, out, smoke=a.smoke, repeats=repeats)
    save_data("transport", rows, out.parent / "results")


def write(rows: list[dict], path: Path, smoke: bool, repeats: int) -> None:
    by_key = {(row["bytes"], row["transport"]): row for row in rows}

    def cell(size: int, name: str) -> str:
        speed = by_key[size, name]["mb_s"]
        return f"{speed:.1f} ({speed / by_key[size, CEILING]['mb_s']:.2f})"

    sizes = sorted({row["bytes"] for row in rows})
    names = [name for name in TRANSPORTS if any(row["transport"] == name for row in rows)]
    lines = [
        "## Transport throughput",
        "",
        f"`python benchmarks/transport.py`{' --smoke' if smoke else ''}, {machine()}; an echo of N bytes between two "
        f"processes on loopback, median of {repeats} repeats (the transports take turns). MB/s each way: N / (t / 2) "
        f"in MB (10^6 bytes); in brackets, the fraction of the plain socket's ({CEILING}) speed in the same run.",
        "",
        *table(
            ["payload", *names],
            [[f"{size / MiB:g} MiB", *(cell(size, name) for name in names)] for size in sizes],
        ),
    ]
    update_section("transport", lines, path)


if __name__ == "__main__":
    main()
