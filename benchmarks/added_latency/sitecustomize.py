"""Software latency for the benchmarks: Python imports this module at start-up in every process that has this folder
on ``PYTHONPATH`` (``slow_links.py`` puts it there for the peers of a run with added latency).

- ``SLOW_LINKS_LATENCY_MS``: each stage request a trainer sends (``StageRouter._request``) first waits that many
  milliseconds: a one-way delay added once per request.
- ``SLOW_LINKS_MESSAGE_LATENCY_MS``: every message on the direct path, between any two peers (a request, a
  stage's hand-on to the next stage, a collect, and each of their replies), arrives that many milliseconds late: a
  one-way delay per message, as links with that latency would add (netem is not available here).

Neither touches the product code.
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


def add_message_latency(seconds: float) -> None:
    """Make every direct-path call (``DirectClient.call``) reach its peer ``seconds`` late, and its reply too."""
    from lightning_swarm.transport import DirectClient

    call = DirectClient.call

    async def delayed(self: DirectClient, *args: object, **kwargs: object) -> list:
        await asyncio.sleep(seconds)  # the request's way there
        reply = await call(self, *args, **kwargs)
        await asyncio.sleep(seconds)  # the reply's way back
        return reply

    DirectClient.call = delayed


if float(os.environ.get("SLOW_LINKS_LATENCY_MS", "0")) > 0:
    add_latency(float(os.environ["SLOW_LINKS_LATENCY_MS"]) / 1000)
if float(os.environ.get("SLOW_LINKS_MESSAGE_LATENCY_MS", "0")) > 0:
    add_message_latency(float(os.environ["SLOW_LINKS_MESSAGE_LATENCY_MS"]) / 1000)
