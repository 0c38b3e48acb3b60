"""Bounded memory on a stage server: a request that runs out of memory is answered busy and leaves nothing behind,
and callers fail over to another peer or recompute there; the kept activations' cap counts what autograd saved.

The out-of-memory errors are real ``torch.OutOfMemoryError`` raised by a block (CUDA raises the same class)."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref

import pytest
import torch
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression, discovery, protocol
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.client.routing import PeerLoad, StageRouter
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.errors import StageBusyError
from lightning_swarm.node import SwarmNode
from lightning_swarm.optimizer import swarm_optimizer
from lightning_swarm.server.kept_activations import counting_saved_bytes, default_max_bytes
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.strategy import SwarmStrategy

RUN = "memory_test"


class _FailingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, block: OutOfMemoryOnce) -> torch.Tensor:
        ctx.block = block
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        if ctx.block.fail_backward:
            ctx.block.fail_backward = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return grad, None


class OutOfMemoryOnce(nn.Module):
    """Passes its input on; once armed, its next forward or backward runs out of memory."""

    def __init__(self) -> None:
        super().__init__()
        self.fail_forward = self.fail_backward = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail_forward:
            self.fail_forward = False
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB (test)")
        return _FailingBackward.apply(x, self)


def stage() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), OutOfMemoryOnce(), nn.Linear(32, 16))


def request(server: StageServer, tensors: list[torch.Tensor], **metadata: str) -> runtime_pb2.ExpertRequest:
    return runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(t, "none") for t in tensors],
        metadata=protocol.encode_metadata({"codec": "none", **metadata}),
    )


def ask(server: StageServer, kind: str, tensors: list[torch.Tensor], **metadata: str) -> torch.Tensor:
    response = asyncio.run(server.answer(kind, request(server, tensors, **metadata)))
    return compression.deserialize(response.tensors[0])


def snapshot(server: StageServer) -> list:
    return [(p.detach().clone(), None if p.grad is None else p.grad.clone()) for p in server.params]


def assert_same_state(server: StageServer, before: list) -> None:
    for p, (value, grad) in zip(server.params, before):
        assert torch.equal(p, value)
        assert (p.grad is None and grad is None) or torch.equal(p.grad, grad)


def graph_storages(outputs: torch.Tensor) -> dict[int, int]:
    """Every storage the graph behind ``outputs`` saved (read from its nodes, whole storages, by address)."""
    storages, seen, nodes = {}, set(), [outputs.grad_fn]
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                value = getattr(node, name)
                for tensor in value if isinstance(value, (tuple, list)) else [value]:
                    if isinstance(tensor, torch.Tensor):
                        storages[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        nodes.extend(next_node for next_node, _ in node.next_functions)
    return storages


def test_kept_bytes_are_what_the_graph_holds():
    """The example's transformer blocks (attention through SDPA, views of the input, layer norms): the count is
    every storage the graph saved, the stage's input and output, and not the parameters."""
    from gpt import Block

    torch.manual_seed(0)
    blocks = nn.Sequential(Block(64, 4), Block(64, 4))
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    x = torch.randn(2, 16, 64, requires_grad=True)
    with counting_saved_bytes(blocks.parameters()) as saved:
        out = blocks(x)
    saved.count(x)
    saved.count(out)
    held = {k: v for k, v in graph_storages(out).items() if k not in params}
    held[x.untyped_storage().data_ptr()] = x.nbytes
    held[out.untyped_storage().data_ptr()] = out.nbytes
    assert saved.nbytes == sum(held.values()) > 20 * x.nbytes


