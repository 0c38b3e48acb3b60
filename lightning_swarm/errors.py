"""Errors a swarm reports to its users."""


class SwarmRequestError(ValueError):
    """A stage server refused a request as malformed: retrying it on another peer cannot help."""


class StageBusyError(RuntimeError):
    """A stage server's request queue is full; the caller should send the work to another peer."""


class StageUnavailableError(RuntimeError):
    """No live peer of a stage answered within the allowed retries."""
