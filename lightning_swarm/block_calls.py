"""Block calls: a pipeline's blocks called the way the model calls them, with side inputs that travel to the stage.

A model calls each block with the activation first and any other positional and keyword arguments after it: rotary
tables, masks, position ids, flags (``block(x, cos, sin, mask, input_pos)`` in LitGPT,
``layer(h, attention_mask=..., position_embeddings=(cos, sin), use_cache=False)`` in transformers). Those are the
block's *side inputs*. They may be tensors, ``None``, numbers, booleans, strings, and tuples, lists or dicts of these;
anything else (a KV-cache object, say) cannot cross the wire and is refused with one line that names it.

On the wire a stage request carries, per block it runs, ``[args, kwargs]`` as a msgpack tree whose tensors are
references (``["t", i]``) into the request's tensors after the activation: a tensor passed to several blocks (the
rotary table to every layer) is sent once per request, and an expanded view (a mask broadcast over the batch) as
the data it expands (``["x", i, shape]``). Side-input tensors are sent exactly, never lossy-compressed.

What a block returns for given inputs is known without asking any peer: a copy of the blocks on the meta device
(:func:`meta_copy`) computes the output's shape and dtype (:class:`MetaBlocks`), which is what callers check replies
against and what stage servers check requests against. Client and server both import this leaf module, never each
other.
"""

from __future__ import annotations

import copy
from typing import Any, Callable, Iterable, Optional, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_swarm.errors import SwarmRequestError

Call = tuple[tuple, dict]  # one block call's side inputs: positional arguments after the activation, and keywords
MAX_NODES = 4096  # values in one request's side-input trees
MAX_DEPTH = 16

_SCALARS = (type(None), bool, int, float, str)


class SideInputError(TypeError):
    """A side input that cannot cross the wire (the message names the argument and what to set)."""


def describe(block: int, path: str) -> str:
    return f"argument {path!r} of block {block}"


def check_call(block: int, args: Sequence, kwargs: dict) -> None:
    """Raise :class:`SideInputError` naming the first side input that cannot cross the wire (positional arguments are
    named by their position, the activation being argument 0)."""
    if kwargs.get("use_cache"):
        raise SideInputError(
            f"{describe(block, 'use_cache')} is True: a KV cache cannot live on a swarm's stages. Train with "
            f"use_cache=False (for transformers: model.config.use_cache = False, or pass use_cache=False)"
        )
    named = [(str(i + 1), arg) for i, arg in enumerate(args)] + list(kwargs.items())
    for path, value in (leaf for name, arg in named for leaf in _leaves(arg, name)):
        if not isinstance(value, (*_SCALARS, torch.Tensor)):
            cache = "cache" in type(value).__name__.lower() or "cache" in path.lower() or "past" in path.lower()
            hint = (
                "a KV cache cannot live on a swarm's stages: pass use_cache=False / past_key_values=None"
                if cache
                else "side inputs may be tensors, None, numbers, booleans, strings, and tuples, lists or dicts of these"
            )
            raise SideInputError(
                f"{describe(block, path)} is a {type(value).__name__}, which cannot cross the wire: {hint}"
            )
        if isinstance(value, torch.Tensor) and value.requires_grad:
            raise SideInputError(
                f"{describe(block, path)} requires grad: side inputs reach the stages as constants (no gradient "
                f"flows back to them). Pass it detached, or compute it inside the block"
            )


def _leaves(value: Any, path: str) -> Iterable[tuple[str, Any]]:
    if isinstance(value, (tuple, list)):
        for i, item in enumerate(value):
            yield from _leaves(item, f"{path}[{i}]")
    elif isinstance(value, dict):
        for key, item in value.items():
            yield from _leaves(item, f"{path}[{key!r}]")
    else:
        yield path, value


