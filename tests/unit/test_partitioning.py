"""Partitioning a model into stages: balance, finding the pipeline at any depth, stage state keys, and freeing and
allocating blocks again (empty for a downloaded state, or initialised as the model initialises them)."""

from __future__ import annotations

import copy
from typing import Callable

import lightning as L
import litgpt
import pytest
import torch
import transformers
from gpt import GPT
from torch import nn

from lightning_swarm import partitioning

CPU = torch.device("cpu")


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
    with pytest.raises(ValueError, match=r"'missing': nothing is there .* nn.Sequential.*found automatically: body"):
        partitioning.find_pipeline(TwoSequentials(8, 4), "missing")
    with pytest.raises(ValueError, match=r"'body.0': found a Linear"):
        partitioning.find_pipeline(TwoSequentials(8, 4), "body.0")
    module = TwoSequentials(8, 4)
    module.empty = nn.ModuleList()
    with pytest.raises(ValueError, match="found an empty ModuleList"):
        partitioning.find_pipeline(module, "empty")
    with pytest.raises(ValueError, match=r"could be the pipeline.*\(a, b\): pass pipeline=<dotted path>"):
        partitioning.find_pipeline(_tied())
    with pytest.raises(ValueError, match="has no container of blocks"):
        partitioning.find_pipeline(TwoSequentials(8, 4).head)


def _tied() -> L.LightningModule:
    module = L.LightningModule()
    module.a = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    module.b = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
    return module


class TitanBlock(nn.Module):
    """A block over ``nn.MultiheadAttention`` (only ``_reset_parameters``) with a causal mask outside the state dict."""

    def __init__(self, d: int = 16, length: int = 8) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(d)
        self.attn = nn.MultiheadAttention(d, 2, batch_first=True)
        self.register_buffer("mask", torch.ones(length, length, dtype=torch.bool).triu(1), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        return x + self.attn(h, h, h, attn_mask=self.mask[: x.size(1), : x.size(1)], need_weights=False)[0]


class TitanLike(nn.Module):
    """torchtitan's layout: the blocks in an ``nn.ModuleDict`` keyed "0", "1", ..., called in the order of its keys."""

    def __init__(self, n: int = 3) -> None:
        super().__init__()
        self.tok_embeddings = nn.Embedding(32, 16)
        self.layers = nn.ModuleDict({str(i): TitanBlock() for i in range(n)})
        self.output = nn.Linear(16, 32)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(h)


def in_lightning(model: nn.Module) -> L.LightningModule:
    module = L.LightningModule()
    module.model = model
    return module


def litgpt_gpt() -> litgpt.GPT:
    config = litgpt.Config(n_layer=3, n_head=2, n_embd=32, block_size=32, vocab_size=64, padded_vocab_size=64)
    return litgpt.GPT(config)


TINY_DECODER = dict(
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=3,
    num_attention_heads=2,
    num_key_value_heads=1,
)


def llama() -> nn.Module:
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(**TINY_DECODER))


def gpt2() -> nn.Module:
    return transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=32, n_layer=3, n_head=2)
    )


def qwen2_sliding() -> nn.Module:
    config = transformers.Qwen2Config(**TINY_DECODER, use_sliding_window=True, sliding_window=4, max_window_layers=1)
    model = transformers.Qwen2ForCausalLM(config)
    assert {layer.attention_type for layer in model.model.layers} == {"full_attention", "sliding_attention"}
    return model


MODELS: dict[str, tuple[Callable[[], nn.Module], str]] = {
    "examples/gpt.py": (lambda: GPT(vocab_size=64, block_size=32, d_model=32, n_layer=3, n_head=2), "blocks"),
    "litgpt": (lambda: in_lightning(litgpt_gpt()), "model.transformer.h"),
    "llama": (lambda: in_lightning(llama()), "model.model.layers"),
    "gpt2": (lambda: in_lightning(gpt2()), "model.transformer.h"),
    "qwen2-sliding-window": (lambda: in_lightning(qwen2_sliding()), "model.model.layers"),
    "torchtitan-like": (lambda: in_lightning(TitanLike()), "model.layers"),
}


@pytest.fixture(params=list(MODELS))
def model(request) -> tuple[nn.Module, str]:
    build, path = MODELS[request.param]
    torch.manual_seed(0)
    return build(), path


def test_find_pipeline_finds_the_blocks_of_real_models(model):
    module, path = model
    assert partitioning.find_pipeline(module) == path
    assert partitioning.find_pipeline(module, path) == path
    container = module.get_submodule(path)
    blocks, names = partitioning.blocks_of(container), partitioning.block_names(container)
    assert names == ["0", "1", "2"] and blocks == [container.get_submodule(n) for n in names]


def test_stage_state_keys_map_back_to_the_model(model):
    module, path = model
    container, state = module.get_submodule(path), module.state_dict(keep_vars=True)
    names = partitioning.block_names(container)
    span = partitioning.StageSpan(index=1, start=1, end=3)
    stage = partitioning.stage_module(container, span)
    for key, tensor in stage.state_dict(keep_vars=True).items():
        assert state[partitioning.stage_state_key(path, names, span, key)] is tensor
    assert partitioning.Pipeline(path, tuple(names)).state_key(span, "1.x") == f"{path}.2.x"


