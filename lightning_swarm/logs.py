"""The project's log lines: stamped with the time, level and caller as hivemind stamps its own, repeated waiting
lines printed at most once a period, and hivemind's known noise in a healthy swarm kept quiet."""

from __future__ import annotations

import asyncio
import logging
import math
import sys
import threading
import time
from typing import Callable, Hashable

from hivemind.utils.logging import CustomFormatter

from lightning_swarm.errors import MID_STEP

ROOT_LOGGER = "lightning_swarm"


class _UnlessConfigured(logging.StreamHandler):
    """Prints to stderr only while the application configured no root handler (which then prints the lines)."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            super().emit(record)


def use_swarm_log_handler() -> None:
    """Give the ``lightning_swarm`` loggers a handler that prints warnings and errors as hivemind's lines are
    printed (``Nov 23 13:14:05.123 [WARNING] [caller] message``) instead of Python's bare last-resort line. Once per
    process; lines still propagate to the application's handlers, which print them alone once it has some."""
    logger = logging.getLogger(ROOT_LOGGER)
    if any(isinstance(h, _UnlessConfigured) for h in logger.handlers):
        return
    handler = _UnlessConfigured()
    handler.setLevel(logging.WARNING)
    handler.setFormatter(
        CustomFormatter(
            fmt="{asctime}.{msecs:03.0f} [{bold}{levelcolor}{levelname}{reset}]{caller_block} {message}",
            style="{",
            datefmt="%b %d %H:%M:%S",
        )
    )
    logger.addHandler(handler)


class _HivemindNoise(logging.Filter):
    """Keeps hivemind's known noise of a healthy swarm out of the logs (each case is a normal event there):

    - an all-reduce round that found no group is logged at ERROR with a traceback; the peer then steps with its own
      gradients and catches up with the others later: demoted to one INFO line, without the traceback;
    - a round cancelled while it waited for its peer to start it (the peer stepped without it): a traceback at
      ERROR, demoted to one INFO line;
    - a state download that a peer refused because it was in the middle of a step (the downloader tries another
      peer, or again later) is logged at ERROR with a traceback by the downloader, and as a warning plus a traceback
      of the failed request handler by the refusing peer: each demoted to one INFO line;
    - a round whose step was cancelled (its peer caught up by downloading the state) that then finishes: hivemind
      catches asyncio's ``InvalidStateError`` but not the one its futures raise, and asyncio reports "Task
      exception was never retrieved" with a traceback: dropped;
    - a libp2p stream that its caller closed before the daemon's connection was handled: uvloop reports
      "Unhandled exception in client_connected_cb" (``cannot reuse already awaited coroutine``): dropped;
    - when an averager process stops, asyncio reports its matchmaking tasks as "destroyed but pending" (and, at
      interpreter exit, the tasks of any background loop), and hivemind the ``GeneratorExit`` of cancelling them:
      dropped;
    - matchmaking's "Another look_for_group is already in progress" (INFO: a round asked for while the last one
      still assembles waits for it) and an all-reduce's "Reducer: received 50.0% of input tensors" (a warning: a
      partner left the round, which then counts as failed): each demoted to one DEBUG line.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        error = record.exc_info[1] if record.exc_info else None
        message = record.getMessage()
        if message.startswith(("Another look_for_group is already in progress", "Reducer: received")):
            return _to_line(record, message, logging.DEBUG)
        if error is not None and "could not find a group" in str(error):
            return _to_info_line(record, f"All-reduce round: {error}")
        if isinstance(error, asyncio.CancelledError) and record.name == "hivemind.averaging.averager":
            return _to_info_line(record, "All-reduce round: cancelled")
        if message.startswith("Failed to download state from") and MID_STEP in message:
            return _to_info_line(record, message)
        if MID_STEP in (message if error is None else str(error)):  # the refusing side: its warning, its handler's
            return _to_info_line(record, f"State download refused: {MID_STEP}")
        if message.startswith("Unhandled exception in client_connected_cb") and "already awaited" in str(error):
            return False
        if type(error).__name__ == "InvalidStateError" and "CANCELLED" in str(error) and "Averager" in message:
            return False
        if message.startswith("Task was destroyed but it is pending") and (
            "hivemind" in message or sys.is_finalizing()
        ):
            return False  # hivemind's tasks, or any background loop's at interpreter exit
        return not (isinstance(error, GeneratorExit) and "hivemind" in message)


def _to_info_line(record: logging.LogRecord, message: str) -> bool:
    """Make ``record`` one INFO line saying ``message``, without a traceback; whether its logger shows INFO."""
    return _to_line(record, message, logging.INFO)


def _to_line(record: logging.LogRecord, message: str, level: int) -> bool:
    """Make ``record`` one line at ``level`` saying ``message``, without a traceback; whether its logger shows it."""
    record.levelno, record.levelname = level, logging.getLevelName(level)
    record.msg, record.args, record.exc_info, record.exc_text = message, (), None, None
    return logging.getLogger(record.name).isEnabledFor(level)


HIVEMIND_NOISE_LOGGERS = (
    "hivemind.averaging.averager",
    "hivemind.averaging.matchmaking",
    "hivemind.averaging.partition",
    "hivemind.optim.optimizer",
    "hivemind.p2p.p2p_daemon",
    "hivemind.utils.asyncio",
    "asyncio",
)


def quiet_hivemind_noise() -> None:
    """Install the :class:`_HivemindNoise` filter (once per process; processes forked later inherit it)."""
    for name in HIVEMIND_NOISE_LOGGERS:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _HivemindNoise) for f in logger.filters):
            logger.addFilter(_HivemindNoise())


class RateLimit:
    """Whether a repeated line is due: at most once per ``period`` seconds of ``clock`` for each key (thread-safe)."""

    def __init__(self, period: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.period, self.clock = period, clock
        self._last: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable = None) -> bool:
        now = self.clock()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self.period:
                return False
            self._last[key] = now
            return True
