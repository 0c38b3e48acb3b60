"""Errors a swarm reports to its users."""


class SwarmRequestError(ValueError):
    """A stage server refused a request as malformed: retrying it on another peer cannot help."""


class StageBusyError(RuntimeError):
    """A stage server's request queue is full; the caller should send the work to another peer."""


class StageUnavailableError(RuntimeError):
    """No live peer of a stage answered within the allowed retries."""


class NotServingError(RuntimeError):
    """The peer does not serve the requested stage of the run (it moved to another stage, or is leaving): the
    caller sends the work to another peer of the stage."""


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