def test_stage_state_keys_use_the_names_of_a_module_dict():
    names, span = ["embed", "layer_a", "layer_b"], partitioning.StageSpan(index=1, start=1, end=3)
    key = partitioning.stage_state_key("model.layers", names, span, "1.qkv.weight")
    assert key == "model.layers.layer_b.qkv.weight"


class Wrapped(nn.Module):
    def __init__(self, body: nn.Module) -> None:
        super().__init__()
        self.body = body


def test_find_pipeline_skips_wrappers_and_prefers_the_blocks():
    # nanoGPT's transformer: two embeddings outweighing the blocks, beside the blocks' own ModuleList
    nano = L.LightningModule()
    blocks = nn.ModuleList([nn.Linear(4, 4) for _ in range(2)])
    nano.transformer = nn.ModuleDict(dict(wte=nn.Embedding(1000, 4), wpe=nn.Embedding(1000, 4), h=blocks))
    assert partitioning.find_pipeline(nano) == "transformer.h"
    # a Sequential around the whole model: its embedding and head are no blocks
    whole = L.LightningModule()
    inner = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    whole.net = nn.Sequential(nn.Embedding(1000, 8), Wrapped(inner), nn.Linear(8, 1000))
    assert partitioning.find_pipeline(whole) == "net.1.body"
    # a chain of mixed layers is a pipeline (the old rule's direct nn.Sequential), the ReLUs carrying no parameters
    mlp = L.LightningModule()
    mlp.layers = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 4))
    assert partitioning.find_pipeline(mlp) == "layers"


def test_tied_containers_nested_in_one_another_give_the_innermost():
    module = L.LightningModule()
    inner = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    module.outer = nn.Sequential(inner, nn.Sequential(nn.ReLU(), nn.ReLU()))  # its other block holds nothing
    assert partitioning.pipeline_candidates(module)["outer"] == partitioning.pipeline_candidates(module)["outer.0"]
    assert partitioning.find_pipeline(module) == "outer.0"


def test_a_pipeline_held_in_two_places_is_refused():
    module = L.LightningModule()
    module.model = Wrapped(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    module.alias = module.model.body
    with pytest.raises(ValueError, match="'model.body' is also held at alias: .* one place only"):
        partitioning.find_pipeline(module)
    module = L.LightningModule()
    module.model = Wrapped(nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)]))
    module.backbone = module.model  # an alias of an ancestor: replacing the container reaches both
    assert partitioning.find_pipeline(module) == "model.body"
    module.model.layers = module.model.body  # the same parent's: named_children() would list it once
    with pytest.raises(ValueError, match="'model.body' is also held at model.layers"):
        partitioning.find_pipeline(module, "model.body")


class WithOptimizer(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Linear(4, 4)
        self.model = Wrapped(nn.ModuleList([nn.Linear(4, 4) for _ in range(4)]))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.5)


def test_replace_pipeline_and_a_stage_optimizer_at_a_dotted_path():
    module = WithOptimizer()
    module.trainer = L.Trainer(barebones=True, logger=False, accelerator="cpu", devices=1)
    container = module.model.body
    stage = partitioning.stage_module(container, partitioning.StageSpan(1, 2, 4))
    optimizer = partitioning.stage_optimizer(module, "model.body", stage)
    assert module.model.body is container  # put back
    params = [id(p) for group in optimizer.param_groups for p in group["params"]]
    assert params == [id(p) for p in stage.parameters()] and optimizer.param_groups[0]["momentum"] == 0.5
    placeholder = nn.Identity()
    assert partitioning.replace_pipeline(module, "model.body", placeholder) is container
    assert module.model.body is placeholder and "model.body" in dict(module.named_modules())


def test_released_blocks_take_a_downloaded_state_back_exactly(model):
    module, path = model
    original = copy.deepcopy(module)
    container = module.get_submodule(path)
    names = partitioning.block_names(container)
    span = partitioning.balance_by_parameters(partitioning.blocks_of(container), 2)[1]
    stage = partitioning.stage_module(container, span)
    kept = {name: buffer for name, buffer in stage.named_buffers() if not _persistent(stage, name)}

    partitioning.release(stage)
    assert all(t.is_meta for t in stage.state_dict().values())
    assert all(buffer is kept[name] for name, buffer in stage.named_buffers() if name in kept)
    partitioning.materialize(stage, CPU, None)
    state = original.state_dict()
    stage.load_state_dict({k: state[partitioning.stage_state_key(path, names, span, k)] for k in stage.state_dict()})

    for i, name in enumerate(names[span.start : span.end]):
        block, before = stage[i], original.get_submodule(f"{path}.{name}")
        _assert_same_tensors(block.state_dict(), before.state_dict())
        _assert_same_tensors(dict(block.named_buffers()), dict(before.named_buffers()))
    torch.testing.assert_close(logits(module.eval()), logits(original.eval()), rtol=0, atol=0)  # the stage's blocks


