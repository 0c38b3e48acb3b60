"""The remote pipeline: a batch's microbatches travel the stages concurrently, and only the replies it returns are
decoded."""

from __future__ import annotations

import threading

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
