"""Who may join a swarm: an allow-list of peer identities, and/or a secret shared by the swarm's peers.

What hivemind 1.1.12 offers, and what this module builds on it:

- Peer ids are authenticated by libp2p (TLS or Noise): the ``remote_id`` a handler sees in its ``P2PContext`` is
  the caller's key, not a claim. A peer started with ``identity_path`` keeps its id across restarts.
- The bundled ``p2pd`` has no private-network (pre-shared key) option (``p2pd -h`` lists no ``-psk``), so a
  shared secret cannot be made a transport-level guarantee: it is checked in the application instead.

**Allow-list** (``allowed_peers``): every RPC handler of this peer refuses callers whose peer id is not on the list,
before the handler runs: the stage server and the direct path check it themselves, and the handlers that hivemind
registers for this peer in the processes forked from this one (the DHT, the averagers) are wrapped by
:func:`install_guard`, which leaves this process, and every other peer id, alone. A peer off the list cannot
bootstrap into the swarm's DHT, read or write its records, send work to a stage, or take part in an all-reduce; its
refused calls are logged by the refusing peer.

**Secret** (``secret`` / ``secret_path``): every DHT request and response carries an HMAC of the message, a
nonce and the time under the secret (:class:`SecretAuthorizer`, hivemind's DHT ``authorizer`` hook), so a node
without the secret can neither join the swarm's DHT nor read or write its records; every DHT record also carries
an HMAC of its key, subkey, value and expiration (:class:`SecretRecordValidator`), so records are checked
wherever they travel. Every request to a stage server carries an HMAC of (run, caller id, receiver id), so only
peers that know the secret can send work or download a stage; the libp2p channel is encrypted and authenticated,
so a token seen by its receiver cannot be used under another peer's id. Limits of a secret alone: a peer without
it that knows a member's peer id (e.g. from its address) can still ask that member's stage server for its load
(``rpc_info``) and call hivemind's averager RPCs on it directly. Use an allow-list where that matters.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import logging
import os
import secrets
import struct
import time
from typing import Any, Iterable, Optional, Union

from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.p2p import P2P, P2PContext, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.auth import AuthorizerBase

from lightning_swarm.errors import PeerNotAllowedError

log = logging.getLogger(__name__)

AUTH_FIELD = "auth"  # the request metadata field that carries the secret's token
_MAC_MARK = b"[swarm-mac:"
_MAC_SUFFIX_LEN = len(_MAC_MARK) + 64 + 1  # mark, hex SHA-256, "]"
_REFUSAL_LOG_PERIOD = 60.0  # seconds between two log lines about the same refused peer


def peer_id_of(identity_path: str) -> str:
    """The peer id (base58) of the identity in a key file written by hivemind (``identity_path``)."""
    with open(identity_path, "rb") as f:
        return PeerID.from_identity(f.read()).to_base58()


def create_identity(identity_path: str) -> str:
    """Write a new identity key file (if none is there) and return its peer id: to build an allow-list."""
    if not os.path.exists(identity_path):
        P2P.generate_identity(identity_path)
    return peer_id_of(identity_path)


def read_allowed_peers(entries: Iterable[str]) -> frozenset[str]:
    """Peer ids from ``entries``: each a base58 peer id, or a file with one peer id per line (``#`` comments)."""
    allowed = set()
    for entry in entries:
        entry = entry.strip()
        if not entry:
            continue
        if os.path.isfile(entry):
            with open(entry) as f:
                lines = [line.split("#", 1)[0].strip() for line in f]
            allowed.update(line for line in lines if line)
        else:
            allowed.add(entry)
    for peer in allowed:
        try:
            PeerID.from_base58(peer)
        except Exception:
            raise ValueError(f"allowed_peers: {peer!r} is neither a peer id nor a file of peer ids") from None
    return frozenset(allowed)


@dataclasses.dataclass(frozen=True)
class AccessPolicy:
    """Who may talk to this peer. ``allowed``: peer ids (None: anyone); ``key``: the HMAC key derived from the
    swarm's secret (None: no secret)."""

    allowed: Optional[frozenset[str]] = None
    key: Optional[bytes] = None

    @classmethod
    def create(
        cls, allowed_peers: Optional[Iterable[str]] = None, secret: Optional[Union[str, bytes]] = None
    ) -> Optional[AccessPolicy]:
        """A policy from settings, or None when neither an allow-list nor a secret is set."""
        allowed = read_allowed_peers(allowed_peers) if allowed_peers else None
        if allowed_peers and not allowed:
            raise ValueError("allowed_peers names no peer id")
        key = None
        if secret:
            raw = secret.encode() if isinstance(secret, str) else bytes(secret)
            key = hashlib.sha256(b"lightning_swarm secret:" + raw).digest()
        return cls(allowed, key) if allowed is not None or key is not None else None

    def __repr__(self) -> str:  # never print the key
        allowed = "anyone" if self.allowed is None else f"{len(self.allowed)} peer(s)"
        return f"AccessPolicy(allowed={allowed}, secret={self.key is not None})"

    def admits(self, peer: Union[str, PeerID]) -> bool:
        return self.allowed is None or _base58(peer) in self.allowed

    def token(self, run_id: str, caller: Union[str, PeerID], receiver: Union[str, PeerID]) -> Optional[str]:
        """What ``caller`` sends to ``receiver`` to prove it knows the secret (None without a secret)."""
        if self.key is None:
            return None
        message = f"request|{run_id}|{_base58(caller)}|{_base58(receiver)}".encode()
        return hmac.new(self.key, message, hashlib.sha256).hexdigest()

    def check_request(self, run_id: str, context: P2PContext, metadata: Optional[dict]) -> None:
        """Raise :class:`PeerNotAllowedError` (and log it) unless the caller is allowed and proved the secret."""
        caller = context.remote_id
        if not self.admits(caller):
            refuse(f"peer {_base58(caller)} is not on the allow-list of this swarm")
        if self.key is not None:
            given = (metadata or {}).get(AUTH_FIELD)
            expected = self.token(run_id, caller, context.local_id)
            if not isinstance(given, str) or not hmac.compare_digest(given.encode(), expected.encode()):
                refuse(f"peer {_base58(caller)} did not prove the swarm's secret (missing or wrong token)")

    def sign_metadata(self, metadata: dict, run_id: str, caller: Union[str, PeerID], receiver: Union[str, PeerID]):
        """``metadata`` with the secret's token added for ``receiver`` (unchanged without a secret)."""
        token = self.token(run_id, caller, receiver)
        return metadata if token is None else {**metadata, AUTH_FIELD: token}


_last_refusal: dict[str, float] = {}


def refuse(reason: str) -> None:
    """Log (at most once a minute per reason) and raise the refusal."""
    _log_refusal(f"a request: {reason}")
    raise PeerNotAllowedError(reason)


def _base58(peer: Union[str, PeerID]) -> str:
    return peer.to_base58() if isinstance(peer, PeerID) else str(peer)


# ---- the allow-list on the handlers hivemind registers for our peer in the processes forked from this one ---------

_guards: dict[str, AccessPolicy] = {}  # peer id (base58) -> the policy its handlers apply
_original_add_protobuf_handler = P2P.add_protobuf_handler
_fork_hook_registered = False


def install_guard(policy: AccessPolicy, peer_id: str) -> None:
    """Make every hivemind RPC handler that the peer ``peer_id`` registers in processes forked from this one from
    now on (its DHT, its averagers) refuse callers off ``policy``'s allow-list. Call it before the DHT starts.

    This process is left alone (its handlers, the stage server's and the direct path's, check the policy
    themselves), and so are the handlers of every other peer id, in this process and in the forked ones."""
    global _fork_hook_registered
    if policy.allowed is None:
        return
    _guards[peer_id] = policy
    if not _fork_hook_registered:
        os.register_at_fork(after_in_child=_guard_forked_process)
        _fork_hook_registered = True


def remove_guard(peer_id: str) -> None:
    """Undo :func:`install_guard` for processes forked from now on (those already forked keep theirs)."""
    _guards.pop(peer_id, None)


def _guard_forked_process() -> None:
    """In a process just forked while a peer is guarded: hivemind's handlers of that peer registered in it go through
    the guard (the process belongs to one of our peer's DHT or averagers; other peer ids pass unchanged)."""
    if _guards:
        P2P.add_protobuf_handler = _guarded_add_protobuf_handler


async def _guarded_add_protobuf_handler(self: P2P, name: str, handler: Any, *args: Any, **kwargs: Any) -> None:
    policy = _guards.get(self.peer_id.to_base58()) if self.peer_id is not None else None
    handler = handler if policy is None else _guarded(name, handler, policy)
    await _original_add_protobuf_handler(self, name, handler, *args, **kwargs)


def _guarded(name: str, handler: Any, policy: AccessPolicy) -> Any:
    def guarded(request: Any, context: P2PContext) -> Any:
        if not policy.admits(context.remote_id):
            return _refused(name, context)
        return handler(request, context)

    return guarded


async def _refused(name: str, context: P2PContext) -> None:
    refuse(f"peer {_base58(context.remote_id)} is not on the allow-list of this swarm (it called {name})")


# ---- the secret on DHT records -------------------------------------------------------------------------------------


class SecretRecordValidator(RecordValidatorBase):
    """Every DHT record carries an HMAC (under the swarm's secret) of its key, subkey, value and expiration; records
    without a valid one are refused when another peer asks to store them and when a peer returns them."""

    def __init__(self, key: bytes) -> None:
        self._key = key

    def _mac(self, record: DHTRecord, value: bytes) -> bytes:
        message = b"|".join(
            [len(record.key).to_bytes(4, "big") + record.key, record.subkey, struct.pack("!d", record.expiration_time)]
        )
        return hmac.new(self._key, message + b"|" + value, hashlib.sha256).hexdigest().encode()

    def sign_value(self, record: DHTRecord) -> bytes:
        return record.value + _MAC_MARK + self._mac(record, record.value) + b"]"

    def validate(self, record: DHTRecord) -> bool:
        value = record.value
        if len(value) < _MAC_SUFFIX_LEN or not value.endswith(b"]"):
            return False
        suffix = value[-_MAC_SUFFIX_LEN:]
        if not suffix.startswith(_MAC_MARK):
            return False
        given = suffix[len(_MAC_MARK) : -1]
        return hmac.compare_digest(given, self._mac(record, value[:-_MAC_SUFFIX_LEN]))

    def strip_value(self, record: DHTRecord) -> bytes:
        return record.value[:-_MAC_SUFFIX_LEN]

    @property
    def priority(self) -> int:
        return 100  # signed last and checked first: it covers what hivemind's own validators added

    def merge_with(self, other: RecordValidatorBase) -> bool:
        return False


# ---- the secret on DHT requests and responses ----------------------------------------------------------------------


class SecretAuthorizer(AuthorizerBase):
    """Every DHT request and response carries an HMAC (under the swarm's secret) of the whole message, a fresh
    nonce and the time: a DHT node without the secret can neither read the swarm's records nor answer its peers
    (its replies are dropped), so it never enters their routing tables. A request is accepted once (its nonce is
    remembered) and within ``max_clock_skew`` seconds of its time."""

    def __init__(self, key: bytes, max_clock_skew: float = 60.0) -> None:
        self._key, self.max_clock_skew = key, max_clock_skew
        self._recent_nonces: dict[bytes, float] = {}
        self._pruned_at = 0.0

    def _mac(self, kind: bytes, message: Any) -> bytes:
        return hmac.new(self._key, kind + message.SerializeToString(), hashlib.sha256).digest()

    async def sign_request(self, request: Any, service_public_key: Any) -> None:
        auth = request.auth
        auth.time = get_dht_time()
        auth.nonce = secrets.token_bytes(16)
        auth.signature = b""
        auth.signature = self._mac(b"request", request)

    async def validate_request(self, request: Any) -> bool:
        auth = request.auth
        signature, auth.signature = auth.signature, b""
        now = get_dht_time()
        if not hmac.compare_digest(signature, self._mac(b"request", request)):
            _log_refusal("a DHT request without the swarm's secret")
            return False
        if abs(auth.time - now) > self.max_clock_skew or auth.nonce in self._recent_nonces:
            _log_refusal("a DHT request replayed, or from a clock more than max_clock_skew apart")
            return False
        if now - self._pruned_at > 10.0:
            self._recent_nonces = {n: t for n, t in self._recent_nonces.items() if t > now}
            self._pruned_at = now
        self._recent_nonces[auth.nonce] = now + 3 * self.max_clock_skew
        return True

    async def sign_response(self, response: Any, request: Any) -> None:
        response.auth.nonce = request.auth.nonce
        response.auth.signature = b""
        response.auth.signature = self._mac(b"response", response)

    async def validate_response(self, response: Any, request: Any) -> bool:
        auth = response.auth
        signature, auth.signature = auth.signature, b""
        valid = auth.nonce == request.auth.nonce and hmac.compare_digest(signature, self._mac(b"response", response))
        if not valid:
            _log_refusal("a DHT response without the swarm's secret")
        return valid


def _log_refusal(what: str) -> None:
    """Log a refusal, at most once a minute for the same one (callers with many identities cannot flood it)."""
    now = time.monotonic()
    if len(_last_refusal) > 1000:
        _last_refusal.clear()
    if now - _last_refusal.get(what, -_REFUSAL_LOG_PERIOD) >= _REFUSAL_LOG_PERIOD:
        _last_refusal[what] = now
        log.warning("Refused %s", what)


def read_secret(secret_path: str) -> bytes:
    """The swarm's secret from a file: its bytes, surrounding whitespace stripped (an empty file is refused)."""
    with open(secret_path, "rb") as f:
        secret = f.read().strip()
    if not secret:
        raise ValueError(f"secret_path={secret_path!r} is empty")
    return secret


def peer_policy(
    allowed_peers: Optional[Iterable[str]],
    secret: Optional[str],
    secret_path: Optional[str],
    identity_path: Optional[str],
) -> Optional[AccessPolicy]:
    """Who may talk to a peer started with these settings (None: anyone); an allow-list must list the peer itself,
    whose stable identity is ``identity_path``."""
    policy = AccessPolicy.create(allowed_peers, read_secret(secret_path) if secret_path else secret)
    if policy is not None and policy.allowed is not None:
        if not identity_path:
            raise ValueError("allowed_peers needs identity_path: this peer's stable identity, which must be listed")
        own = create_identity(identity_path)
        if own not in policy.allowed:
            raise ValueError(f"This peer's id {own} (identity_path={identity_path!r}) is not on allowed_peers")
    if policy is not None:
        log.warning("Private swarm: %r", policy)
    return policy
