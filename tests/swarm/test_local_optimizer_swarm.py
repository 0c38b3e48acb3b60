"""The trainer's local optimizer (embeddings, head) follows ``delayed_updates`` as the stages' optimizers do."""

from __future__ import annotations

import signal

import lightning as L
import pytest
import torch

from lightning_swarm.strategy import SwarmStrategy

LR, GAMMA, STEPS = 1e-2, 0.5, 3


@pytest.mark.parametrize("delayed", [None, False], ids=["default", "synchronous"])
def test_local_parameters_hold_every_step_and_follow_the_learning_rate_schedule(delayed):
    """One peer trains a 1-stage swarm for 3 steps. On the CPU the local optimizer steps in the background by
    default (delayed updates); a checkpoint's local parameters, taken after any step, and the local parameters after
    ``fit`` hold the last step all the same (the values its optimizer stepped to), and the user's scheduler set the
    learning rate that optimizer steps with."""
    from gpt import GPT, CharDataModule

    class Scheduled(GPT):
        def configure_optimizers(self):
            optimizer = super().configure_optimizers()
            scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, GAMMA)
            return dict(optimizer=optimizer, lr_scheduler=dict(scheduler=scheduler, interval="step"))

    strategy = SwarmStrategy(
        run_id=f"local_opt_{delayed}",
        num_stages=1,
        stage=0,
        target_batch_size=8,
        delayed_updates=delayed,
        matchmaking_time=1.0,
        averaging_timeout=4.0,
        update_period=1.0,
        rebalance_period=0,
    )
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        enable_progress_bar=False,
        limit_val_batches=0,
        num_sanity_val_steps=0,
    )
    datamodule = CharDataModule(block_size=16, batch_size=8, num_batches=10)
    model = Scheduled(datamodule.vocab_size, block_size=16, d_model=16, n_layer=2, n_head=2, lr=LR)
    local = [name for name, _ in model.named_parameters() if not name.startswith("blocks.")]  # not cut into stages
    initial = {name: p.detach().clone() for name, p in model.named_parameters() if name in local}
    wrapped = []

    behind = []  # after each step, the local parameters a checkpoint would hold that lack the step

    def stepped(optimizer) -> dict[str, torch.Tensor]:
        return dict(zip(local, [p for group in optimizer.opt.param_groups for p in group["params"]]))

    class Keep(L.Callback):
        def on_train_start(self, trainer, module):
            wrapped.append(trainer.strategy.optimizers[0])

        def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx):
            state, values = trainer.strategy.lightning_module_state_dict(), stepped(wrapped[0])
            behind.extend(name for name in local if not torch.equal(state[name], values[name].detach()))

    trainer.callbacks.append(Keep())
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        trainer.fit(model, datamodule)
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
    optimizer = wrapped[0]
    assert optimizer.delay_optimizer_step == (delayed is None)
    assert optimizer.local_epoch == STEPS
    assert optimizer.opt.param_groups[0]["lr"] == pytest.approx(LR * GAMMA**STEPS)
    assert not behind, f"a checkpoint would hold local parameters a step behind their optimizer: {behind}"
    values, params = stepped(optimizer), dict(model.named_parameters())
    for name in local:
        assert not torch.equal(params[name], initial[name]), f"{name} never moved"
        assert torch.equal(params[name].detach(), values[name].detach()), f"{name} lacks its optimizer's last step"

