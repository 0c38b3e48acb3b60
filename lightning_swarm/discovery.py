"""Discovery: who serves which stage, published as small DHT records (never tensors: the DHT is for finding peers).

Each serving peer stores, under ``<run_id>_stage<k>`` with its peer id as subkey, a tuple
``(state, throughput, queue, training[, address[, movable]])``, refreshed every ``update_period`` seconds and
expiring after ``2 * update_period``. Every DHT key of a run is named here (records, the run's layout, optimizer
prefixes, checkpoint claims and the latest checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import Counter
from dataclasses import dataclass
from enum import IntEnum
from typing import Callable, Optional

from lightning_swarm.node import SwarmNode
from lightning_swarm.periodic import PeriodicThread

log = logging.getLogger(__name__)
ADDRESSES_TTL = 60.0  # seconds a peer's published multiaddrs last (refreshed by its announcer)
DIAL_TIMEOUT = 5.0  # seconds a peer behind NAT tries to dial another (a peer gone keeps its record a while)


class PeerState(IntEnum):
    JOINING = 0
    SERVING = 1
    LEAVING = 2


@dataclass(frozen=True)
class PeerRecord:
    """What a peer says about itself: its stage (None: it only drives), state, compute throughput (samples/s),
    queued samples, whether it is still training on its own data, the ``host:port`` of its direct tensor path
    (:mod:`~lightning_swarm.transport`; empty: libp2p only), whether it moves when the rebalancing plan chooses
    it (False: its rebalancing is off or paused; it counts at its stage, but no plan moves it), and whether others
    can dial it (False: behind NAT, in client mode; it is called over the connections it opened)."""

    peer_id: str
    stage: Optional[int]
    state: PeerState
    throughput: float
    queue: int
    training: bool = False
    address: str = ""
    movable: bool = True
    reachable: bool = True

    def to_value(self) -> tuple:
        value = (int(self.state), float(self.throughput), int(self.queue), int(self.training))
        if not self.reachable:
            return (*value, self.address, int(self.movable), 0)
        if not self.movable:
            return (*value, self.address, 0)
        return (*value, self.address) if self.address else value

    @classmethod
    def from_value(cls, peer_id: str, stage: Optional[int], value: object) -> Optional[PeerRecord]:
        """Parse a record, or None for one that is malformed (records come from other peers)."""
        try:
            # older peers: no address, no movable flag (True), no reachable flag (True)
            state, throughput, queue, training, *rest = value
            if len(rest) > 3 or (rest and not (isinstance(rest[0], str) and len(rest[0]) <= 64)):
                return None
            if not all(isinstance(flag, int) for flag in rest[1:]):  # bool is an int
                return None
            address, movable, reachable = (rest[0] if rest else ""), *(bool(flag) for flag in [*rest[1:], 1, 1][:2])
            state = PeerState(int(state))
            return cls(
                str(peer_id), stage, state, float(throughput), int(queue), bool(training), address, movable, reachable
            )
        except (TypeError, ValueError):
            return None


def stage_key(run_id: str, stage: Optional[int]) -> str:
    return f"{run_id}_drivers" if stage is None else f"{run_id}_stage{stage}"


def meta_key(run_id: str) -> str:
    return f"{run_id}_meta"


def optimizer_prefix(run_id: str, stage: Optional[int]) -> str:
    """The hivemind prefix of a stage's optimizer (None: the trainers' local optimizer), under which its progress
    and averaging live in the DHT."""
    return f"{run_id}_local" if stage is None else f"{run_id}_stage{stage}"


def addresses_key(run_id: str) -> str:
    """Where reachable peers publish their libp2p multiaddrs, for peers behind NAT to dial them."""
    return f"{run_id}_addresses"


def publish_addresses(node: SwarmNode, run_id: str, ttl: float) -> None:
    """Store this peer's multiaddrs (without their ``/p2p/<id>`` part: the subkey is the id) for ``ttl`` seconds;
    loopback ones only if it has no other (a peer on another machine would dial itself there)."""
    maddrs = [maddr.split("/p2p/", 1)[0] for maddr in node.visible_maddrs()]
    maddrs = [m for m in maddrs if not m.startswith(("/ip4/127.", "/ip6/::1/"))] or maddrs
    node.dht_store(addresses_key(run_id), str(node.peer_id), maddrs, ttl)


def fetch_addresses(node: SwarmNode, run_id: str) -> dict[str, list[str]]:
    """The multiaddrs the reachable peers published, by peer id (malformed entries left out)."""
    found = node.dht_get(addresses_key(run_id)) or {}
    return {
        str(peer): [m for m in maddrs if isinstance(m, str) and m.startswith("/")]
        for peer, maddrs in found.items()
        if isinstance(maddrs, list)
    }


def checkpoint_claims_key(run_id: str) -> str:
    return f"{run_id}_checkpoints"


def latest_checkpoint_key(run_id: str) -> str:
    return f"{run_id}_latest_checkpoint"


def fetch_stage(node: SwarmNode, run_id: str, stage: Optional[int]) -> dict[str, PeerRecord]:
    """Live records of the peers of one stage, by peer id (base58)."""
    found = node.dht_get(stage_key(run_id, stage)) or {}
    records = (PeerRecord.from_value(peer, stage, value) for peer, value in found.items())
    return {r.peer_id: r for r in records if r is not None}


def fetch_swarm(node: SwarmNode, run_id: str, num_stages: int) -> list[dict[str, PeerRecord]]:
    return [fetch_stage(node, run_id, k) for k in range(num_stages)]


def store_record(node: SwarmNode, run_id: str, record: PeerRecord, ttl: float) -> None:
    """Publish ``record`` (this peer's) under its stage for ``ttl`` seconds."""
    node.dht_store(stage_key(run_id, record.stage), record.peer_id, record.to_value(), ttl=ttl)


def training_peers(node: SwarmNode, run_id: str, num_stages: int) -> set[str]:
    """Peers (serving or drive-only) that announce they are still training."""
    keys = record_keys(run_id, num_stages)
    return training_among({stage: node.dht_get(key) or {} for key, stage in keys.items()})


def record_keys(run_id: str, num_stages: int) -> dict[str, Optional[int]]:
    """The DHT keys under which the run's peers announce themselves, each with its stage (None: drive-only peers)."""
    return {stage_key(run_id, stage): stage for stage in [*range(num_stages), None]}


def training_among(found: dict[Optional[int], dict]) -> set[str]:
    """The peers that announce they are still training, among records as read from the DHT (record values by peer
    id, by stage; malformed ones left out). A peer found at two stages (moving) is one peer."""
    records = (
        PeerRecord.from_value(peer, stage, value) for stage, values in found.items() for peer, value in values.items()
    )
    return {record.peer_id for record in records if record is not None and record.training}


def check_run_meta(node: SwarmNode, run_id: str, meta: dict, ttl: float) -> None:
    """Publish this peer's view of the run (stage count and layout) and refuse to join a swarm that disagrees."""
    found = node.dht_get(meta_key(run_id)) or {}
    for peer, theirs in found.items():
        if isinstance(theirs, dict) and theirs != meta:
            raise RuntimeError(
                f"Run {run_id!r} is already served with a different layout: peer {peer} has {theirs}, this peer "
                f"has {meta}. Start every peer with the same model, pipeline, num_stages and precision, or use "
                f"another run_id."
            )
    node.dht_store(meta_key(run_id), str(node.peer_id), meta, ttl)


def read_num_stages(node: SwarmNode, run_id: str) -> Optional[int]:
    """The stage count the run's peers published (the most common one, should they disagree)."""
    found = node.dht_get(meta_key(run_id)) or {}
    counts = Counter(
        meta["num_stages"]
        for meta in found.values()
        if isinstance(meta, dict) and isinstance(meta.get("num_stages"), int) and meta["num_stages"] > 0
    )
    return counts.most_common(1)[0][0] if counts else None


def probe_num_stages(node: SwarmNode, run_id: str, gap: int = 4, limit: int = 256) -> int:
    """Without published metadata: one more than the highest stage with a live peer (0 when none has)."""
    last, k = -1, 0
    while k < limit and k - last <= gap:
        if fetch_stage(node, run_id, k):
            last = k
        k += 1
    return last + 1


def read_step(node: SwarmNode, prefix: str) -> Optional[int]:
    """The highest epoch (optimizer step) any peer reports in hivemind's progress records under ``prefix``."""
    found = node.dht_get(f"{prefix}_progress") or {}
    epochs = [
        value["epoch"]
        for value in found.values()
        if isinstance(value, dict) and isinstance(value.get("epoch"), int) and not isinstance(value["epoch"], bool)
    ]
    return max(epochs) if epochs else None


class Announcer(PeriodicThread):
    """A daemon thread that keeps this peer's record fresh, so routers find it and stop finding it once it is gone."""

    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        make_record: Callable[[], PeerRecord],
        update_period: float,
        layout: Optional[dict] = None,
    ) -> None:
        super().__init__("swarm-announcer")
        self.node, self.run_id, self.make_record = node, run_id, make_record
        self.update_period, self.layout = update_period, layout
        self.first_delay = update_period
        self._layout_stored_at = time.monotonic()  # check_run_meta stored it when the peer joined
        self._addresses_stored_at = -ADDRESSES_TTL

    def start(self) -> None:
        self.announce()
        self._publish_addresses()
        super().start()

    def _publish_addresses(self) -> None:
        """A reachable peer tells where it listens, so that peers behind NAT can dial it (they cannot be dialed)."""
        if getattr(self.node, "client_mode", True):
            return
        try:
            publish_addresses(self.node, self.run_id, ADDRESSES_TTL)
            self._addresses_stored_at = time.monotonic()
        except Exception as e:  # retried at the next refresh
            log.warning("Could not publish this peer's addresses: %r", e)

    def delay(self) -> float:
        return self.update_period

    def announce(self, record: Optional[PeerRecord] = None, ttl: Optional[float] = None) -> None:
        """Store ``record`` (by default, the current one) for ``ttl`` seconds (by default, two update periods)."""
        record = record or self.make_record()
        if getattr(self.node, "client_mode", False):
            record = dataclasses.replace(record, reachable=False)
        ttl = 2 * self.update_period if ttl is None else ttl
        try:
            store_record(self.node, self.run_id, record, ttl)
        except Exception as e:  # a missed refresh is retried next period; the record outlives one miss
            log.warning("Could not announce stage %d: %r", record.stage, e)

    def tick(self) -> None:
        self.announce()
        if time.monotonic() - self._addresses_stored_at > ADDRESSES_TTL / 3:
            self._publish_addresses()
        ttl = max(60.0, 6 * self.update_period)
        if self.layout is not None and time.monotonic() - self._layout_stored_at > ttl / 3:
            try:  # the run's layout outlives its first peers: tools read it (status)
                self.node.dht_store(meta_key(self.run_id), str(self.node.peer_id), self.layout, ttl)
                self._layout_stored_at = time.monotonic()
            except Exception as e:
                log.warning("Could not refresh the run's layout: %r", e)

    def stop(self, final: Optional[PeerRecord] = None) -> None:
        super().stop()
        if final is not None:
            self.announce(final)