def logits(module: nn.Module) -> torch.Tensor:
    """The model's output for a few tokens, called as its users call it."""
    tokens = torch.arange(8).view(1, 8) % 32
    model = module if isinstance(module, GPT) else module.model
    output = model(tokens)
    return output.logits if isinstance(output, transformers.utils.ModelOutput) else output


def _persistent(stage: nn.Module, name: str) -> bool:
    owner, _, buffer = name.rpartition(".")
    return buffer not in stage.get_submodule(owner)._non_persistent_buffers_set


def _assert_same_tensors(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for key in got:
        assert got[key].device == CPU and torch.equal(got[key], expected[key]), key


def test_blocks_are_initialised_as_the_model_initialises_them(model):
    module, path = model
    if isinstance(getattr(module, "model", None), litgpt.GPT):
        module.model.apply(module.model._init_weights)  # how LitGPT initialises: its constructor keeps torch's
    reference = copy.deepcopy(module.get_submodule(path))
    stage = partitioning.stage_module(module.get_submodule(path), partitioning.StageSpan(0, 0, 3))
    partitioning.release(stage)
    partitioning.materialize(stage, CPU, partitioning.initializer(module, path))
    _assert_initialised_like(stage.state_dict(), nn.Sequential(*partitioning.blocks_of(reference)).state_dict())


def _assert_initialised_like(got: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> None:
    """Every tensor finite; a constant one (a norm's weight, a bias) the same constant; a random one fresh, with a
    spread near the reference's (GPT-2's scaled projections differ by a factor of two)."""
    assert got.keys() == reference.keys()
    for key, tensor in got.items():
        expected = reference[key].float()
        assert torch.isfinite(tensor).all(), key
        if expected.numel() < 2 or expected.std() == 0:
            assert torch.equal(tensor, reference[key]), key
        else:
            assert not torch.equal(tensor, reference[key]), key
            assert 1 / 3 < tensor.float().std() / expected.std() < 3, key


@pytest.mark.parametrize("name", ["llama", "examples/gpt.py"])
def test_blocks_of_a_model_built_on_the_meta_device_are_initialised(name):
    build, path = MODELS[name]
    torch.manual_seed(0)
    reference = build()
    with torch.device("meta"):
        module = build()
    container = module.get_submodule(path)
    partitioning.materialize(container, CPU, partitioning.initializer(module, path))
    _assert_initialised_like(container.state_dict(), reference.get_submodule(path).state_dict())


class InitWeights(nn.Module):
    def __init__(self, calls: list[nn.Module]) -> None:
        super().__init__()
        self.calls = calls
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])

    def _init_weights(self, module: nn.Module) -> None:
        self.calls.append(module)
        if isinstance(module, nn.Linear):
            nn.init.constant_(module.weight, 0.5)


def test_initializer_uses_the_nearest_init_weights_along_the_path():
    calls, farther = [], []
    module = InitWeights(farther)
    module.model = InitWeights(calls)
    blocks = partitioning.stage_module(module.model.layers, partitioning.StageSpan(0, 0, 2))
    partitioning.initializer(module, "model.layers")(blocks)
    assert calls == [blocks[0], blocks[1], blocks] and not farther
    assert (blocks[0].weight == 0.5).all() and (blocks[1].weight == 0.5).all()


class Scale(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gain = nn.Parameter(torch.ones(4))


def test_tensors_the_initializer_cannot_set_are_named():
    module = L.LightningModule()
    module.blocks = nn.Sequential(nn.Linear(4, 4), Scale())
    partitioning.release(module.blocks)
    with pytest.raises(ValueError, match=r"left 1.gain \(Scale\) unset: define reset_parameters\(\) in Scale"):
        partitioning.materialize(module.blocks, CPU, partitioning.initializer(module, "blocks"))


def test_buffers_outside_the_state_dict_on_meta_need_an_initializer():
    with torch.device("meta"):
        blocks = nn.Sequential(TitanBlock(), TitanBlock())
    with pytest.raises(ValueError, match=r"non-persistent buffers 0.mask, 1.mask are on the meta device"):
        partitioning.materialize(blocks, CPU, None)
    with pytest.raises(ValueError, match=r"0.mask \(TitanBlock\).* reset_parameters\(\) in TitanBlock"):
        partitioning.materialize(blocks, CPU, partitioning.initializer(blocks, "0"))


def test_tied_tensors_stay_tied():
    shared = nn.Linear(4, 4)
    blocks = nn.Sequential(shared, nn.Sequential(shared, nn.Linear(4, 4)))
    partitioning.release(blocks)
    assert blocks[0].weight is blocks[1][0].weight and blocks[0].weight.is_meta
    partitioning.materialize(blocks, CPU, partitioning.initializer(blocks, "1"))
    assert blocks[0].weight is blocks[1][0].weight and isinstance(blocks[0].weight, nn.Parameter)
    assert blocks[0].weight.device == CPU and blocks[0].weight.requires_grad
