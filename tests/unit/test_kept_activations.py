"""Backward without recomputation: a stage server keeps a training forward's graph for the backward that follows,
bounded in memory and time, and falls back to recomputing from the input. Gradients must equal plain autograd's."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from helpers.stage import ask, blocks
from hivemind.proto import runtime_pb2
from torch import nn

from lightning_swarm import compression, protocol
from lightning_swarm.errors import ActivationsLostError
from lightning_swarm.server.kept_activations import Kept, KeptActivations
from lightning_swarm.server.stage_server import StageServer


def plain_gradients(module: nn.Module, x: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
    x = x.clone().requires_grad_()
    return list(torch.autograd.grad(module(x), [x, *module.parameters()], g))


def served_gradients(server: StageServer, grad_input: torch.Tensor) -> list[torch.Tensor]:
    return [grad_input, *(p.grad.clone() for p in server.params)]


@pytest.fixture
def make_server():
    servers = []

    def make(**kwargs) -> StageServer:
        servers.append(StageServer("run", 0, blocks(), torch.device("cpu"), **kwargs))
        return servers[-1]

    yield make
    for server in servers:
        server.shutdown()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_kept_backward_equals_plain_autograd_and_recomputation(make_server, checkpointing):
    server = make_server(checkpoint_activations=checkpointing)
    x, g = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    expected = plain_gradients(blocks(), x, g)

    out = ask(server, "forward", [x], keep="k1")
    assert torch.equal(out, blocks()(x).detach())
    assert server.kept.nbytes > 0 and len(server.kept) == 1
    kept = served_gradients(server, ask(server, "backward", [g], kept="k1"))
    assert server.kept.nbytes == 0 and len(server.kept) == 0
    recomputed = served_gradients(server, ask(server, "backward", [x, g]))
    for a, b, c in zip(expected, kept, recomputed):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(c, a, rtol=1e-6, atol=1e-7)
    assert server.backward_samples == 8
    with pytest.raises(ActivationsLostError):  # a kept forward serves one backward only
        ask(server, "backward", [g], kept="k1")


def test_checkpointing_keeps_less(make_server):
    x = torch.randn(4, 8, 16)
    full, checkpointed = make_server(), make_server(checkpoint_activations=True)
    ask(full, "forward", [x], keep="a")
    ask(checkpointed, "forward", [x], keep="a")
    # three blocks: each keeps its input and two 64-wide hidden activations, and the stage's output is kept too;
    # with checkpointing, only the blocks' inputs and the output
    assert full.kept.nbytes == (3 * (1 + 4 + 4) + 1) * x.nbytes
    assert checkpointed.kept.nbytes == (3 + 1) * x.nbytes


def test_memory_and_time_bounds_drop_the_oldest(make_server):
    x, g = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    probe = make_server()
    ask(probe, "forward", [x], keep="p")
    one = probe.kept.nbytes
    server = make_server(max_activation_bytes=int(1.5 * one), activation_timeout=0.2)
    ask(server, "forward", [x], keep="first")
    ask(server, "forward", [x], keep="second")  # over the cap: "first" is dropped
    assert len(server.kept) == 1 and server.kept.dropped == 1 and server.kept.nbytes == one
    assert server.info()["dropped_forwards"] == 1  # reported, with the stage's metrics (swarm/dropped_forwards)
    with pytest.raises(ActivationsLostError):
        ask(server, "backward", [g], kept="first")
    ask(server, "backward", [x, g])  # the fallback: recompute from the input
    time.sleep(0.3)
    server.kept.expire()
    assert len(server.kept) == 0 and server.kept.nbytes == 0 and server.kept.dropped == 2
    assert server.info()["dropped_forwards"] == 2


def test_a_step_between_forward_and_backward_recomputes_with_the_new_parameters(make_server):
    server = make_server()
    x, g = torch.randn(4, 8, 16), torch.randn(4, 8, 16)
    ask(server, "forward", [x], keep="k")
    with torch.no_grad():
        for p in server.params:
            p.add_(0.01)  # what an optimizer step does, in place
    stepped = blocks()
    with torch.no_grad():
        for p in stepped.parameters():
            p.add_(0.01)
    got = served_gradients(server, ask(server, "backward", [g], kept="k"))
    for a, b in zip(plain_gradients(stepped, x, g), got):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_kept_forwards_are_private_to_their_caller(make_server):
    server = make_server()
    x, g = torch.randn(2, 8, 16), torch.randn(2, 8, 16)
    ask(server, "forward", [x], keep="k")
    request = runtime_pb2.ExpertRequest(
        uid=server.uid,
        tensors=[compression.serialize(g, "none")],
        metadata=protocol.encode_metadata({"codec": "none", "kept": "k"}),
    )
    with pytest.raises(ActivationsLostError):
        asyncio.run(server.answer("backward", request, caller="another peer"))
    assert server.backward_samples == 0 and all(p.grad is None for p in server.params)


def test_a_key_put_again_replaces_its_entry_and_its_bytes():
    kept = KeptActivations(max_bytes=1000, ttl=60.0)
    entry = Kept(torch.zeros(1), torch.zeros(1), nbytes=25, params_version=0)
    for _ in range(100):  # any admitted caller can reuse its key: the count must not grow with each put
        kept.put("k", entry)
    assert len(kept) == 1 and kept.nbytes == 25 and kept.dropped == 0
    kept.put("other", entry)
    assert len(kept) == 2 and kept.nbytes == 50
    kept.put("k", Kept(torch.zeros(1), torch.zeros(1), nbytes=2000, params_version=0))  # too big: the key is empty
    assert len(kept) == 1 and kept.nbytes == 25 and kept.pop("k") is None


def test_past_the_cap_the_caller_holding_the_most_gives_way():
    """A caller that keeps forwards without ever sending their backward (a flood) loses its own oldest past the cap;
    the forwards of a caller that holds less survive, however old."""
    kept = KeptActivations(max_bytes=1000, ttl=60.0)

    def entry(owner: str) -> Kept:
        return Kept(torch.zeros(1), torch.zeros(1), nbytes=100, params_version=0, owner=owner)

    for i in range(3):
        kept.put(("honest", f"h{i}"), entry("honest"))
    for i in range(50):
        kept.put(("flooder", f"f{i}"), entry("flooder"))
    assert [kept.pop(("honest", f"h{i}"), backward_of="honest") is not None for i in range(3)] == [True] * 3
    assert kept.owned("flooder") == 700 and kept.nbytes == 700 and kept.dropped == 43
    assert kept.pop(("flooder", "f42")) is None and kept.pop(("flooder", "f43")) is not None
    for i in range(10):  # the honest caller now needs the whole cap: the flooder, which sent no backward, gives way
        kept.put(("honest", f"again{i}"), entry("honest"))  # until the honest one holds far more
    assert kept.owned("honest") == 800 and kept.owned("flooder") == 200


def test_a_trainer_that_sends_its_backwards_outlasts_a_flooder_while_holding_more():
    """A trainer whose backward trails holds two batches of forwards, more than a flooder does: past the cap the
    flooder, which never sent a backward, still gives way. A backward counts for its trainer whether its forward was
    still kept or not (the cap's choices are not held against it); a forward taken back otherwise (its input refused)
    does not count. Between trainers that send their backwards, the one holding the most gives way, oldest first."""
    kept = KeptActivations(max_bytes=1000, ttl=60.0)

    def entry(owner: str) -> Kept:
        return Kept(torch.zeros(1), torch.zeros(1), nbytes=100, params_version=0, owner=owner)

    for batch in range(20):  # the trainer's forwards so far all had their backward
        for i in range(4):
            kept.put(("trainer", (batch, i)), entry("trainer"))
        for i in range(4):
            assert kept.pop(("trainer", (batch, i)), backward_of="trainer") is not None
    for i in range(300):
        kept.put(("flooder", i), entry("flooder"))
    assert kept.use("trainer") > 0.99 and kept.use("flooder") < 0.1
    for i in range(10):  # two batches at once: more than the flooder holds from the 7th on
        kept.put(("trainer", i), entry("trainer"))
    assert (kept.owned("trainer"), kept.owned("flooder")) == (1000, 0)
    use = kept.use("trainer")
    assert kept.pop(("trainer", "dropped"), backward_of="trainer") is None and kept.use("trainer") > use
    assert all(kept.pop(("trainer", i), backward_of="trainer") is not None for i in range(10))
    kept.put(("trainer", "refused"), entry("trainer"))
    use = kept.use("trainer")
    assert kept.pop(("trainer", "refused")) is not None and kept.use("trainer") == use

    for owner in ("a", "b"):  # two trainers that send their backwards: the one holding the most gives way
        kept.put((owner, "used"), entry(owner))
        kept.pop((owner, "used"), backward_of=owner)
    for i in range(6):
        kept.put(("a", i), entry("a"))
    for i in range(5):
        kept.put(("b", i), entry("b"))
    assert (kept.owned("a"), kept.owned("b")) == (500, 500) and kept.pop(("a", 0)) is None
