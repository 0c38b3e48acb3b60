"""transformers' Llama, GPT-2 and Qwen2 on a swarm of real peer processes, as their users write them
(``self.model(input_ids=x, labels=x).loss``): the checks of tests/helpers/real_model_checks.py.

Their decoder layers are called with keyword side inputs: ``attention_mask`` (None under sdpa without padding; a
``(B, 1, T, T)`` float mask under GPT-2's eager attention; for Qwen2 None in its full-attention layer and a
``(B, 1, T, T)`` bool sliding-window mask in the others), ``position_embeddings`` (a tuple of cos and sin),
``position_ids``, ``cache_position``, ``past_key_values=None`` and ``use_cache=False``.
"""

from __future__ import annotations

import pytest
from helpers.real_model_checks import exact_against_single_process, loss_falls_with_defaults

MODELS = ["llama", "gpt2", "qwen2"]


@pytest.mark.parametrize("model", MODELS)
def test_exact_against_single_process(model_swarm, tmp_path, model):
    exact_against_single_process(model_swarm, tmp_path, model)


@pytest.mark.parametrize("model", MODELS)
def test_loss_falls_with_defaults(model_swarm, tmp_path, model):
    loss_falls_with_defaults(model_swarm, tmp_path, model)
