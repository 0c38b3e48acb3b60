"""Stage-to-stage ("chain") wiring, as the SWARM paper wires a pipeline: the wire format that trainers and stage
servers share. ``client/`` and ``server/`` both import this leaf module.

The trainer sends a microbatch to a peer of the first stage; each stage's peer sends its output on to a peer of the
next stage, and the peer of the last stage *parks* its output for the trainer, which collects it with one more
request. Backward goes the same way back, to the peers that kept the forwards. So the trainer's link carries the
microbatch once each way, whatever the number of stages, instead of once per stage boundary each way.

A chained request's metadata carries, besides what any request does:

- ``"parcel"``: the key under which the hop that ends the chain parks what it returns (random, made by the trainer:
  whoever knows it may collect the parcel once);
- ``"onward"``: the hops after this one. Forward: ``{"stage", "keep", "calls", "sides", "prefer"}`` (the key to
  keep the forward under, the blocks' side inputs and how many of the request's last tensors are that hop's side
  inputs, as the trainer would send them itself, and optionally the peer to try first: the trainer names the last
  hop's, where its collect waits); backward: ``{"stage", "peer", "kept"}`` (the peer that kept the forward);
- ``"origin"``: the trainer whose kept forwards these are, as the key's scope on every hop (a kept forward is
  stored by one caller and used by another, its backward coming from the next stage's peer);
- ``"budget"``: the seconds its caller waits for the receipt (set by the router on every attempt). A hop hands on
  only while its caller still waits, less a margin for the receipt's way back, and tells the next hop what is
  left: a chain that cannot go on answers :class:`~lightning_swarm.errors.ChainBrokenError` in time, and its
  caller, not waiting past its own timeout, blames no innocent peer.

Its reply is a :class:`Receipt`. A collect request is a forward with ``{"collect": parcel}`` and no tensor; its
reply is the parcel as the parking hop encoded it. With ``{"wait": seconds}`` it waits there for the parcel to be
parked: the trainer, knowing which peer ends the chain (a backward's, the peer that kept the first hop's forward; a
forward's, the peer it named for the last hop, unless the hop before failed over from it), sends it with the
chained request, so the parcel comes back as soon as it is parked, while the receipt is still on its way back
along the chain. The trainer goes on with a parcel that comes first (one way across the last link, against one per
stage for the receipt) and reads the receipt when it comes: a forward's backward waits for it, as it names the
peers that kept the forwards, and if it never comes right, runs the microbatch's forward again, relayed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

import torch
from hivemind.utils import MSGPackSerializer

from lightning_swarm import compression
from lightning_swarm.errors import BadReplyError, SwarmRequestError

MAX_HOPS = 256  # more onward hops than any pipeline has stages: refused
MAX_KEY = 64  # characters of a parcel key, a kept forward's key or an origin
MAX_BUDGET = 86400.0  # seconds: a longer budget is refused


@dataclass
class Receipt:
    """What a chained request's hop answers once the chain ended: the peers that ran the hops after it, as far as
    the chain went (the last holds the parcel); whether it stopped there because its next hop's peer could not take
    it (a backward: the parcel is the gradient for that hop, which the trainer recomputes; a forward: nothing is
    parked, the trainer relays the microbatch); and the failovers on the way, as ``[stage, method, failed peer,
    peer retried on, error]``, with no peer retried on (``""``) for the call whose failure stopped the chain.
    ``error``: why the chain stopped, empty if a backward's next peer was alive but had dropped the forward's
    graph."""

    peers: list[str] = field(default_factory=list)
    stopped: bool = False
    failovers: list[list] = field(default_factory=list)
    error: str = ""

    def after(self, peer: str, failovers: list[list]) -> Receipt:
        """This receipt as the hop before ``peer`` answers it, with the failovers of its own call."""
        return Receipt([peer, *self.peers], self.stopped, [*failovers, *self.failovers], self.error)

    def encode(self) -> compression.WireTensor:
        content = {"peers": self.peers, "stopped": self.stopped, "failovers": self.failovers, "error": self.error}
        raw = MSGPackSerializer.dumps(content)
        return compression.encode(torch.frombuffer(bytearray(raw), dtype=torch.uint8), "none")

    @classmethod
    def read(cls, reply: list) -> Receipt:
        """The receipt in a hop's reply; :class:`BadReplyError` if the reply is not one."""
        if len(reply) != 1:
            raise BadReplyError(f"a chained reply of {len(reply)} tensors, expected a receipt")
        try:
            if compression.decoded_dtype(reply[0]) != torch.uint8 or len(reply[0].size) != 1:
                raise ValueError("not a receipt")
            raw = compression.deserialize(reply[0]).numpy().tobytes()
            content = MSGPackSerializer.loads(raw)
            peers, stopped, failovers, error = (content[k] for k in ("peers", "stopped", "failovers", "error"))
        except Exception as e:
            raise BadReplyError(f"an unreadable receipt: {e!r:.200}") from None
        if not (isinstance(peers, list) and len(peers) <= MAX_HOPS and all(_is_key(p, 128) for p in peers)):
            raise BadReplyError("a receipt whose peers are not a list of peer ids")
        if not isinstance(stopped, bool) or not isinstance(failovers, list) or not isinstance(error, str):
            raise BadReplyError("a malformed receipt")
        listed = [list(f) for f in failovers[:MAX_HOPS] if _is_failover(f)]
        return cls(peers, stopped, listed, error[:300])


