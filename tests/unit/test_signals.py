"""The signal guard: SIGTERM or SIGINT asks the peer to leave; its handlers live only as long as the run."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from lightning_swarm.signals import SIGNALS, SignalGuard


def test_a_signal_asks_to_leave_and_the_previous_handlers_come_back():
    previous = {signum: signal.getsignal(signum) for signum in SIGNALS}
    stop = threading.Event()
    guard = SignalGuard(stop, timeout=60)
    guard.install()
    try:
        assert all(signal.getsignal(signum) != previous[signum] for signum in SIGNALS)
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.wait(5)
        with pytest.raises(KeyboardInterrupt):  # a second signal: stop now
            os.kill(os.getpid(), signal.SIGINT)
            threading.Event().wait(5)
    finally:
        guard.restore()
    assert {signum: signal.getsignal(signum) for signum in SIGNALS} == previous
