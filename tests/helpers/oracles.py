"""Test oracles: what a correct result must be, computed independently of the code under test (the benchmarks use
them too, to check their own figures)."""

from __future__ import annotations

import torch

from lightning_swarm import compression


def error_bound(tensor: torch.Tensor, codec: str) -> torch.Tensor:
    """The largest elementwise error ``deserialize(serialize(tensor, codec))`` may have, per element."""
    if codec == "none" or not tensor.is_floating_point():
        return torch.zeros_like(tensor, dtype=torch.float32)
    flat = tensor.detach().float().flatten()
    if codec == "float16":  # round to nearest: half an ulp of float16 (10 mantissa bits), min normal spacing
        return (flat.abs() * 2.0**-11 + 2.0**-25).view(tensor.shape)
    # a value is coded by one of the two codes that bracket it (scaled by its block's absmax), then rounded to the
    # dtype it is decoded to (float32 arithmetic at best)
    max_gap = float(compression._code_table(torch.device("cpu")).sort().values.diff().max())
    rounding = max(torch.finfo(tensor.dtype).eps, torch.finfo(torch.float32).eps)
    block = compression.BLOCK_SIZE
    padded = torch.nn.functional.pad(flat, (0, (-flat.numel()) % block))
    absmax = padded.view(-1, block).abs().amax(dim=1, keepdim=True)
    bound = (absmax * (max_gap + rounding)).expand(-1, block).flatten()[: flat.numel()]
    return bound.view(tensor.shape)


def best_allocation(throughput: dict[str, float], num_stages: int) -> float:
    """The highest swarm throughput (the lowest stage capacity) any allocation of these peers to ``num_stages``
    stages reaches (exhaustive; for small swarms)."""
    peers = sorted(throughput, key=throughput.get, reverse=True)
    best = 0.0

    def place(i: int, totals: list[float]) -> None:
        nonlocal best
        if i == len(peers):
            best = max(best, min(totals))
            return
        seen = set()
        for k in range(num_stages):
            if totals[k] in seen:  # stages with equal totals are interchangeable
                continue
            seen.add(totals[k])
            totals[k] += throughput[peers[i]]
            place(i + 1, totals)
            totals[k] -= throughput[peers[i]]

    place(0, [0.0] * num_stages)
    return best
