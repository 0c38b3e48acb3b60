"""The remote pipeline: a batch's microbatches travel the stages concurrently, and only the replies it returns are
decoded."""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch

from lightning_swarm import compression
from lightning_swarm.block_calls import MetaBlocks
from lightning_swarm.client.remote_pipeline import RemotePipeline
from lightning_swarm.client.routing import RouterStats


class EchoRouter:
    """Stands in for a StageRouter: every stage answers its input back, checked as the router checks replies;
    records the calls' batch sizes and how many were in flight at once. With ``together`` set, a call to a stage
    is answered only once that many calls to the stage are in flight (a barrier: calls made one after another
    never pass it, and fail after ``patience`` seconds)."""

    num_stages = 2

    def __init__(self, patience: float = 30.0) -> None:
        self.stats, self.lock, self.active, self.most, self.batches = RouterStats(), threading.Lock(), 0, 0, []
        self.patience, self.barriers = patience, None

    def together(self, count: int) -> None:
        self.barriers = [threading.Barrier(count, timeout=self.patience) for _ in range(self.num_stages)]
        self.batches, self.most = [], 0

    def call(self, stage, method, messages, metadata, batch, prefer=None, check=None):
        with self.lock:
            self.active += 1
            self.most = max(self.most, self.active)
            self.batches.append(batch)
        try:
            if self.barriers is not None:
                self.barriers[stage].wait()
        finally:
            with self.lock:
                self.active -= 1
        check([messages[-1]])
        return [messages[-1]], "peer"

    def call_peer(self, stage, peer, method, messages, metadata, batch, check):
        return self.call(stage, method, messages, metadata, batch, check=check)[0]


