"""Stage-to-stage sends: a stage server hands a chained request's output on to a peer of the next hop's stage
(:mod:`~lightning_swarm.chain_wiring`), and parks the output of the hop that ends the chain for the trainer.

Forward: the next peer is chosen by this peer's router as a trainer's router chooses (load-aware, at random), or is
the one the hop names as preferred (the trainer names the last hop's, where it waits for the parcel), with the same
failover to other peers of that stage. If none takes it within ``wait_timeout`` seconds, or before the
caller stops waiting (the request's deadline, :func:`~lightning_swarm.chain_wiring.deadline`), the answer is a
receipt that says the chain stopped here and which peers failed on the way; the trainer relays that microbatch
itself. A next stage that finds NaN or Inf in the output refuses it: this peer made it, so it reports its own
failure (:class:`~lightning_swarm.errors.StageFailedError`) and its caller fails over to another peer of this
stage. Backward goes to the peer that kept the forward, named by the trainer; if that peer cannot take it (gone, or
it dropped the forward's graph), this peer banned it lately (a call to it failed), or the caller stops waiting
first, the gradient is parked here and the receipt says the chain stopped: the trainer recomputes that hop from its
input. A peer calling a peer is authenticated, authorized and queued like any caller.

The handing on runs on threads of its own (routers block), so the event loop goes on serving meanwhile.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections import Counter, OrderedDict
from concurrent.futures import Future, InvalidStateError, ThreadPoolExecutor
from typing import Hashable, Optional

from lightning_swarm import compression
from lightning_swarm.chain_wiring import Receipt, ReceiptCheck
from lightning_swarm.errors import (
    CALLERS_FAULT,
    ActivationsLostError,
    ChainBrokenError,
    NonFiniteInputError,
    StageFailedError,
)
from lightning_swarm.events import Failover
from lightning_swarm.stage_api import Routes

log = logging.getLogger(__name__)

MAX_HANDING_ON = 64  # chained requests handed on at once; more wait for a thread
MAX_WAITING = 1024  # collect requests waiting for their parcels at once; more are answered at once
MAX_WAITING_PER_CALLER = 64  # of them from one caller: a trainer's microbatches in flight at most
PARCEL_TTL = 60.0  # seconds a parked output waits for the trainer to collect it
PASSED_ON = ("codec", "train", "origin", "parcel", "loss_scale")  # what every hop's request repeats


class Parcels:
    """Outputs parked for their trainer, bounded by ``max_bytes`` (the oldest go first) and ``ttl`` seconds. Up to
    ``max_waiting`` collect requests at once, ``max_waiting_per_caller`` of each caller, may wait for a parcel not
    parked yet (:meth:`take_when_parked`)."""

    def __init__(
        self,
        max_bytes: int,
        ttl: float = PARCEL_TTL,
        max_waiting: int = MAX_WAITING,
        max_waiting_per_caller: int = MAX_WAITING_PER_CALLER,
    ) -> None:
        self.max_bytes, self.ttl, self.nbytes = max_bytes, ttl, 0
        self.max_waiting, self.max_waiting_per_caller = max_waiting, max_waiting_per_caller
        self._entries: OrderedDict[str, tuple[float, compression.WireTensor]] = OrderedDict()
        self._waiting: dict[str, tuple[Hashable, Future]] = {}  # parcel key -> its collector, set once parked
        self._callers: Counter[Hashable] = Counter()  # collectors waiting, per caller
        self._lock = threading.Lock()

    def park(self, key: str, tensor: compression.WireTensor) -> None:
        with self._lock:
            self._drop(self._entries.pop(key, None))
            self._entries[key] = (time.monotonic(), tensor)
            self.nbytes += len(tensor.buffer)
            now = time.monotonic()
            while self._entries and (
                self.nbytes > self.max_bytes or now - next(iter(self._entries.values()))[0] > self.ttl
            ):
                self._drop(self._entries.popitem(last=False)[1])
            waiter = self._waiting.get(key)
        if waiter is not None:
            with contextlib.suppress(InvalidStateError):  # its wait ran out just now
                waiter[1].set_result(None)

    async def take_when_parked(self, key: str, wait: float, caller: Hashable = None) -> compression.WireTensor:
        """The parcel under ``key`` once it is parked, waiting up to ``wait`` seconds (at most the parcels' ``ttl``)
        for it; as :meth:`take` once the wait is over, or at once if as many collectors as allowed wait already
        (of all, or of ``caller``), or one waits for this key."""
        with self._lock:
            waits = wait > 0 and key not in self._entries and key not in self._waiting
            if waits and len(self._waiting) < self.max_waiting and self._callers[caller] < self.max_waiting_per_caller:
                waiter = self._waiting[key] = (caller, Future())
                self._callers[caller] += 1
            else:
                waiter = None
        if waiter is not None:
            try:
                await asyncio.wait_for(asyncio.wrap_future(waiter[1]), min(wait, self.ttl))
            except asyncio.TimeoutError:
                pass
            finally:
                with self._lock:
                    del self._waiting[key]
                    self._callers[caller] -= 1
                    if not self._callers[caller]:
                        del self._callers[caller]
        return self.take(key)

    def take(self, key: str) -> compression.WireTensor:
        """The parcel under ``key``, once; :class:`ActivationsLostError` if there is none (expired, or taken)."""
        with self._lock:
            entry = self._entries.pop(key, None)
            self._drop(entry)
        if entry is None:
            raise ActivationsLostError(f"no parcel {key!r} here: it expired or was collected")
        return entry[1]

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def waiting(self) -> int:
        """Collect requests waiting for their parcels now."""
        return len(self._waiting)

    def _drop(self, entry: Optional[tuple[float, compression.WireTensor]]) -> None:
        if entry is not None:
            self.nbytes -= len(entry[1].buffer)


class Onward:
    """Hands a stage server's chained requests on (see the module docstring). ``routes``: this peer's router, set
    once it has one; ``wait_timeout``: seconds to find a peer of the next stage before the chain is broken."""

    def __init__(self, stage: int, max_parcel_bytes: int, wait_timeout: float = 10.0) -> None:
        self.stage, self.wait_timeout = stage, wait_timeout
        self.routes: Optional[Routes] = None
        self.parcels = Parcels(max_parcel_bytes)
        self.pool = ThreadPoolExecutor(MAX_HANDING_ON, "swarm-onward")  # threads that hand on (routers block)

    def hand_on(
        self,
        kind: str,
        output: compression.WireTensor,
        metadata: dict,
        hops: list[dict],
        sides: list,
        batch: int,
        deadline: Optional[float] = None,
    ) -> compression.WireTensor:
        """The receipt for a chained request whose own hop made ``output``: parked if the chain ends here, else
        after the next hop took it (with ``sides``, the side inputs of the hops after this one), before
        ``deadline`` (``time.monotonic()``) if given. Blocks while the next hop answers: run it on :attr:`pool`."""
        if not hops:
            self.parcels.park(metadata["parcel"], output)
            return Receipt().encode()
        routes, (hop, rest) = self.routes, (hops[0], hops[1:])
        request = {name: metadata[name] for name in PASSED_ON if name in metadata} | {"onward": rest}
        check = ReceiptCheck()
        if routes is None:
            raise ChainBrokenError(f"the peer of stage {self.stage} has no router to reach stage {hop['stage']}")
        if kind == "backward":
            return self._backward(routes, hop, output, request | {"kept": hop["kept"]}, batch, check, deadline)
        request |= {name: hop[name] for name in ("keep", "calls") if hop.get(name) is not None}
        prefer = hop.get("prefer")  # tried first if this peer's records have it too (they may be behind)
        prefer = prefer if prefer is not None and routes.knows(hop["stage"], prefer) else None
        failovers: list[list] = []
        try:
            _, peer = routes.call(
                hop["stage"],
                "forward",
                [output, *sides],
                request,
                batch,
                prefer=prefer,
                check=check,
                report=lambda event: failovers.append(_listed(event)),
                wait_timeout=self.wait_timeout,
                deadline=deadline,
            )
        except NonFiniteInputError:
            raise StageFailedError(f"stage {self.stage} made an output with NaN or Inf") from None
        except (*CALLERS_FAULT, ChainBrokenError):
            raise
        except Exception as e:  # the chain stops here: the trainer relays the microbatch, told which peers failed
            error = f"stage {self.stage} could not hand on to stage {hop['stage']}: {e!r}"
            return Receipt(stopped=True, failovers=failovers, error=error[:300]).encode()
        return check.receipt.after(peer, failovers).encode()

    def _backward(
        self,
        routes: Routes,
        hop: dict,
        grad: compression.WireTensor,
        request: dict,
        batch: int,
        check: ReceiptCheck,
        deadline: Optional[float],
    ) -> compression.WireTensor:
        left = None if deadline is None else deadline - time.monotonic()
        if left is not None and left <= 0:  # the caller stops waiting: the trainer sends it, blaming nobody
            self.parcels.park(request["parcel"], grad)
            return Receipt(stopped=True).encode()
        if routes.is_banned(hop["stage"], hop["peer"]):  # it failed this peer lately: the trainer recomputes that
            # hop at once, rather than after this peer waited for it again until the trainer's deadline
            self.parcels.park(request["parcel"], grad)
            return Receipt(stopped=True, error=f"peer {hop['peer']} of stage {hop['stage']} is banned here").encode()
        try:
            routes.call_peer(hop["stage"], hop["peer"], "backward", [grad], request, batch, check, False, left)
        except NonFiniteInputError:
            raise StageFailedError(f"stage {self.stage} made a gradient with NaN or Inf") from None
        except CALLERS_FAULT:
            raise
        except Exception as e:
            log.info("Stage %d: backward to %s failed (%r): parked for the trainer", self.stage, hop["peer"], e)
            self.parcels.park(request["parcel"], grad)
            return Receipt(stopped=True, error="" if isinstance(e, ActivationsLostError) else repr(e)).encode()
        return check.receipt.after(hop["peer"], []).encode()

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)


def _listed(event: Failover) -> list:
    return [event.stage, event.method, event.failed_peer, event.retried_on, event.error[:300]]
