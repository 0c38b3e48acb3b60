"""Errors a swarm reports to its users, and who is at fault for each: the one place that decides whether a failed
call is the caller's (it raises) or a peer's (the work goes to another peer, or waits)."""

from __future__ import annotations


class SwarmRequestError(ValueError):
    """A stage server refused a request as malformed (bad shape, dtype, size, metadata): the caller got it wrong,
    and retrying it on another peer cannot help."""


class NonFiniteInputError(SwarmRequestError):
    """A request's activation or gradient holds NaN or Inf. When the caller relayed that tensor from another stage's
    reply unread (the trainer checks intermediate replies by their header only), that stage's peer is at fault: the
    caller bans it and runs its hop again elsewhere; otherwise the caller got it wrong."""


class PeerNotAllowedError(PermissionError):
    """A peer off the allow-list, or without the swarm's secret, called this peer."""


class StageBusyError(RuntimeError):
    """A stage server's request queue is full, or it ran out of memory; the caller should send the work to another
    peer, or wait."""


class StageFailedError(RuntimeError):
    """A stage server failed a well-formed request on its own side (its module or worker failed): the caller sends
    the work to another peer."""


MID_STEP = "this peer is in the middle of a step: download its state later"  # a state download refused, for now


class BadReplyError(RuntimeError):
    """A stage peer answered with a malformed reply (wrong shape, dtype or size, NaN or Inf): the caller bans the
    peer and sends the work to another."""


class StageUnavailableError(RuntimeError):
    """No live peer of a stage answered within the allowed retries."""


class ChainBrokenError(RuntimeError):
    """Under stage-to-stage wiring, a stage's peer could not hand a microbatch on to any peer of the next stage:
    the trainer sends that microbatch again, relaying each boundary itself. Nobody on the way is blamed."""


class NotServingError(RuntimeError):
    """The peer does not serve the requested stage of the run (it moved to another stage, is leaving, or is not
    ready yet): the caller sends the work to another peer of the stage."""


class JoinError(RuntimeError):
    """This peer could not join the swarm through its initial peers (down, unreachable, or refusing it).
    ``reason``: what the daemon or the DHT said, without the advice the message adds."""

    def __init__(self, message: str, reason: str = "") -> None:
        super().__init__(message)
        self.reason = reason or message


class ActivationsLostError(RuntimeError):
    """The stage server no longer holds the activations of a forward pass (evicted, expired or never kept): the
    caller sends the stage's input again so that the forward is recomputed."""


def failure_line(exception: BaseException) -> str:
    """One line saying why this peer stopped training (logged at once: the traceback follows only after leaving)."""
    if isinstance(exception, KeyboardInterrupt):
        return "Training interrupted: leaving the swarm now"
    return f"Training failed, leaving the swarm now: {type(exception).__name__}: {exception}"


# a failed call that was the caller's own fault, which it raises: a refused request or a refused caller. Any other
# failure is the peer's (crashed, overloaded, stale, not ready, a bad reply), and the work fails over or waits.
CALLERS_FAULT: tuple[type[Exception], ...] = (SwarmRequestError, PeerNotAllowedError)