def test_auto_microbatches_are_resolved_per_batch_and_travel_concurrently():
    """One pipeline, batches of different sizes: each is split by the rule, and all its microbatches are in flight
    at each stage at once: a stage answers only when every microbatch of the batch has called it (if the pipeline
    sent them one after another, the first would wait for the others in vain)."""
    router = EchoRouter()
    pipeline = RemotePipeline(router, codec="none")
    try:
        for batch_size, count in [(8, 4), (6, 3), (5, 1)]:
            router.together(count)
            x = torch.randn(batch_size, 3)
            with torch.no_grad():
                assert torch.equal(pipeline(x), x)
            assert router.batches == [batch_size // count] * count * router.num_stages
            assert router.most == count
    finally:
        pipeline.close()


def test_the_pipeline_decodes_only_what_it_returns(monkeypatch):
    """Forward and backward through 2 stages, 4 microbatches: only the last reply of each microbatch's route is
    decoded (by its check, and handed back as decoded); the reply of stage 0 goes on to stage 1 unread."""
    decoded = []
    deserialize = compression.deserialize
    monkeypatch.setattr(compression, "deserialize", lambda *a, **k: decoded.append(1) or deserialize(*a, **k))
    router = EchoRouter()
    pipeline = RemotePipeline(router, codec="8bit", microbatches=4)
    try:
        x = torch.randn(8, 3, requires_grad=True)
        y = pipeline(x)
        assert len(decoded) == 4 and torch.allclose(y, x, atol=0.05)
        y.sum().backward()
        assert len(decoded) == 2 * 4 and torch.allclose(x.grad, torch.ones_like(x), atol=0.05)
    finally:
        pipeline.close()


def test_the_batch_is_assembled_where_its_microbatches_replies_are_decoded(monkeypatch):
    """Blocks known on the meta device, 3 microbatches: each reply is decoded straight into its slice of the batch's
    output or input gradient (nothing concatenated), and the input gradient equals the old assembly's exactly: each
    microbatch's output gradient sent times 3 (the gradient of its own mean loss), the replies divided by 3."""
    joined = []
    cat = torch.cat
    monkeypatch.setattr(torch, "cat", lambda *a, **k: joined.append(1) or cat(*a, **k))
    meta = MetaBlocks([torch.nn.Identity(), torch.nn.Identity()])
    pipeline = RemotePipeline(EchoRouter(), codec="none", microbatches=3, spans=[(0, 1), (1, 2)], meta=meta)
    try:
        x = torch.randn(9, 5, requires_grad=True)
        y = pipeline(x)
        weights = torch.randn(9, 5)
        (y * weights).sum().backward()
    finally:
        pipeline.close()
    assert joined == []
    assert torch.equal(y, x)
    assert torch.equal(x.grad, cat([part * 3 / 3 for part in weights.chunk(3)]))


def test_a_batch_assembled_in_place_under_inference_mode():
    """Lightning validates under inference mode, which the microbatches' threads do not inherit: the batch's tensor
    they decode into must still be writable there (an inference tensor refused the write: every validation call
    failed and the peer was blamed)."""
    meta = MetaBlocks([torch.nn.Identity(), torch.nn.Identity()])
    pipeline = RemotePipeline(EchoRouter(), codec="none", microbatches=3, spans=[(0, 1), (1, 2)], meta=meta)
    try:
        x = torch.randn(9, 5)
        with torch.inference_mode():
            assert torch.equal(pipeline(x), x)
    finally:
        pipeline.close()


class GatedRouter(EchoRouter):
    """An EchoRouter whose backward calls (only the first ``held`` if given) wait for ``gate`` (and raise ``error``
    if set); ``most`` counts the calls in flight, waiting ones included; ``backwards`` the backward calls made,
    ``answered`` those answered."""

    def __init__(self, held: Optional[int] = None) -> None:
        super().__init__()
        self.gate, self.error, self.waiting, self.held = threading.Event(), None, 0, held
        self.backwards = self.answered = 0

    def call(self, stage, method, messages, metadata, batch, prefer=None, check=None):
        with self.lock:
            self.waiting += 1
            self.most = max(self.most, self.waiting)
            if method == "backward":
                self.backwards += 1
                gated = self.held is None or self.backwards <= self.held
        try:
            if method == "backward":
                if gated:
                    assert self.gate.wait(30), "the backward was never released"
                if self.error is not None:
                    raise self.error
            reply = super().call(stage, method, messages, metadata, batch, prefer, check)
            if method == "backward":
                with self.lock:
                    self.answered += 1
            return reply
        finally:
            with self.lock:
                self.waiting -= 1


def test_a_trailing_backward_runs_behind_the_next_forward_and_lands_the_same_gradients():
    """With ``trail_backward`` the loss's backward returns while the stages' backward is held; the next batch's
    forward starts meanwhile, its microbatches taking the places of the backward's as they end (never more than a
    batch's microbatches in flight: a stage's fair share); ``finish_backward`` then takes the input gradient through
    the module before the pipeline, times its scale, once (the second of two pipeline calls in a row trails the
    first's): the gradients of a backward that waited, scaled."""
    torch.manual_seed(0)
    embed, x, w = torch.nn.Linear(5, 5), torch.randn(6, 5), torch.randn(6, 5)
    router = GatedRouter()
    pipeline = RemotePipeline(router, codec="none", microbatches=2)

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return (pipeline(pipeline(embed(batch)) * 2) * w).sum()

    try:
        router.gate.set()
        loss(x).backward()
        waited = embed.weight.grad.clone()
        embed.zero_grad()

        router.gate.clear()
        pipeline.trail_backward = True
        loss(x).backward()  # returns with the stages' backward held
        assert embed.weight.grad is None and router.stats.trailing == 1
        pipeline.trail_backward = False
        following = torch.randn(6, 5, requires_grad=True)
        outputs = []
        forward = threading.Thread(target=lambda: outputs.append(pipeline(following)))  # the next batch
        forward.start()
        forward.join(0.5)
        assert forward.is_alive() and router.most == 2  # it waits for the held backward's places
        router.gate.set()
        forward.join(30)
        torch.testing.assert_close(outputs[0], following)
        assert router.most == 2
        pipeline.finish_backward(scale=0.5)
        torch.testing.assert_close(embed.weight.grad, 0.5 * waited)
        (outputs[0] * w).sum().backward()
        torch.testing.assert_close(following.grad, w)
        pipeline.finish_backward()  # nothing left: nothing changes
        torch.testing.assert_close(embed.weight.grad, 0.5 * waited)
    finally:
        router.gate.set()
        pipeline.close()


def test_a_trailing_backward_that_failed_raises_when_it_is_landed():
    router = GatedRouter()
    router.error = RuntimeError("stage 1 is gone")
    pipeline = RemotePipeline(router, codec="none", microbatches=1)
    pipeline.trail_backward = True
    try:
        x = torch.randn(4, 3, requires_grad=True)
        pipeline(x * 1.0).sum().backward()  # the failure comes later, on the backward thread
        router.gate.set()
        try:
            pipeline.finish_backward()
        except RuntimeError as e:
            assert "stage 1 is gone" in str(e)
        else:
            raise AssertionError("a failed trailing backward landed silently")
        assert x.grad is None
    finally:
        pipeline.close()


def test_the_next_backward_leaves_while_the_one_before_still_runs_and_each_lands_once():
    """A batch's trailing backward is sent while the previous batch's is still held at the stages (its sends wait
    for nothing older); landing all but the latest then takes only the older one's input gradient, times its
    scale, and the latest lands later: the gradients of backwards that waited."""
    torch.manual_seed(0)
    embed, w = torch.nn.Linear(5, 5), torch.randn(6, 5)
    first, second = torch.randn(6, 5), torch.randn(6, 5)
    router = GatedRouter(held=2)
    pipeline = RemotePipeline(router, codec="none", microbatches=2)
    pipeline._places = lambda count: 2 * count  # chain wiring's places: the next forward does not wait for them

    def loss(batch: torch.Tensor) -> torch.Tensor:
        return (pipeline(embed(batch)) * w).sum()

    def waited(batch: torch.Tensor) -> torch.Tensor:
        embed.zero_grad()
        loss(batch).backward()
        return embed.weight.grad.clone()

    try:
        router.gate.set()
        expected_first, expected_second = waited(first), waited(second)
        embed.zero_grad()
        router.gate.clear()
        router.backwards = router.answered = 0

        pipeline.trail_backward = True
        loss(first).backward()  # its two microbatches' backward calls are held
        loss(second).backward()
        deadline = time.monotonic() + 30
        while router.answered < 4:  # two microbatches through two stages
            assert time.monotonic() < deadline, "the next backward waited for the one before to end"
            time.sleep(0.01)
        assert not router.gate.is_set() and embed.weight.grad is None

        router.gate.set()
        pipeline.finish_backward(scale=0.5, but_latest=True)
        torch.testing.assert_close(embed.weight.grad, 0.5 * expected_first)
        pipeline.finish_backward()
        torch.testing.assert_close(embed.weight.grad, 0.5 * expected_first + expected_second)
        assert router.answered == 8 and router.stats.trailing == 2
    finally:
        router.gate.set()
        pipeline.close()


def test_microbatch_tuning_times_an_overlapped_batch_from_the_end_of_the_backward_before(monkeypatch):
    """A batch whose forward overlapped the previous batch's trailing backward is timed from that backward's end,
    not from its own start: the wait behind the batch before is not its cost (timing it made "auto" climb to the
    most microbatches on an H200 at target 128). A batch that did not overlap, and the earlier segment of a batch
    of two pipeline calls, are timed from their forward's start. The clock is set by hand."""
    from lightning_swarm.client import remote_pipeline

    clock, readers = [0.0], set()

    def now() -> float:
        readers.add(threading.get_ident())
        return clock[0]

    monkeypatch.setattr(remote_pipeline.time, "perf_counter", now)
    router = GatedRouter()
    pipeline = RemotePipeline(router, codec="none", microbatches=1)
    timed = []
    pipeline.tuner.record = lambda size, count, seconds, overlapped: timed.append((seconds, overlapped))
    x = torch.randn(6, 5, requires_grad=True)
    try:
        pipeline.trail_backward = True
        pipeline(x * 1.0).sum().backward()  # forward at 0, its backward held
        pipeline.trail_backward = False
        clock[0] = 10.0
        outputs = []
        forward = threading.Thread(target=lambda: outputs.append(pipeline(x * 1.0)))  # starts at 10
        forward.start()
        deadline = time.monotonic() + 30
        while forward.ident not in readers:  # it read its start (10) before the clock moves on
            assert time.monotonic() < deadline, "the next batch's forward never started"
            time.sleep(0.01)
        clock[0] = 15.0
        router.gate.set()  # the held backward ends at 15
        forward.join(30)
        pipeline.finish_backward()
        clock[0] = 20.0
        outputs[0].sum().backward()  # ends at 20
        assert timed == [(15.0, False), (5.0, True)]

        clock[0] = 30.0
        first = pipeline(x * 1.0)
        clock[0] = 32.0
        second = pipeline(first * 1.0)
        clock[0] = 40.0
        second.sum().backward()  # both segments' backwards end at 40
        assert timed[2:] == [(8.0, False), (10.0, False)]
    finally:
        router.gate.set()
        pipeline.close()
