"""The task pool hands the runtime several callers' inference forwards as one batch, keeping their turns; training
forwards run one by one. A real stage server, its worker held while the requests queue."""

from __future__ import annotations

import asyncio
import threading

import torch
from helpers.stage import HeldLock
from torch import nn

from lightning_swarm import compression, protocol
from lightning_swarm.server.fair_queue import FairQueue
from lightning_swarm.server.stage_server import StageServer
from lightning_swarm.transport import DirectRequest

CPU = torch.device("cpu")


class Counted(nn.Linear):
    """A linear block that records the samples of each pass it computes."""

    def __init__(self) -> None:
        super().__init__(16, 16)
        self.passes: list[int] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "meta":
            self.passes.append(x.shape[0])
        return super().forward(x)


def forward(server: StageServer, caller: str, x: torch.Tensor, **metadata) -> asyncio.Future:
    request = DirectRequest(server.uid, [compression.encode(x, "none")], protocol.encode_metadata(metadata))
    return asyncio.ensure_future(server.answer_tensors("forward", request, caller))


def test_inference_forwards_of_several_callers_run_as_one_pass_and_each_gets_its_own_output():
    """While the worker holds a's forward, b, c and d (3 samples each) queue an inference forward, f a training one
    and e another inference one: b, c and d run as one pass of 9 samples (max_request_samples 10 leaves e out), f
    and e alone; each caller gets the output of its own input."""
    torch.manual_seed(0)
    block = Counted()
    server = StageServer("run", 0, block, CPU, max_request_samples=10)
    inputs = {caller: torch.randn(3, 16) for caller in "abcdef"}
    server.backend.lock = lock = HeldLock()
    lock.acquire()  # the worker waits with the first request while the others queue

    async def scenario() -> dict:
        answers = {"a": forward(server, "a", inputs["a"], train=False)}
        while not lock.wanted.is_set():  # until the worker took it
            await asyncio.sleep(0.01)
        # requests are decoded in a thread pool: each is queued before the next is sent, so their turns are fixed
        inference = {"train": False}
        turns = [("b", inference), ("c", inference), ("d", inference), ("f", {"keep": "k"}), ("e", inference)]
        for queued, (caller, metadata) in enumerate(turns, start=1):
            answers[caller] = forward(server, caller, inputs[caller], **metadata)
            while server._tasks.qsize() < queued:
                await asyncio.sleep(0.01)
        threading.Timer(0.0, lock.release).start()
        return {caller: compression.deserialize((await answer)[0]) for caller, answer in answers.items()}

    try:
        outputs = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        server.shutdown()
    with torch.no_grad():
        for caller, x in inputs.items():
            torch.testing.assert_close(outputs[caller], nn.functional.linear(x, block.weight, block.bias))
    assert block.passes == [3, 9, 3, 3]  # a; b, c and d; then f and e in their turns (both 3 samples)


def test_a_batch_keeps_the_callers_turns():
    """The batch is the next item in turn and those right after it, up to the first that does not join."""
    fair = FairQueue(8)
    for caller, item in [("a", "x1"), ("b", "x2"), ("c", "y"), ("a", "x3"), ("d", "x4")]:
        fair.put(caller, item, 1)
    joins = lambda taken, item: taken[0].startswith("x") and item.startswith("x")  # noqa: E731
    assert fair.get_many(1.0, joins) == ["x1", "x2"]  # c's turn comes before a's second: the batch ends at c
    assert fair.get_many(1.0, joins) == ["y"]
    assert fair.get_many(1.0, joins) == ["x4", "x3"]  # d has waited since the start, a's second since its first
