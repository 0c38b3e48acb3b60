"""The project's log lines: stamped with the time, level and caller as hivemind stamps its own, and repeated
waiting lines printed at most once a period."""

from __future__ import annotations

import logging
import math
import threading
import time
from typing import Hashable

from hivemind.utils.logging import CustomFormatter

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


class RateLimit:
    """Whether a repeated line is due: at most once per ``period`` seconds for each key (thread-safe)."""

    def __init__(self, period: float) -> None:
        self.period = period
        self._last: dict[Hashable, float] = {}
        self._lock = threading.Lock()

    def __call__(self, key: Hashable = None) -> bool:
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(key, -math.inf) < self.period:
                return False
            self._last[key] = now
            return True
