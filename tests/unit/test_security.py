"""Private swarms in-process: records and tokens are validated, and a node's allow-list guards only that node and
only while it runs."""

from __future__ import annotations

import pytest
from hivemind.p2p import P2P
from hivemind.utils.serializer import MSGPackSerializer

from lightning_swarm import protocol
from lightning_swarm.node import SwarmNode
from lightning_swarm.security import AUTH_FIELD, AccessPolicy, SecretRecordValidator, create_identity


def test_record_validator_and_tokens():
    """Without processes: the secret's MAC covers every part of a record, and tokens name caller and receiver."""
    from hivemind.dht.validation import DHTRecord

    good, other = SecretRecordValidator(AccessPolicy.create(secret="a").key), AccessPolicy.create(secret="b")
    record = DHTRecord(b"key", b"subkey", MSGPackSerializer.dumps((1, 2.0)), 123.5)
    signed = DHTRecord(record.key, record.subkey, good.sign_value(record), record.expiration_time)
    assert good.validate(signed) and good.strip_value(signed) == record.value
    assert not SecretRecordValidator(other.key).validate(signed)
    for change in (dict(key=b"kez"), dict(subkey=b"x"), dict(expiration_time=999.0), dict(value=signed.value[1:])):
        assert not good.validate(DHTRecord(**{**signed.__dict__, **change}))
    assert not good.validate(record)
    policy = AccessPolicy.create(secret="a")
    assert policy.token("run", "A", "B") != policy.token("run", "B", "A") != policy.token("run2", "A", "B")
    assert policy.token("run", "A", "B") != other.token("run", "A", "B")
    assert policy.key.hex() not in repr(policy) and repr(policy.key) not in repr(policy)
    assert protocol.decode_metadata(protocol.encode_metadata(policy.sign_metadata({}, "run", "A", "B")))[AUTH_FIELD]


def test_the_guard_is_lifted_when_its_node_shuts_down(tmp_path):
    """In one process: while a node with an allow-list runs, nodes started here refuse outsiders; once it shut
    down, a new node accepts anyone again (a later swarm in the same process is not guarded by an old list)."""
    key = str(tmp_path / "member.key")
    member = SwarmNode(identity_path=key, policy=AccessPolicy.create([create_identity(key)])).start()
    try:
        with pytest.raises(RuntimeError, match=r"bootstrap failed: none of the initial peers answered \(3 attempt"):
            SwarmNode(member.visible_maddrs()).start()  # refused every time: busy peers are retried, so are these
    finally:
        member.shutdown()
    first = SwarmNode().start()
    try:
        second = SwarmNode(first.visible_maddrs()).start()
        assert second.dht_store("open", "x", 1, ttl=30) and first.dht_get("open") == {"x": 1}
        second.shutdown()
    finally:
        first.shutdown()


def test_the_guard_is_scoped_to_its_node(tmp_path):
    """In one process: a node with an allow-list leaves hivemind's P2P class alone, and a node without one started
    beside it (its DHT process forked while the guard is on) admits anyone, while the guarded node refuses them."""
    key = str(tmp_path / "member.key")
    original = P2P.add_protobuf_handler
    member = SwarmNode(identity_path=key, policy=AccessPolicy.create([create_identity(key)])).start()
    try:
        assert P2P.add_protobuf_handler is original
        with pytest.raises(RuntimeError, match="bootstrap failed"):
            SwarmNode(member.visible_maddrs()).start(attempts=1)
        open_node = SwarmNode().start()  # (starting a process reaps the failed one's)
        try:
            anyone = SwarmNode(open_node.visible_maddrs()).start()
            assert anyone.dht_store("open", "x", 1, ttl=30) and open_node.dht_get("open") == {"x": 1}
            anyone.shutdown()
        finally:
            open_node.shutdown()
    finally:
        member.shutdown()
    assert P2P.add_protobuf_handler is original
