"""A peer of a real swarm allocates only the stage it serves."""

from __future__ import annotations

import signal

import lightning as L
import torch

from lightning_swarm.strategy import SwarmStrategy


def test_empty_init_allocates_only_the_served_stage(swarm):
    """A model built under ``trainer.init_module(empty_init=True)`` serves stage 0 and trains through a real peer
    serving stage 1; the blocks of stage 1 are never allocated here."""
    from gpt import GPT, CharDataModule

    env = dict(SWARM_NUM_STAGES="2", SWARM_TARGET_BATCH_SIZE="8", SWARM_MATCHMAKING_TIME="1.0")
    env.update(SWARM_AVERAGING_TIMEOUT="4.0", SWARM_UPDATE_PERIOD="1.0", SWARM_DELAYED_UPDATES="false")
    model_args = ["--d-model", "32", "--n-layer", "4", "--n-head", "2", "--block-size", "32", "--batch-size", "8"]
    peer = swarm.start("stage1", model_args, env={**env, "SWARM_ROLE": "serve", "SWARM_STAGE": "1"})
    strategy = SwarmStrategy(
        run_id=swarm.run_id,
        num_stages=2,
        stage=0,
        initial_peers=peer.addresses(),
        target_batch_size=8,
        delayed_updates=False,
        matchmaking_time=1.0,
        averaging_timeout=4.0,
        update_period=1.0,
        request_timeout=20.0,
        rebalance_period=0,
    )
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=3,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    datamodule = CharDataModule(block_size=32, batch_size=8, num_batches=10)
    try:
        with trainer.init_module(empty_init=True):
            model = GPT(datamodule.vocab_size, block_size=32, d_model=32, n_layer=4, n_head=2, lr=1e-2)
        assert all(p.is_meta for p in model.parameters())
        trainer.fit(model, datamodule)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    assert trainer.global_step == 3
    blueprint = strategy._blueprint
    assert all(p.is_meta for block in blueprint[2:] for p in block.parameters())  # stage 1: never allocated
    served = [p for block in blueprint[:2] for p in block.parameters()]
    assert served and not any(p.is_meta for p in served) and all(torch.isfinite(p).all() for p in served)
    assert not any(p.is_meta for p in model.parameters())  # the local modules (embeddings, head) trained here