def test_out_of_memory_is_answered_busy_and_leaves_the_stage_as_it_was():
    server = StageServer(RUN, 0, stage(), torch.device("cpu"))
    block = server.module[2]
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    try:
        ask(server, "backward", [x, g])  # the parameters hold gradients: a failed backward must not touch them
        before, samples = snapshot(server), server.backward_samples

        block.fail_forward = True
        with pytest.raises(StageBusyError, match="out of memory"):
            ask(server, "forward", [x], keep="a")
        assert len(server.kept) == 0 and server.kept.nbytes == 0

        ask(server, "forward", [x], keep="b")
        block.fail_backward = True
        with pytest.raises(StageBusyError, match="out of memory"):
            ask(server, "backward", [g], kept="b")
        assert len(server.kept) == 0 and server.kept.nbytes == 0  # the failed backward's graph is freed

        block.fail_backward = True
        with pytest.raises(StageBusyError, match="out of memory"):
            ask(server, "backward", [x, g])
        assert_same_state(server, before)
        assert server.backward_samples == samples

        def decode_out_of_memory(*args, **kwargs):
            raise torch.OutOfMemoryError("CUDA out of memory (test)")

        with pytest.MonkeyPatch.context() as patch:  # decoding onto the device runs out of memory
            patch.setattr(compression, "deserialize", decode_out_of_memory)
            with pytest.raises(StageBusyError, match="out of memory"):
                ask(server, "forward", [x], keep="d")
        assert len(server.kept) == 0

        plain = stage()  # the server keeps serving, with the same results as before
        x_leaf = x.clone().requires_grad_()
        expected = torch.autograd.grad(plain(x_leaf), [x_leaf, *plain.parameters()], g)
        ask(server, "forward", [x], keep="c")
        got = [ask(server, "backward", [g], kept="c"), *(p.grad for p in server.params)]
        for a, b in zip(expected, got):
            torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
    finally:
        server.shutdown()


@pytest.fixture
def two_peers():
    """Two real stage servers of stage 0 (identical blocks) on their own nodes, and a router on a third node."""
    nodes, servers = [SwarmNode().start()], []
    try:
        nodes += [SwarmNode(nodes[0].visible_maddrs()).start() for _ in range(2)]
        for node in nodes[:2]:
            server = StageServer(RUN, 0, stage(), torch.device("cpu"))
            servers.append(server)
            node.run(server.add_p2p_handlers(node.p2p, namespace=RUN), timeout=10)
            record = PeerRecord(str(node.peer_id), 0, PeerState.SERVING, 0.0, 0)
            node.dht_store(discovery.stage_key(RUN, 0), record.peer_id, record.to_value(), ttl=120)
        router = StageRouter(nodes[2], RUN, 1, request_timeout=20, ban_timeout=60, stage_wait_timeout=30)
        yield router, {str(node.peer_id): server for node, server in zip(nodes, servers)}
    finally:
        for server in servers:
            server.shutdown()
        for node in reversed(nodes):
            node.shutdown()


def test_a_router_fails_over_from_a_peer_out_of_memory(two_peers):
    router, servers = two_peers
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    plain = stage()
    x_leaf = x.clone().requires_grad_()
    out = plain(x_leaf)
    (expected_grad,) = torch.autograd.grad(out, x_leaf, g)

    sick, healthy = list(servers)
    servers[sick].module[2].fail_forward = True
    reply, peer = router.call(0, "forward", [compression.serialize(x, "none")], {"codec": "none"}, 2, prefer=sick)
    assert peer == healthy and router.stats.failovers == 1
    torch.testing.assert_close(compression.deserialize(reply[0]), out.detach())
    assert router._peers[0][sick].banned_until == 0  # busy is no failure: the peer stays in the rotation

    pipeline = RemotePipeline(router, "none")
    outputs, routes = pipeline.run_forward(x, keep=True)
    torch.testing.assert_close(outputs, out.detach())
    kept_on = servers[routes[0].peers[0]]
    kept_on.module[2].fail_backward = True  # the kept backward runs out of memory: recomputed, on either peer
    torch.testing.assert_close(pipeline.run_backward(g, routes), expected_grad)
    assert router.stats.recomputed == 1 and len(kept_on.kept) == 0


def test_busy_peers_are_waited_for_not_counted_as_failures(monkeypatch):
    router = StageRouter(node=None, run_id="unit", num_stages=1, max_retries=1, refresh_period=float("inf"))
    router._peers[0] = {"only": PeerLoad(PeerRecord("only", 0, PeerState.SERVING, 1.0, 0))}
    answers = [StageBusyError("busy"), StageBusyError("out of memory"), StageBusyError("busy"), ["reply"]]

    def call_peer(*args, **kwargs):
        answer = answers.pop(0)
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(router, "call_peer", call_peer)
    assert router.call(0, "forward", [], {}, 1) == (["reply"], "only")  # more busy answers than max_retries
    assert router.stats.failovers == 1 and not answers


