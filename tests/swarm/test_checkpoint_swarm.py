"""Complete checkpoints: a checkpoint saved on a peer of a 3-stage swarm holds every stage, loads into the plain
model (which then computes what the swarm computes), and ``fit(ckpt_path=...)`` resumes a swarm from it: stages'
parameters and optimizer states."""

from __future__ import annotations

import io
import json

import torch
from helpers import FAST, SMALL_GPT
from helpers.raw_client import RawClient, wait_until_serving, wire

from lightning_swarm.checkpointing import CONSISTENT_KEY, STAGE_OPTIMIZERS_KEY, STAGE_STEPS_KEY
from lightning_swarm.client.routing import StageRouter
from lightning_swarm.node import SwarmNode

GPT_ARGS = [*SMALL_GPT[:2], *SMALL_GPT[4:], "--n-layer", "3", "--lr", "1e-2"]  # three blocks: one per stage


EVAL_META = {"codec": "none", "train": False}


def losses(path) -> list[float]:
    with open(path) as f:
        return json.load(f)["losses"]


def optimizer_state(router: StageRouter, stage: int) -> dict:
    """A stage optimizer's state dict, downloaded as a peer joining the stage downloads it."""
    raw = router.fetch_state(stage, optimizer=True)["optimizer"]
    return torch.load(io.BytesIO(raw.numpy().tobytes()), weights_only=True)


def moments(state: dict) -> dict:
    return {(i, k): v for i, s in state["state"].items() if isinstance(s, dict) for k, v in s.items() if k != "step"}


def start_stages(swarm, env: dict, prefix: str, resume=None) -> list:
    extra = ["--resume", str(resume)] if resume else []
    return [
        swarm.start(f"{prefix}{k}", [*GPT_ARGS, *extra], env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": str(k)})
        for k in range(3)
    ]


def test_checkpoint_loads_into_the_plain_model_and_resumes_the_swarm(swarm, tmp_path):
    from gpt import GPT

    env = {**FAST, "SWARM_NUM_STAGES": "3", "SWARM_COMPRESSION": "none", "SWARM_TARGET_BATCH_SIZE": "8"}
    ckpt = tmp_path / "swarm.ckpt"
    stages = start_stages(swarm, env, "stage")
    first = tmp_path / "first.json"
    args = [*GPT_ARGS, "--max-steps", "12", "--history", str(first), "--save", str(ckpt)]
    swarm.start("trainer", args, env={**env, "SWARM_ROLE": "drive"})
    assert swarm.wait("trainer", timeout=300) == 0, swarm.peers["trainer"].log()[-3000:]

    # the checkpoint in a plain, single-process model, against the live stages on the same inputs
    model = GPT.load_from_checkpoint(ckpt, map_location="cpu").eval()
    node = SwarmNode(initial_peers=stages[0].addresses()).start()
    try:
        clients = [RawClient(node, peer.addresses()[0], swarm.run_id, stage=k) for k, peer in enumerate(stages)]
        for client, peer in zip(clients, stages):
            wait_until_serving(client, peer)
        idx = torch.randint(0, model.hparams.vocab_size, (4, model.hparams.block_size))
        with torch.no_grad():
            hidden = model.tok_emb(idx) + model.pos_emb(torch.arange(idx.shape[1]))
            expected = model.blocks(hidden)
            through_swarm = hidden
            for client in clients:
                (through_swarm,) = client.call("forward", [wire(through_swarm)], EVAL_META)
            logits = model.head(model.ln_f(through_swarm))
            difference = (through_swarm - expected).abs().max().item()
            assert torch.allclose(logits, model(idx), atol=1e-5)
    finally:
        node.shutdown()
    print(f"checkpoint: max |swarm - plain model| on the pipeline's output = {difference:.3g}")
    assert difference < 1e-5

    # resume: a new swarm, its stages seeded from the checkpoint, and a trainer continue the loss curve
    for name in ("stage0", "stage1", "stage2"):
        swarm.stop(name)
    resumed_stages = start_stages(swarm, env, "resumed", resume=ckpt)
    checkpoint = torch.load(ckpt, weights_only=False)
    saved, saved_optimizers = checkpoint["state_dict"], checkpoint[STAGE_OPTIMIZERS_KEY]
    assert sorted(saved_optimizers) == [0, 1, 2]
    steps = checkpoint[STAGE_STEPS_KEY]  # each stage's step, as gathered (all idle at the end: the same)
    assert sorted(steps) == [0, 1, 2] and all(isinstance(step, int) and step > 0 for step in steps.values())
    assert checkpoint[CONSISTENT_KEY] == (len(set(steps.values())) == 1)
    node = SwarmNode(initial_peers=resumed_stages[0].addresses()).start()
    router = StageRouter(node, swarm.run_id, 3, request_timeout=20, stage_wait_timeout=60)
    try:
        for k, peer in enumerate(resumed_stages):  # one block per stage: stage k holds blocks.k as "0.*"
            wait_until_serving(RawClient(node, peer.addresses()[0], swarm.run_id, stage=k), peer)
            state = router.fetch_state(k)  # read as a peer joining the stage reads it (the stage's only peer)
            assert state and all(torch.equal(v, saved[f"blocks.{k}." + n.split(".", 1)[1]]) for n, v in state.items())
            expected, loaded = moments(saved_optimizers[k]), moments(optimizer_state(router, k))  # Adam's moments
            assert expected and any(v.abs().sum() > 0 for v in expected.values()), "the stage never stepped"
            assert expected.keys() == loaded.keys() and all(torch.equal(expected[i], loaded[i]) for i in expected)
    finally:
        router.close()
        node.shutdown()
    second = tmp_path / "second.json"
    args = [*GPT_ARGS, "--max-steps", "18", "--history", str(second), "--resume", str(ckpt)]
    swarm.start("resumed_trainer", args, env={**env, "SWARM_ROLE": "drive"})
    assert swarm.wait("resumed_trainer", timeout=300) == 0, swarm.peers["resumed_trainer"].log()[-3000:]
    before, after = losses(first), losses(second)
    drop = before[0] - sum(before[-3:]) / 3
    resumed = sum(after[:3]) / 3
    print(
        f"resume: loss {before[0]:.3f} -> {sum(before[-3:]) / 3:.3f} over {len(before)} steps; after resuming "
        f"{after[:3]} ({len(after)} more steps)"
    )
    assert len(after) == 18 - 12  # the step count was restored too
    assert drop > 0.3, "the first run learnt too little for the comparison to mean anything"
    assert resumed < before[0] - 0.6 * drop  # not back at the initial loss