class SwarmWatcher(PeriodicThread):
    """A daemon thread that reads the whole swarm's records every ``period`` seconds, keeps the latest view, and
    reports the differences between two views: peers that joined, left, or moved to another stage.

    Args:
        on_change: called on the watcher's thread with ``(kind, peer_id, before, after)``: ``kind`` is
            ``"joined"``, ``"left"`` or ``"moved"``; ``before`` and ``after`` are the peer's records (``after`` of a
            peer that left is its "leaving" record if it announced one, else None: its record expired).
    """

    def __init__(
        self,
        node: SwarmNode,
        run_id: str,
        num_stages: int,
        period: float,
        on_change: Callable[[str, str, Optional[PeerRecord], Optional[PeerRecord]], None],
    ) -> None:
        super().__init__("swarm-watcher")
        self.node, self.run_id, self.num_stages, self.period = node, run_id, num_stages, period
        self.on_change = on_change
        self.latest: Optional[list[dict[str, PeerRecord]]] = None  # one dict per stage
        self.drivers: dict[str, PeerRecord] = {}

    def tick(self) -> None:
        self.refresh()

    def delay(self) -> float:
        return self.period

    def refresh(self) -> list[dict[str, PeerRecord]]:
        swarm, drivers = fetch_swarm(self.node, self.run_id, self.num_stages), fetch_stage(self.node, self.run_id, None)
        if getattr(self.node, "client_mode", False):  # unreachable: those who may call this peer need a connection
            present = current_records(swarm, drivers)
            self._dial({peer for peer, record in present.items() if record.reachable})
        if self.latest is not None:
            leaving = {r.peer_id: r for r in [*drivers.values(), *_records(swarm)] if r.state == PeerState.LEAVING}
            self._compare(current_records(self.latest, self.drivers), current_records(swarm, drivers), leaving)
        self.latest, self.drivers = swarm, drivers
        return swarm

    def _dial(self, peers: set[str]) -> None:
        """Open a connection to every peer of the swarm that may call this one (which is behind NAT)."""
        try:
            addresses = fetch_addresses(self.node, self.run_id)
            failed = self.node.dial({peer: addresses.get(peer, []) for peer in peers}, timeout=DIAL_TIMEOUT)
        except Exception as e:  # dialing is retried next period
            log.warning("Could not dial the swarm's peers: %r", e)
            return
        if failed:
            log.warning("Could not dial %d peer(s) of the swarm (they cannot call this peer): %s", len(failed), failed)

    def _compare(
        self, before: dict[str, PeerRecord], after: dict[str, PeerRecord], leaving: dict[str, PeerRecord]
    ) -> None:
        for peer in before.keys() - after.keys():
            self.on_change("left", peer, before[peer], leaving.get(peer))
        for peer in after.keys() - before.keys():
            self.on_change("joined", peer, None, after[peer])
        for peer in before.keys() & after.keys():
            if before[peer].stage != after[peer].stage:
                self.on_change("moved", peer, before[peer], after[peer])


def current_records(
    swarm: list[dict[str, PeerRecord]], drivers: Optional[dict[str, PeerRecord]] = None
) -> dict[str, PeerRecord]:
    """Each present peer's current record, by peer id; peers that announced they are leaving are left out.

    A moving peer announces its new stage (joining) before it leaves the old one, and its old record can outlive
    that by a few seconds if the "leaving" announcement was lost: a peer found at two stages counts at the one it
    is joining, never twice."""
    found: dict[str, PeerRecord] = {}
    for record in [*(drivers or {}).values(), *_records(swarm)]:
        if record.state == PeerState.LEAVING:
            continue
        if record.peer_id not in found or record.state == PeerState.JOINING:
            found[record.peer_id] = record
    return found


def _records(swarm: list[dict[str, PeerRecord]]) -> list[PeerRecord]:
    return [record for stage in swarm for record in stage.values()]