def test_the_default_cap_is_1_gib_on_the_cpu_and_half_the_free_memory_on_a_gpu():
    assert default_max_bytes(torch.device("cpu")) == 2**30
    server = StageServer(RUN, 0, stage(), torch.device("cpu"))
    server.shutdown()
    assert server.kept.max_bytes == 2**30
    assert server.info()["device_memory"] == {}  # reported for GPUs only
    if not torch.cuda.is_available():
        return
    device = torch.device("cuda", torch.cuda.current_device())
    free, _ = torch.cuda.mem_get_info(device)
    assert abs(default_max_bytes(device) - free // 2) < 2**28  # other processes may allocate meanwhile


@pytest.mark.parametrize("delayed", [False, True])
def test_gradients_accumulate_on_the_parameters_device_and_reach_the_host_only_to_be_averaged(delayed):
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    node = SwarmNode().start()
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    optimizer = None
    try:
        optimizer = swarm_optimizer(
            node.dht, "accumulate_test", torch.optim.SGD(model.parameters(), lr=0.1), 10_000, 1.0, 4.0, delayed=delayed
        )
        grads = [[torch.randn_like(p) for p in model.parameters()] for _ in range(3)]
        for step_grads in grads:
            for p, g in zip(model.parameters(), step_grads):
                p.grad = g.clone()
            optimizer.step(batch_size=4)  # far from the target batch size: accumulates only
            optimizer.zero_grad()
        accumulators = optimizer.grad_averager._local_accumulators
        for i, (p, accumulated) in enumerate(zip(model.parameters(), accumulators)):
            assert accumulated.device == p.device
            assert torch.equal(accumulated, grads[0][i] + grads[1][i] + grads[2][i])
        with optimizer.grad_averager.get_tensors() as averaged:  # what the all-reduce sends: not written yet
            assert all(t.device.type == "cpu" and not t.any() for t in averaged)
        optimizer.grad_averager.load_accumulators_into_averager_()  # what a step does before its all-reduce
        with optimizer.grad_averager.get_tensors() as averaged:
            for i, t in enumerate(averaged):  # hivemind's bits: its copy, then its multiply on the host
                assert torch.equal(t, (grads[0][i] + grads[1][i] + grads[2][i]).cpu().mul_(1 / 3))
                assert t.is_pinned() == (device.type == "cuda")
        with optimizer.state_averager.get_tensors() as state:  # what a parameter round averages, on the host
            assert all(t.is_pinned() == (device.type == "cuda" and not delayed) for t in state)
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        node.shutdown()


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


@needs_gpu
@pytest.mark.parametrize("codec", ["none", "float16", "8bit"])
def test_requests_are_decoded_on_the_gpu(codec):
    server = StageServer(RUN, 0, stage().cuda(), torch.device("cuda"))
    try:
        x = torch.randn(2, 4, 16)
        message = compression.serialize(x, codec)
        decoded = server._decode(message)
        assert decoded.device.type == "cuda"
        assert torch.equal(decoded.cpu(), compression.deserialize(message))
    finally:
        server.shutdown()


class Busy(nn.Module):
    """Queues a few seconds' worth of GPU work (on most GPUs, 0.05-0.5 s) whose launch returns at once."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a = torch.randn(4096, 4096, device=x.device) / 64
        for _ in range(30):
            a = a @ a
        return self.linear(x) + 0 * a.mean()


@needs_gpu
def test_throughput_is_measured_with_the_gpu_synchronised():
    module = Busy().cuda()
    x = torch.randn(8, 16)
    with torch.no_grad():
        module(x.cuda())  # warm-up (cuBLAS)
        torch.cuda.synchronize()
        start = time.perf_counter()
        module(x.cuda())
        torch.cuda.synchronize()
        compute = time.perf_counter() - start
    server = StageServer(RUN, 0, module, torch.device("cuda"))
    try:
        ask(server, "forward", [x])
        assert 8 / server.throughput.samples_per_second > 0.5 * compute  # the kernels' time, not their launch's
    finally:
        server.shutdown()


@needs_gpu
def test_a_gpu_server_reports_its_memory_and_writes_a_snapshot_when_out_of_memory(tmp_path, monkeypatch):
    snapshot = tmp_path / "snapshot.pickle"
    monkeypatch.setenv("SWARM_MEMORY_SNAPSHOT", str(snapshot))
    server = StageServer(RUN, 0, stage().cuda(), torch.device("cuda"))
    try:
        x = torch.randn(2, 4, 16)
        ask(server, "forward", [x], keep="a")
        usage = server.info()["device_memory"]
        assert usage["peak_allocated"] >= usage["allocated"] >= server.kept.nbytes > 0
        server.module[2].fail_forward = True
        with pytest.raises(StageBusyError):
            ask(server, "forward", [x], keep="b")
        assert snapshot.stat().st_size > 0
    finally:
        server.shutdown()
        torch.cuda.memory._record_memory_history(enabled=None)


def test_averaged_gradients_are_loaded_onto_the_parameters_device_after_zero_grad():
    """An idle peer joins a round after ``zero_grad`` set ``.grad`` to None: the averaged gradient (on the host) must
    land on the parameters' device (on a GPU, hivemind's clone of the host tensor was refused)."""
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    node = SwarmNode().start()
    model = nn.Linear(8, 4).to(device)
    optimizer = None
    try:
        optimizer = swarm_optimizer(
            node.dht, "load_test", torch.optim.SGD(model.parameters(), lr=0.1), 10_000, 1.0, 4.0
        )
        grads = [torch.randn_like(p) for p in model.parameters()]
        for p, g in zip(model.parameters(), grads):
            p.grad = g.clone()
        optimizer.step(batch_size=4)
        optimizer.zero_grad()
        assert all(p.grad is None for p in model.parameters())
        optimizer.grad_averager.load_accumulators_into_averager_()
        optimizer._load_averaged_gradients_into_optimizer_()
        for p, g in zip(model.parameters(), grads):
            assert p.grad.device == p.device and torch.equal(p.grad, g)
    finally:
        if optimizer is not None:
            optimizer.shutdown()
        node.shutdown()


class Watched(nn.Module):
    """tanh, which autograd saves its output for; keeps weak references to those outputs."""

    def __init__(self) -> None:
        super().__init__()
        self.outputs: list = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.tanh(x)
        self.outputs.append(weakref.ref(y))
        return y


def test_a_forward_dropped_before_its_backward_frees_its_activations():
    """Graphs dropped without a backward (over the cap, expired, or from before a step) must free what they saved:
    an op's saved output, held by the counting hook, formed a cycle with its own graph that no collector frees."""
    torch.manual_seed(0)
    watched = Watched()
    server = StageServer(RUN, 0, nn.Sequential(nn.Linear(16, 16), watched, nn.Linear(16, 16)), torch.device("cpu"))
    x, g = torch.randn(2, 4, 16), torch.randn(2, 4, 16)
    try:
        ask(server, "forward", [x], keep="a")
        server.kept.max_bytes = server.kept.nbytes  # room for one: the next forward drops this one
        ask(server, "forward", [x], keep="b")
        assert server.kept.dropped == 1
        with torch.no_grad():
            server.params[0].add_(0.01)  # a step: the kept "b" is dropped, and its backward recomputes
        ask(server, "backward", [g], kept="b")
        gc.collect()
        assert [ref() is None for ref in watched.outputs] == [True, True, True]
    finally:
        server.shutdown()


def test_max_activation_bytes_is_a_count_or_auto(monkeypatch):
    assert SwarmStrategy().max_activation_bytes is None  # the server picks it for its device
    assert SwarmStrategy(max_activation_bytes="auto").max_activation_bytes is None
    monkeypatch.setenv("SWARM_MAX_ACTIVATION_BYTES", "123456")
    assert SwarmStrategy().max_activation_bytes == 123456
    monkeypatch.setenv("SWARM_MAX_ACTIVATION_BYTES", "AUTO")
    assert SwarmStrategy().max_activation_bytes is None
