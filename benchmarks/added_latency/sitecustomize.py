"""Software latency for ``benchmarks/slow_links.py``: Python imports this module at start-up in every process that
has this folder on ``PYTHONPATH`` (slow_links.py puts it there for the peers of a run with added latency).

With ``SLOW_LINKS_LATENCY_MS`` set, each stage request a trainer sends (``StageRouter._request``) first waits that
many milliseconds: a one-way delay added once per request, without touching the product code.
"""

from __future__ import annotations

import asyncio
import os


def add_latency(seconds: float) -> None:
    """Make every ``StageRouter._request`` sleep ``seconds`` before it sends."""
    from lightning_swarm.client.routing import StageRouter

    send = StageRouter._request

    async def delayed(self: StageRouter, *args: object, **kwargs: object) -> list:
        await asyncio.sleep(seconds)
        return await send(self, *args, **kwargs)

    StageRouter._request = delayed


if float(os.environ.get("SLOW_LINKS_LATENCY_MS", "0")) > 0:
    add_latency(float(os.environ["SLOW_LINKS_LATENCY_MS"]) / 1000)
