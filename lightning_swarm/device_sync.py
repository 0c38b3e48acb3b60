"""The places where host code waits for the device, in one module.

A GPU runs kernels after they were launched, so the host waits only where it needs a result: the stage server's
synchronize after each request (:meth:`~lightning_swarm.server.stage_server.StageServer._synchronize`), the
finiteness check of a decoded request (a device-wide reduction read on the host), and the device-to-host copy of an
encoded tensor (:func:`~lightning_swarm.compression.encode`). Each goes through a function here, looked up at every
call, so that ``benchmarks/gpu_proxy.py`` can put an emulated device in their place (its device time on a timeline
that the processes of a swarm share); the functions themselves are exactly the torch calls they stand for.
"""

from __future__ import annotations

import torch


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on ``device`` (nothing to wait for on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of ``tensor`` is finite (on a GPU, the host waits for the reduction)."""
    return bool(torch.isfinite(tensor).all())


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` in host memory (on a GPU, the copy waits for the work queued before it)."""
    return tensor.cpu()
