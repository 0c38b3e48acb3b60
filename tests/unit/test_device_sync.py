"""The copies of a stage optimizer's round between the device and hivemind's shared host buffers
(``device_sync.copy_scaled``, ``copy_waited``, ``register_pinned``)."""

from __future__ import annotations

import pytest
import torch

from lightning_swarm import device_sync

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")


def hivemind_load(destinations: list[torch.Tensor], sources: list[torch.Tensor], scale: float) -> None:
    """hivemind's ``load_accumulators_into_averager_``: a copy and a multiply per tensor, on the host."""
    for out, source in zip(destinations, sources):
        out.copy_(source).mul_(scale)


def tensors(*shapes: tuple[int, ...], device: str = "cpu") -> list[torch.Tensor]:
    return [torch.randn(shape, device=device) for shape in shapes]


def test_chunks_cover_every_tensor_in_order_and_hold_at_most_the_limit():
    torch.manual_seed(0)
    sources = tensors((5,), (3,), (3, 4), (1,))
    destinations = [torch.empty_like(s) for s in sources]
    groups = list(device_sync._chunks(destinations, sources, 6))
    assert [[piece.numel() for piece, _ in group] for group in groups] == [[5], [3], [6], [6], [1]]
    pieces = [source for group in groups for _, source in group]
    assert torch.equal(torch.cat(pieces), torch.cat([s.reshape(-1) for s in sources]))
    for group in groups:  # the destinations' pieces are views: what is written into them lands in the tensors
        for out, source in group:
            out.copy_(source)
    assert all(torch.equal(out, source) for out, source in zip(destinations, sources))


def test_a_scaled_copy_on_the_cpu_gives_hiveminds_bits():
    torch.manual_seed(1)
    sources = tensors((7, 3), (11,), (2, 2, 2))
    ours, theirs = [torch.empty_like(s) for s in sources], [torch.empty_like(s) for s in sources]
    device_sync.copy_scaled(ours, sources, 1 / 3)
    hivemind_load(theirs, sources, 1 / 3)
    assert all(torch.equal(a, b) for a, b in zip(ours, theirs))


def test_a_waited_copy_sets_every_destination():
    torch.manual_seed(2)
    sources = tensors((4,), (2, 3))
    destinations = [torch.zeros_like(s) for s in sources]
    device_sync.copy_waited(destinations, sources)
    assert all(torch.equal(a, b) for a, b in zip(destinations, sources))


@needs_gpu
def test_on_a_gpu_shared_buffers_are_pinned_and_scaled_copies_give_the_hosts_bits(monkeypatch):
    """hivemind's shared host buffers, registered, read as pinned; a scaled copy from the GPU, cut into pieces of a
    few elements (a tensor across pieces too), gives the bits the host's copy and multiply give; unregistered after."""
    torch.manual_seed(3)
    monkeypatch.setattr(device_sync, "SCALED_CHUNK", 5)
    sources = tensors((7, 3), (11,), (2,), device="cuda")
    shared = [torch.zeros(s.shape).share_memory_() for s in sources]
    registered = device_sync.register_pinned(shared)
    try:
        assert len(registered) == len(shared) and all(t.is_pinned() for t in shared)
        device_sync.copy_scaled(shared, sources, 1 / 3)
        expected = [torch.empty(s.shape) for s in sources]
        hivemind_load(expected, [s.cpu() for s in sources], 1 / 3)
        assert all(torch.equal(a, b) for a, b in zip(shared, expected))
        back = [torch.zeros_like(s) for s in sources]
        device_sync.copy_waited(back, shared)
        assert all(torch.equal(a.cpu(), b) for a, b in zip(back, expected))
    finally:
        device_sync.unregister_pinned(registered)
    assert not any(t.is_pinned() for t in shared)
