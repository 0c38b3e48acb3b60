"""Partitioning a model into stages: balance, finding the pipeline, and stage state keys."""

from __future__ import annotations

import lightning as L
import pytest
from torch import nn

from lightning_swarm import partitioning


def test_balance_by_parameters_minimises_the_largest_stage():
    blocks = [nn.Linear(10, 10), nn.Linear(10, 100), nn.Linear(100, 10), nn.Linear(10, 10)]
    spans = partitioning.balance_by_parameters(blocks, 2)
    assert [(s.start, s.end) for s in spans] == [(0, 2), (2, 4)]
    equal = partitioning.balance_by_parameters([nn.Linear(8, 8) for _ in range(6)], 3)
    assert [(s.start, s.end) for s in equal] == [(0, 2), (2, 4), (4, 6)]
    with pytest.raises(ValueError, match="3 blocks into 4 stages"):
        partitioning.balance_by_parameters(blocks[:3], 4)


class TwoSequentials(L.LightningModule):
    def __init__(self, big: int, small: int) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(big, big), nn.Linear(big, big))
        self.head = nn.Sequential(nn.Linear(small, small))


def test_find_pipeline_by_name_and_automatically():
    assert partitioning.find_pipeline(TwoSequentials(8, 4)) == "body"
    assert partitioning.find_pipeline(TwoSequentials(8, 4), "head") == "head"
    with pytest.raises(ValueError, match="nn.Sequential"):
        partitioning.find_pipeline(TwoSequentials(8, 4), "missing")
    with pytest.raises(ValueError, match="pipeline=<name>"):
        partitioning.find_pipeline(_tied())


def _tied() -> L.LightningModule:
    module = L.LightningModule()
    module.a = nn.Sequential(nn.Linear(4, 4))
    module.b = nn.Sequential(nn.Linear(4, 4))
    return module


def test_stage_state_keys_map_back_to_the_model():
    span = partitioning.StageSpan(index=1, start=2, end=4)
    assert partitioning.stage_state_key("blocks", span, "1.qkv.weight") == "blocks.3.qkv.weight"
