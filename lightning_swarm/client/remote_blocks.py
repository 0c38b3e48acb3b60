"""Stand-ins for the pipeline's blocks, so that the model's own loop drives the swarm.

The container of blocks (an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``) is replaced by one of the same
type holding a :class:`RemoteBlock` per block: the model indexes, slices and iterates it as before, reads the blocks'
attributes (``layer.attention_type``, from a copy on the meta device) and calls them with its side inputs.

A call returns at once: the blocks' copies on the meta device say what it returns, and the activation in it is a
:class:`DeferredActivation` of that shape, recorded in a :class:`Trace`. Calls that feed one block's activation to
the next extend the trace; the blocks run on the swarm, as one segment whose microbatches flow through all stages
at once (:class:`~lightning_swarm.client.remote_pipeline.RemotePipeline`), when the last block of the pipeline is
called or when anything reads a deferred activation (``self.norm(x)``, ``x.sum()``, printing it). Code between two
block calls that reads the activation where a stage ends therefore gets its value (the blocks up to there run
first); a read inside a stage, whose blocks run together on one peer, and a read of an activation that the swarm
never returned (one held from the middle of a segment that ran past it, as ``output_hidden_states=True`` collects)
raise an error that says so.
"""

from __future__ import annotations

import functools
from typing import Any, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from lightning_swarm import block_calls
from lightning_swarm.block_calls import Call, MetaBlocks
from lightning_swarm.client.remote_pipeline import RemotePipeline, Segment

_METADATA = {
    torch.Tensor.shape.__get__,
    torch.Tensor.size,
    torch.Tensor.dim,
    torch.Tensor.ndim.__get__,
    torch.Tensor.dtype.__get__,
    torch.Tensor.is_floating_point,
    torch.Tensor.is_complex,
}


class Trace:
    """Consecutive block calls whose activations are deferred: blocks ``first ... first + len(calls) - 1``. Blocks
    before ``done`` ran; ``source`` is the activation entering block ``done``."""

    def __init__(self, pipeline: RemotePipeline, source: torch.Tensor, first: int, training: bool) -> None:
        self.pipeline, self.source, self.first, self.training = pipeline, source, first, training
        self.calls: list[Call] = []
        self.outputs: list[torch.Tensor] = []  # each call's activation, on the meta device
        self.done = first
        self.values: dict[int, torch.Tensor] = {}  # block -> its activation, for the blocks a segment ended at

    @property
    def head(self) -> int:
        """The last block called."""
        return self.first + len(self.calls) - 1

    def add(self, call: Call, output: torch.Tensor) -> None:
        self.calls.append(call)
        self.outputs.append(output)

    def run(self, upto: int) -> None:
        """Run the blocks not run yet, up to ``upto``, on the swarm."""
        if upto < self.done:
            return
        if upto + 1 not in self.pipeline.boundaries:
            raise RuntimeError(
                f"The activation after block {upto} was read, but the block is inside a stage (stages start at blocks "
                f"{sorted(self.pipeline.boundaries)[:-1]}), whose blocks run together on one peer. Read activations "
                f"only where a stage ends, or leave them unread"
            )
        begin, end = self.done - self.first, upto - self.first + 1
        segment = Segment(self.done, self.calls[begin:end], self.outputs[begin:end], self.training)
        self.source = self.values[upto] = self.pipeline.run(self.source, segment)
        self.done = upto + 1

    def value(self, block: int) -> torch.Tensor:
        """The activation after ``block``, running the blocks up to it if they have not run."""
        self.run(block)
        if block not in self.values:
            raise RuntimeError(
                f"The activation after block {block} was computed inside the swarm, in a segment that ran on to block "
                f"{max(self.values)}, and never came back. Read an activation before the next block is called (the "
                f"blocks up to it run then), or leave it unread (output_hidden_states=True is not supported)"
            )
        return self.values[block]


class DeferredActivation(torch.Tensor):
    """The activation after block ``block`` of ``trace``, before it is computed: its shape and dtype are known, any
    other use computes it (:meth:`Trace.value`) and proceeds with the value."""

    trace: Trace
    block: int

    @staticmethod
    def __new__(cls, meta: torch.Tensor, trace: Trace, block: int) -> DeferredActivation:
        deferred = torch.Tensor._make_subclass(cls, meta)
        deferred.trace, deferred.block = trace, block
        return deferred

    def __repr__(self) -> str:
        return repr(resolve(self))

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.Tensor.device.__get__:
            return args[0].trace.source.device
        if func in _METADATA:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        args, kwargs = pytree.tree_map(resolve, (args, kwargs))
        return func(*args, **kwargs)


def resolve(value: Any) -> Any:
    """``value``, or the activation it defers."""
    return value.trace.value(value.block) if isinstance(value, DeferredActivation) else value


