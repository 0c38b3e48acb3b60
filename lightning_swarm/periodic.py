"""``PeriodicThread``: the shape of this peer's background workers (the announcer, the swarm watcher, the
rebalancer), as hivemind's ``DHTHandlerThread`` and Petals' ``ModuleAnnouncerThread``: a daemon thread that runs
:meth:`PeriodicThread.tick` until it is stopped, with one stop event and one rule for how long stopping waits."""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

JOIN_TIMEOUT = 30.0  # seconds stop() waits for a tick in progress: its longest call (a DHT call, SwarmNode's timeout)


class PeriodicThread:
    """Runs :meth:`tick` after ``first_delay`` seconds, then every :meth:`delay` seconds, until :meth:`stop`. A
    tick that fails is logged; the next one runs as planned."""

    first_delay = 0.0

    def __init__(self, name: str) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def tick(self) -> None:
        raise NotImplementedError

    def delay(self) -> float:
        """Seconds until the next tick."""
        raise NotImplementedError

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(timeout=JOIN_TIMEOUT)

    def _run(self) -> None:
        wait = self.first_delay
        while not self._stop.wait(wait):
            try:
                self.tick()
            except Exception as e:  # the next tick tries again
                log.warning("%s: %r", self._thread.name, e)
            wait = self.delay()
