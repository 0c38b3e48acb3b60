"""Private swarms (docs/private_swarm.md): a peer off the allow-list, or without the swarm's secret, can neither
serve a stage, nor send work to one, nor write (or read) records that the swarm's peers accept. Real peer processes on
loopback; the outsiders are a peer process and a node in this process."""

from __future__ import annotations

import json
import re
from functools import partial

import pytest
import torch
from helpers import FAST, SMALL_GPT
from helpers.raw_client import NONE_META, RawClient, wait_until_serving, wire
from hivemind.dht import DHT
from hivemind.dht.routing import DHTID
from hivemind.p2p import P2PHandlerError, PeerID
from hivemind.utils import get_dht_time
from hivemind.utils.serializer import MSGPackSerializer

from lightning_swarm import discovery
from lightning_swarm.discovery import PeerRecord, PeerState
from lightning_swarm.node import SwarmNode
from lightning_swarm.security import AUTH_FIELD, AccessPolicy, SecretRecordValidator, create_identity, peer_id_of

SECRET = "correct horse battery staple"


class OutsiderNode(SwarmNode):
    """A node that starts even when no peer of the swarm answers its DHT pings (an outsider's would not)."""

    def _create_dht(self) -> DHT:
        validators = [SecretRecordValidator(self.policy.key)] if self.policy is not None else []
        return DHT(
            initial_peers=self.initial_peers,
            start=True,
            host_maddrs=self.host_maddrs,
            record_validators=validators,
            ensure_bootstrap_success=False,
            nat_port_map=False,
            auto_nat=False,
            startup_timeout=self.timeout,
            await_ready=True,
        )


async def store_directly(dht: DHT, node, target: str, key: str, subkey: str, value) -> object:
    """Ask the peer ``target`` itself (DHT RPC rpc_store) to store a record; None if it refused the call."""
    stored = await node.protocol.call_store(
        PeerID.from_base58(target),
        [DHTID.generate(key)],
        [MSGPackSerializer.dumps(value)],
        [get_dht_time() + 300],
        subkeys=[MSGPackSerializer.dumps(subkey)],
    )
    return None if stored is None else list(stored)


async def find_directly(dht: DHT, node, target: str, key: str) -> object:
    """Ask the peer ``target`` itself (DHT RPC rpc_find) for a key; None if it refused the call."""
    found = await node.protocol.call_find(PeerID.from_base58(target), [DHTID.generate(key)])
    return None if found is None else "answered"


