"""Real models on a swarm of real peer processes, left as their users wrote them: blocks in an ``nn.ModuleList`` or
``nn.ModuleDict`` some levels down, called in the model's own loop with side inputs (rotary tables, masks, flags).

The peers run tests/helpers/model_peer.py (the models are in tests/helpers/real_models.py, the checks in
tests/helpers/real_model_checks.py). This file runs them on the LitGPT and torchtitan-shaped models;
test_real_models_hf.py on transformers' Llama, GPT-2 and Qwen2 (two files, so that ``pytest -n 2 --dist loadfile``
runs them side by side).
"""

from __future__ import annotations

import pytest
from helpers.real_model_checks import exact_against_single_process, loss_falls_with_defaults


@pytest.mark.parametrize("model", ["litgpt", "titan"])
def test_exact_against_single_process(model_swarm, tmp_path, model):
    """LitGPT's GPT (``transformer.h``, each block called with cos, sin, mask=None, input_pos=None positionally)
    and a torchtitan-shaped model (``layers``, an ``nn.ModuleDict``, each layer called with the rotary table)."""
    exact_against_single_process(model_swarm, tmp_path, model)


def test_loss_falls_with_defaults(model_swarm, tmp_path):
    loss_falls_with_defaults(model_swarm, tmp_path, "litgpt")
