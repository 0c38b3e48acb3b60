"""The package's log lines: timestamped like hivemind's, and hivemind's known noise of a healthy swarm kept out."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import re
import subprocess
import sys

import pytest
from helpers import ROOT
from hivemind.averaging.partition import AllreduceException
from hivemind.p2p.p2p_daemon_bindings.utils import P2PHandlerError

import lightning_swarm  # noqa: F401  (installs the handler and the filters)
from lightning_swarm.errors import MID_STEP
from lightning_swarm.logs import HIVEMIND_NOISE_LOGGERS, RateLimit


class Captured(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def captured():
    handler = Captured()
    loggers = [logging.getLogger(name) for name in {*HIVEMIND_NOISE_LOGGERS, "hivemind.p2p.p2p_daemon"}]
    for logger in loggers:
        logger.addHandler(handler)
    yield handler
    for logger in loggers:
        logger.removeHandler(handler)


def test_hivemind_noise_of_a_healthy_swarm_is_kept_out_of_the_logs(captured, monkeypatch):
    """What hivemind and asyncio print in a healthy swarm (rounds without a group or cancelled, a state download
    refused during a step, a stream closed before the daemon handled it, a cancelled round finishing, averager tasks
    destroyed at shutdown) prints no traceback; other errors print as before. A round without a group, a cancelled
    one or a refused download is an INFO line (hidden at a peer's WARNING level)."""
    for name in ("hivemind.averaging.averager", "hivemind.optim.optimizer", "hivemind.p2p.p2p_daemon"):
        monkeypatch.setattr(logging.getLogger(name), "level", logging.WARNING)
    for name in ("hivemind.averaging.averager", "hivemind.optim.optimizer"):  # as hivemind logs them
        try:
            raise AllreduceException("Averaging step failed: could not find a group")
        except AllreduceException as e:
            logging.getLogger(name).exception(e)
    try:  # a round cancelled while waiting for its trigger
        raise asyncio.CancelledError()
    except asyncio.CancelledError as e:
        logging.getLogger("hivemind.averaging.averager").exception(e)
    try:  # a peer refused a state download: it is in the middle of a step
        raise P2PHandlerError(f"Failed to call handler `rpc_download_state` at 12D3Koo: {MID_STEP}")
    except P2PHandlerError as e:
        logging.getLogger("hivemind.averaging.averager").exception(f"Failed to download state from 12D3Koo - {e!r}")
    refused = RuntimeError(MID_STEP)  # the refusing peer: hivemind's warning, then its request handler's traceback
    logging.getLogger("hivemind.averaging.averager").warning(refused)
    logging.getLogger("hivemind.p2p.p2p_daemon").warning(
        "Handler failed with the exception:", exc_info=(type(refused), refused, None)
    )
    asyncio_logger = logging.getLogger("asyncio")
    cancelled = concurrent.futures.InvalidStateError("Can't set_result to a future that is CANCELLED (123)")
    asyncio_logger.error(
        "Task exception was never retrieved\nfuture: <Task finished coro=<DecentralizedAverager._step() done>>",
        exc_info=(type(cancelled), cancelled, None),
    )
    reused = RuntimeError("cannot reuse already awaited coroutine")
    asyncio_logger.error(
        "Unhandled exception in client_connected_cb\ntransport: <UnixTransport closed=True reading=False 0x7f>",
        exc_info=(type(reused), reused, None),
    )
    asyncio_logger.error(
        "Task was destroyed but it is pending!\ntask: <Task cancelling coro=<Matchmaking._request_join_potential_"
        "leaders() running at /site-packages/hivemind/averaging/matchmaking.py:152>>"
    )
    assert not captured.records  # all kept out
    asyncio_logger.error("Task exception was never retrieved", exc_info=(ValueError, ValueError("mine"), None))
    assert [r.getMessage() for r in captured.records] == ["Task exception was never retrieved"]


def test_package_lines_carry_a_timestamp_and_repeated_lines_are_rate_limited():
    script = "import logging, lightning_swarm; logging.getLogger('lightning_swarm.strategy').warning('hello')"
    result = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={"PYTHONPATH": str(ROOT)},
    )
    assert re.search(r"^\w{3} [ \d]\d \d\d:\d\d:\d\d\.\d{3} \[.*WARN.*\].* hello$", result.stderr, re.M), result.stderr
    due = RateLimit(60.0)
    assert [due("stage 1"), due("stage 1"), due("stage 2")] == [True, False, True]


@pytest.mark.parametrize(
    "name, level, message",
    [
        (
            "hivemind.averaging.matchmaking",
            logging.INFO,
            "Another look_for_group is already in progress. The current run will be scheduled after the existing "
            "group is either assembled or disbanded.",
        ),
        ("hivemind.averaging.partition", logging.WARNING, "Reducer: received 50.0% of input tensors"),
    ],
)
def test_matchmaking_lines_are_debug_lines(captured, name, level, message):
    """hivemind's matchmaking lines of a healthy swarm print nothing at its default level (INFO); at DEBUG they
    print as DEBUG lines."""
    logger = logging.getLogger(name)
    before = logger.level
    try:
        logger.setLevel(logging.INFO)
        logger.log(level, message)
        assert not captured.records
        logger.setLevel(logging.DEBUG)
        logger.log(level, message)
        assert [(r.levelno, r.getMessage()) for r in captured.records] == [(logging.DEBUG, message)]
    finally:
        logger.setLevel(before)