@pytest.mark.parametrize("mode", ["allow_list", "secret"])
def test_outsiders_can_neither_serve_nor_send_work_nor_write_records(swarm, tmp_path, mode):
    env = {**FAST, "SWARM_NUM_STAGES": "1", "SWARM_COMPRESSION": "none", "SWARM_TARGET_BATCH_SIZE": "8"}
    keys = {name: str(tmp_path / f"{name}.key") for name in ("server", "trainer", "reader", "outsider")}
    ids = {name: create_identity(path) for name, path in keys.items()}
    if mode == "allow_list":
        allowed = tmp_path / "allowed_peers.txt"
        allowed.write_text("# the swarm\n" + "".join(f"{ids[n]}\n" for n in ("server", "trainer", "reader")))
        member_env, outsider_env = {"SWARM_ALLOWED_PEERS": str(allowed)}, {}
        reader_policy = outsider_policy = None  # the reader only calls out: it needs no guard of its own
        refusal = "is not on the allow-list of this swarm"
    else:
        (tmp_path / "swarm.secret").write_text(SECRET + "\n")
        member_env, outsider_env = {"SWARM_SECRET_PATH": str(tmp_path / "swarm.secret")}, {"SWARM_SECRET": "guess"}
        reader_policy, outsider_policy = AccessPolicy.create(secret=SECRET), AccessPolicy.create(secret="guess")
        refusal = "did not prove the swarm's secret"
    serve = {"SWARM_ROLE": "serve", "SWARM_STAGE": "0"}
    server = swarm.start("server", SMALL_GPT, env={**env, **member_env, **serve, "SWARM_IDENTITY_PATH": keys["server"]})
    server_address = server.addresses()[0]

    # 1. an outsider peer process tries to serve stage 0
    outsider_args = (SMALL_GPT, {**env, **outsider_env, **serve, "SWARM_IDENTITY_PATH": keys["outsider"]})
    with pytest.raises(RuntimeError, match="bootstrap failed"):  # it cannot even join: its DHT calls are refused
        swarm.start("outsider", *outsider_args)

    reader = SwarmNode([server_address], identity_path=keys["reader"], policy=reader_policy).start()
    outsider = OutsiderNode([server_address], policy=outsider_policy).start()
    outsider_id = str(outsider.peer_id)
    try:
        # 2. an outsider sends work, and asks for the stage's parameters
        client = RawClient(outsider, server_address, swarm.run_id)
        x = torch.randn(2, 32, 32)
        for call in (
            lambda: client.call("forward", [wire(x)]),
            lambda: client.call("forward", [wire(x)], {**NONE_META, AUTH_FIELD: "0" * 64}),
            lambda: client.state(),
        ):
            with pytest.raises(P2PHandlerError, match=re.escape(refusal)):
                call()
        if mode == "secret":  # a token made with a wrong secret
            forged = outsider_policy.token(swarm.run_id, outsider.peer_id, PeerID.from_base58(ids["server"]))
            with pytest.raises(P2PHandlerError, match=re.escape(refusal)):
                client.call("forward", [wire(x)], {**NONE_META, AUTH_FIELD: forged})

        # 3. an outsider writes records: it claims to serve stage 0, through the DHT and straight to the server
        fake = PeerRecord(str(outsider.peer_id), 0, PeerState.SERVING, 1e6, 0).to_value()
        key = discovery.stage_key(swarm.run_id, 0)
        outsider.dht_store(key, str(outsider.peer_id), fake, ttl=300)
        attack = partial(store_directly, target=ids["server"], key=key, subkey=str(outsider.peer_id) + "x", value=fake)
        direct = outsider.dht.run_coroutine(attack, return_future=True)
        assert not any(direct.result(timeout=30) or [])
        # and it cannot read the swarm's records either, even asking the server itself
        look = partial(find_directly, target=ids["server"], key=key)
        assert outsider.dht.run_coroutine(look, return_future=True).result(timeout=30) is None

        # a member trains meanwhile: if any record of an outsider were accepted, its router would use it
        record = tmp_path / "trainer.json"
        swarm.start(
            "trainer",
            [*SMALL_GPT, "--max-steps", "8", "--history", str(record)],
            env={**env, **member_env, "SWARM_ROLE": "drive", "SWARM_IDENTITY_PATH": keys["trainer"]},
        )
        assert swarm.wait("trainer", timeout=240) == 0, swarm.peers["trainer"].log()[-3000:]
        with open(record) as f:
            trained = json.load(f)
        seen = set(discovery.fetch_stage(reader, swarm.run_id, 0))
        wait_until_serving(RawClient(reader, server_address, swarm.run_id), server)  # members are served
    finally:
        outsider.shutdown()
        reader.shutdown()

    print(f"{mode}: records seen by a member {seen}; trainer's calls {trained['calls_per_peer']}")
    assert trained["steps"] == 8
    assert set(trained["calls_per_peer"]) == {ids["server"]} and not trained["failed_calls_per_peer"]
    assert seen == {ids["server"]}
    refusals = re.findall(r"Refused a request: peer (\S+) " + re.escape(refusal), server.log())
    assert outsider_id in refusals
    if mode == "allow_list":
        assert ids["outsider"] in refusals  # the outsider process's DHT pings
    else:
        assert "Refused a DHT request without the swarm's secret" in server.log()
    assert peer_id_of(keys["server"]) == ids["server"] == server_address.rsplit("/", 1)[-1]
