"""Leaving the swarm on SIGTERM or SIGINT, within a time limit (as Lightning's ``_SignalConnector`` handles signals:
its handlers are installed for the run and the previous ones restored after it)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
from typing import Any, Optional

from lightning_swarm.node import kill_daemon

log = logging.getLogger(__name__)

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class SignalGuard:
    """On the first SIGTERM or SIGINT, set ``stop`` (the peer finishes its current step, then leaves the swarm) and
    start a ``timeout``: past it, the peer's helper processes (DHT, averagers, and the libp2p daemon whose pid is
    ``daemon_pid``) are killed and the process exits with code 1. A second signal raises ``KeyboardInterrupt``.

    Handlers are installed by :meth:`install` (on the main thread only) and the previous ones restored by
    :meth:`restore`, which also cancels the timeout: the rest of the script is the user's.
    """

    def __init__(self, stop: threading.Event, timeout: float) -> None:
        self.stop, self.timeout = stop, timeout
        self.daemon_pid: Optional[int] = None  # the peer's libp2p daemon, once started
        self._previous: dict[int, Any] = {}
        self._deadline: Optional[threading.Timer] = None  # started by the first signal
        self._main_pid = os.getpid()

    def install(self) -> None:
        if threading.current_thread() is not threading.main_thread():
            return
        self._main_pid = os.getpid()
        self._previous = {signum: signal.signal(signum, self._handle) for signum in SIGNALS}

    def restore(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()  # left the swarm in time
            self._deadline = None
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous = {}

    def _handle(self, signum: int, frame: Any) -> None:
        if os.getpid() != self._main_pid:  # a forked helper (DHT, averager) inherited this handler: die as usual
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        if self.stop.is_set():
            raise KeyboardInterrupt  # a second signal: stop now
        log.warning(
            "Received signal %d: finishing the current step, then leaving the swarm (within %gs)", signum, self.timeout
        )
        self.stop.set()
        self._deadline = threading.Timer(self.timeout, self._leave_now)
        self._deadline.daemon = True
        self._deadline.start()

    def _leave_now(self) -> None:
        """The graceful exit took longer than ``timeout``: stop every helper process and exit."""
        log.error("Could not leave the swarm within %gs of the signal: exiting now", self.timeout)
        for child in multiprocessing.active_children():  # the DHT and averager processes
            child.kill()
        kill_daemon(self.daemon_pid)
        os._exit(1)