class Tracer:
    """Records the calls of a pipeline's stand-in blocks and runs them on the swarm (see the module docstring)."""

    def __init__(self, pipeline: RemotePipeline, meta: MetaBlocks) -> None:
        self.pipeline, self.meta = pipeline, meta

    def call(self, block: int, hidden: Any, args: tuple, kwargs: dict, training: bool) -> Any:
        args, kwargs = pytree.tree_map(resolve, (args, kwargs))
        block_calls.check_call(block, args, kwargs)
        trace = self._trace_for(block, hidden, training)
        output = self.meta.output(block, hidden, args, kwargs, training)
        activation = block_calls.activation_of(output)
        if isinstance(output, (tuple, list)) and any(extra is not None for extra in output[1:]):
            raise block_calls.SideInputError(
                f"block {block} returns {len(output)} values: only its activation comes back from the swarm. Turn "
                f"off its other outputs (output_attentions=False, use_cache=False)"
            )
        if not isinstance(activation, torch.Tensor):
            raise TypeError(f"block {block} returned {type(activation).__name__}: a pipeline's blocks return a tensor")
        trace.add((args, kwargs), activation)
        deferred = DeferredActivation(activation, trace, block)
        if block == len(self.meta) - 1:  # nothing follows in the pipeline: run now
            return block_calls.with_activation(output, trace.value(block))
        return block_calls.with_activation(output, deferred)

    def _trace_for(self, block: int, hidden: Any, training: bool) -> Trace:
        """The trace this call extends: the one whose last call returned ``hidden``, if this is the next block in
        the same mode; else a new one from ``hidden``'s value."""
        if isinstance(hidden, DeferredActivation):
            trace = hidden.trace
            if trace.head == hidden.block and block == hidden.block + 1 and trace.training == training:
                return trace
        source = resolve(hidden)
        if not isinstance(source, torch.Tensor):
            raise TypeError(
                f"block {block} was called with a {type(source).__name__} first: a pipeline's blocks take the "
                f"activation tensor as their first argument"
            )
        if block not in self.pipeline.boundaries:
            raise RuntimeError(
                f"Block {block} was called on a new activation, but it is inside a stage (stages start at blocks "
                f"{sorted(self.pipeline.boundaries)[:-1]}): the model must call the blocks of a stage in turn, each "
                f"on the activation the one before returned"
            )
        return Trace(self.pipeline, source, block, training)


class RemoteBlock(nn.Module):
    """Stands in for block ``index`` of the pipeline: calls go to the swarm through the tracer; attributes are read
    from the block's copy on the meta device. Each stand-in is also an instance of its block's class
    (:func:`stand_in`), so that code finding blocks by class (hooks that record outputs, wrapping policies) finds
    the stand-ins; the block's own ``__init__`` and ``forward`` never run on them."""

    def __init__(self, index: int, tracer: Tracer) -> None:
        nn.Module.__init__(self)
        self.index = index
        self.__dict__["_tracer"] = tracer  # not a submodule: the stand-ins hold no parameters

    def forward(self, hidden: Any, *args: Any, **kwargs: Any) -> Any:
        return self._tracer.call(self.index, hidden, args, kwargs, self.training)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            tracer: Optional[Tracer] = self.__dict__.get("_tracer")
            if tracer is None:
                raise
            return getattr(tracer.meta.blocks[self.index], name)

    def extra_repr(self) -> str:
        return f"{self.index}: {type(self._tracer.meta.blocks[self.index]).__name__} on the swarm"


def stand_in(container: nn.Module, names: list[str], pipeline: RemotePipeline, meta: MetaBlocks) -> nn.Module:
    """A container of the same type as the pipeline's (``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``,
    with the same names) holding a :class:`RemoteBlock` for each of its blocks."""
    tracer = Tracer(pipeline, meta)
    blocks = [_stand_in_class(type(block))(i, tracer) for i, block in enumerate(meta.blocks)]
    if isinstance(container, nn.ModuleDict):
        remote: nn.Module = nn.ModuleDict(dict(zip(names, blocks)))
    elif isinstance(container, nn.ModuleList):
        remote = nn.ModuleList(blocks)
    else:
        remote = nn.Sequential()
        for name, block in zip(names, blocks):
            remote.add_module(name, block)
    remote.__dict__["remote_pipeline"] = pipeline  # for the strategy's teardown; not a submodule
    return remote


@functools.cache
def _stand_in_class(block_class: type) -> type:
    """A :class:`RemoteBlock` that is also a ``block_class``, for stand-ins of that class's blocks."""
    if issubclass(RemoteBlock, block_class):
        return RemoteBlock
    return type(f"Remote{block_class.__name__}", (RemoteBlock, block_class), {"__module__": __name__})