def pack(calls: Sequence[Call]) -> tuple[list, list[torch.Tensor]]:
    """The calls as a msgpack-able tree and the tensors it references (each distinct tensor once)."""
    tensors: list[torch.Tensor] = []
    index: dict[int, int] = {}

    def node(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            if id(value) not in index:
                index[id(value)] = len(tensors)
                tensors.append(_unexpanded(value))
            if tensors[index[id(value)]].shape != value.shape:
                return ["x", index[id(value)], list(value.shape)]
            return ["t", index[id(value)]]
        if isinstance(value, (tuple, list)):
            return ["tuple" if isinstance(value, tuple) else "list", [node(v) for v in value]]
        if isinstance(value, dict):
            return ["dict", [[str(k), node(v)] for k, v in value.items()]]
        return value

    return [[node(tuple(args)), node(dict(kwargs))] for args, kwargs in calls], tensors


def _unexpanded(tensor: torch.Tensor) -> torch.Tensor:
    """The data an expanded view repeats: ``tensor`` with each dimension of stride 0 cut to size 1."""
    if all(stride or size <= 1 for stride, size in zip(tensor.stride(), tensor.shape)):
        return tensor
    return tensor[tuple(slice(0, 1) if stride == 0 else slice(None) for stride in tensor.stride())]


def unpack(tree: Any, tensors: Sequence[torch.Tensor], blocks: int) -> list[Call]:
    """The calls a request's tree describes, for ``blocks`` blocks; :class:`SwarmRequestError` if it is malformed."""
    count = [0]

    def tensor(i: Any) -> torch.Tensor:
        if isinstance(i, bool) or not isinstance(i, int) or not 0 <= i < len(tensors):
            raise SwarmRequestError(f"side input references tensor {i!r} of {len(tensors)}")
        return tensors[i]

    def value(node: Any, depth: int) -> Any:
        count[0] += 1
        if count[0] > MAX_NODES or depth > MAX_DEPTH:
            raise SwarmRequestError(f"side inputs nest deeper than {MAX_DEPTH} or hold more than {MAX_NODES} values")
        if isinstance(node, _SCALARS):
            return node
        if not (isinstance(node, list) and len(node) in (2, 3)):
            raise SwarmRequestError(f"malformed side input {node!r:.80}")
        tag, body = node[:2]
        if len(node) == 3 and tag != "x":
            raise SwarmRequestError(f"malformed side input {node!r:.80}")
        if tag == "t":
            return tensor(body)
        if tag == "x" and isinstance(node, list) and len(node) == 3:
            shape = node[2]
            if not isinstance(shape, list) or not all(isinstance(n, int) and not isinstance(n, bool) for n in shape):
                raise SwarmRequestError(f"malformed expanded side input {node!r:.80}")
            try:
                return tensor(body).expand(shape)
            except RuntimeError as e:
                raise SwarmRequestError(f"side input cannot expand to {shape}: {e}") from None
        if tag in ("tuple", "list") and isinstance(body, list):
            items = [value(v, depth + 1) for v in body]
            return tuple(items) if tag == "tuple" else items
        if tag == "dict" and isinstance(body, list):
            pairs = [(k, v) for k, v in (p if isinstance(p, list) and len(p) == 2 else (None, None) for p in body)]
            if any(not isinstance(k, str) for k, _ in pairs):
                raise SwarmRequestError("side-input dict keys must be strings")
            return {k: value(v, depth + 1) for k, v in pairs}
        raise SwarmRequestError(f"malformed side input {node!r:.80}")

    if not isinstance(tree, list) or len(tree) != blocks:
        raise SwarmRequestError(f"side inputs for {blocks} blocks expected")
    calls = []
    for call in tree:
        if not (isinstance(call, list) and len(call) == 2):
            raise SwarmRequestError("each block's side inputs are [args, kwargs]")
        args, kwargs = value(call[0], 0), value(call[1], 0)
        if not isinstance(args, tuple) or not isinstance(kwargs, dict):
            raise SwarmRequestError("each block's side inputs are [args, kwargs]")
        calls.append((args, kwargs))
    return calls


def activation_of(output: Any) -> torch.Tensor:
    """The activation a block returned: the output itself, or the first element of a tuple or list."""
    return output[0] if isinstance(output, (tuple, list)) else output


def with_activation(output: Any, activation: Any) -> Any:
    """``output`` with its activation replaced (the caller gets back what the block returns)."""
    if isinstance(output, (tuple, list)):
        return type(output)([activation, *output[1:]])
    return activation


def run_blocks(blocks: Sequence[nn.Module], hidden: torch.Tensor, calls: Sequence[Call], wrap=None) -> torch.Tensor:
    """``hidden`` through ``blocks``, each called with its side inputs; ``wrap(block, *args, **kwargs)`` calls a
    block (activation checkpointing), else the block is called directly."""
    for block, (args, kwargs) in zip(blocks, calls):
        output = wrap(block, hidden, *args, **kwargs) if wrap is not None else block(hidden, *args, **kwargs)
        hidden = activation_of(output)
    return hidden


def meta_copy(module: nn.Module) -> nn.Module:
    """A copy of ``module`` whose parameters and buffers live on the meta device (no data is copied)."""
    memo: dict[int, Any] = {}
    for tensor in [*module.parameters(), *module.buffers()]:
        meta = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = nn.Parameter(meta, tensor.requires_grad) if isinstance(tensor, nn.Parameter) else meta
    return copy.deepcopy(module, memo)


def _to_meta(value: Any) -> Any:
    return pytree.tree_map(lambda t: t.to("meta") if isinstance(t, torch.Tensor) else t, value)


def _signature(value: Any) -> tuple:
    leaves, spec = pytree.tree_flatten(value)
    described = tuple(
        (tuple(leaf.shape), leaf.dtype) if isinstance(leaf, torch.Tensor) else (type(leaf).__name__, repr(leaf))
        for leaf in leaves
    )
    return str(spec), described


class MetaBlocks:
    """The pipeline's blocks on the meta device: what each block returns for given inputs, computed without data
    and cached per signature (shapes, dtypes and the other side inputs' values)."""

    def __init__(self, blocks: Sequence[nn.Module], convert: Optional[Callable[[nn.Module], nn.Module]] = None) -> None:
        """``convert``: applied to each copy (the precision plugin's ``convert_module``: the dtype of ``-true``)."""
        self.blocks = [meta_copy(block) for block in blocks]
        if convert is not None:
            self.blocks = [convert(block) for block in self.blocks]
        self._cache: dict[tuple, Any] = {}

    def __len__(self) -> int:
        return len(self.blocks)

    def output(self, block: int, hidden: torch.Tensor, args: Sequence, kwargs: dict, training: bool) -> Any:
        """What ``block`` returns for these inputs, its tensors on the meta device."""
        key = (block, training, _signature((tuple(hidden.shape), hidden.dtype, tuple(args), kwargs)))
        if key not in self._cache:
            module = self.blocks[block]
            if module.training != training:
                module.train(training)
            with torch.no_grad():
                meta = torch.empty(hidden.shape, dtype=hidden.dtype, device="meta")
                self._cache[key] = module(meta, *_to_meta(tuple(args)), **_to_meta(kwargs))
        return self._cache[key]

    def activation(
        self, first: int, hidden: torch.Tensor, calls: Sequence[Call], training: bool
    ) -> Optional[torch.Tensor]:
        """The activation blocks ``first, first + 1, ...`` return, called in turn with ``calls`` (meta)."""
        for offset, (args, kwargs) in enumerate(calls):
            hidden = activation_of(self.output(first + offset, hidden, args, kwargs, training))
        return hidden