class ReceiptCheck:
    """A router's check of a chained request's reply: a readable receipt, kept in ``receipt``."""

    def __init__(self) -> None:
        self.receipt: Optional[Receipt] = None

    def __call__(self, reply: list) -> None:
        self.receipt = Receipt.read(reply)


def is_chained(metadata: dict) -> bool:
    return "parcel" in metadata


def onward_hops(metadata: dict, kind: str) -> list[dict]:
    """The hops after this one, as a chained request lists them, checked (``SwarmRequestError`` otherwise)."""
    key = metadata.get("parcel")
    hops = metadata.get("onward")
    if not _is_key(key) or not isinstance(hops, list) or len(hops) > MAX_HOPS:
        raise SwarmRequestError("a chained request names a parcel key and a list of onward hops")
    if not _is_key(metadata.get("origin")):
        raise SwarmRequestError("a chained request names its origin")
    for hop in hops:
        if not isinstance(hop, dict) or not isinstance(hop.get("stage"), int) or isinstance(hop["stage"], bool):
            raise SwarmRequestError("an onward hop names its stage")
        if kind == "forward":
            sides, keep, prefer = hop.get("sides", 0), hop.get("keep"), hop.get("prefer")
            if not isinstance(sides, int) or sides < 0 or not (keep is None or _is_key(keep)):
                raise SwarmRequestError("an onward forward hop has a count of side inputs and an optional key")
            if not (prefer is None or _is_key(prefer, 128)):
                raise SwarmRequestError("an onward forward hop's preferred peer is a peer id")
        elif not (_is_key(hop.get("peer"), 128) and _is_key(hop.get("kept"))):
            raise SwarmRequestError("an onward backward hop names the peer and the key of the kept forward")
    return hops


def deadline(metadata: dict, arrived: float) -> Optional[float]:
    """When (``time.monotonic()``) a chained request that ``arrived`` then must have its receipt sent: its budget
    less a margin for the receipt's way back (a tenth of it, at least 1 s); None if it gives no budget."""
    budget = metadata.get("budget")
    if budget is None:
        return None
    if not isinstance(budget, (int, float)) or isinstance(budget, bool) or not 0 < budget <= MAX_BUDGET:
        raise SwarmRequestError(f"a chained request's budget is a number of seconds in (0, {MAX_BUDGET:g}]")
    return arrived + budget - max(1.0, budget / 10)


def collect_key(metadata: dict) -> Optional[str]:
    """The parcel a collect request asks for, or None for any other request."""
    key = metadata.get("collect")
    if key is not None and not _is_key(key):
        raise SwarmRequestError(f"a parcel key is a string of 1 to {MAX_KEY} characters")
    return key


def collect_wait(metadata: dict) -> float:
    """Seconds a collect request waits for its parcel to be parked (0: it must be there already)."""
    wait = metadata.get("wait", 0.0)
    if not isinstance(wait, (int, float)) or isinstance(wait, bool) or not 0 <= wait <= MAX_BUDGET:
        raise SwarmRequestError(f"a collect request waits a number of seconds in [0, {MAX_BUDGET:g}]")
    return float(wait)


def _is_failover(entry: Any) -> bool:
    """Whether ``entry`` is a receipt's ``[stage, method, failed peer, peer retried on, error]``."""
    if not (isinstance(entry, list) and len(entry) == 5):
        return False
    stage, method, failed, retried_on, error = entry
    return (
        isinstance(stage, int)
        and not isinstance(stage, bool)
        and method in ("forward", "backward")
        and _is_key(failed, 128)
        and (retried_on == "" or _is_key(retried_on, 128))
        and isinstance(error, str)
    )


def _is_key(value: Any, longest: int = MAX_KEY) -> bool:
    return isinstance(value, str) and 0 < len(value) <= longest
