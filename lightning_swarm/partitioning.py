"""Partitioning: find the LightningModule's pipeline and cut it into stages of balanced cost (SWARM section 2).

The pipeline is a container of blocks at any depth of the LightningModule, named by its dotted path: an
``nn.Sequential`` (``self.blocks`` of ``examples/gpt.py``), an ``nn.ModuleList`` (LitGPT's ``transformer.h``,
transformers' ``model.layers`` and GPT-2's ``transformer.h``) or an ``nn.ModuleDict`` (torchtitan's ``layers``, whose
keys "0", "1", ... name the blocks in call order). Everything else (embeddings, head, loss) stays local to the process
that runs ``training_step``.

Found automatically (:func:`find_pipeline`), the pipeline is the container whose repeated blocks (children of a class
that occurs at least twice in it) hold the most parameters. An ``nn.ModuleList`` or ``nn.ModuleDict`` that mixes
classes and holds another container is a wrapper around the real list (LitGPT's and nanoGPT's
``transformer = ModuleDict(wte=..., h=ModuleList(...), ln_f=...)``), never the pipeline; an ``nn.Sequential`` chains
its children by construction, so any qualifies. Of tied containers nested in one another the innermost wins (the
outer one's other blocks hold no parameters); tied unrelated containers are an error: pass ``pipeline=<dotted path>``.
Either way the container must be held in one place (one attribute of one module), where the swarm puts the remote
pipeline (:func:`replace_pipeline`); a state-dict key of a stage maps to the model's with :func:`stage_state_key`.

A peer allocates only the blocks it serves: :func:`release` frees blocks (to the meta device) and :func:`materialize`
allocates them again, empty for a state to be loaded or initialised as the model initialises them
(:func:`initializer`: each module's ``reset_parameters()``, then the ``_init_weights`` of transformers' and LitGPT's
models).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence

import torch
from lightning.pytorch import LightningModule
from lightning.pytorch.core.optimizer import _init_optimizers_and_lr_schedulers
from torch import nn

from lightning_swarm.optimizer import restrict_to

CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)
Slots = dict[str, Optional[torch.Tensor]]  # a module's parameters or buffers, by name


@dataclass(frozen=True)
class StageSpan:
    """Blocks ``start`` (inclusive) to ``end`` (exclusive) of the pipeline form stage ``index``."""

    index: int
    start: int
    end: int


@dataclass(frozen=True)
class Pipeline:
    """Where the pipeline is in the LightningModule (dotted ``path``) and the ``names`` of its blocks there."""

    path: str
    names: tuple[str, ...]

    def state_key(self, span: StageSpan, key: str) -> str:
        """The LightningModule's state-dict key of a key of ``span``'s stage (see :func:`stage_state_key`)."""
        return stage_state_key(self.path, self.names, span, key)


def find_pipeline(module: nn.Module, name: Optional[str] = None) -> str:
    """The dotted path (from ``module``) of the pipeline: the container of blocks cut into stages.

    With ``name`` given, the container there must be an ``nn.Sequential``, ``nn.ModuleList`` or ``nn.ModuleDict``
    holding at least one block. Otherwise it is found automatically (see the module's docstring): of the containers
    with a class repeated among their blocks, the one whose repeated blocks hold the most parameters; of tied ones
    nested in one another, the innermost; tied unrelated ones are an error, so the choice is never a guess. Either
    way the container must be held in one place only, where the swarm replaces it.
    """
    candidates = pipeline_candidates(module)
    path = _best(module, candidates) if name is None else _checked(module, name, candidates)
    _check_held_once(module, path)
    return path


def pipeline_candidates(module: nn.Module) -> dict[str, int]:
    """Each container that could be the pipeline (dotted path) with the parameters its repeated blocks hold."""
    return {
        path: _repeated_parameters(container)
        for path, container in module.named_modules()
        if path and isinstance(container, CONTAINERS) and _is_list_of_blocks(container)
    }


def _repeated_parameters(container: nn.Module) -> int:
    """Parameters held by the blocks of ``container`` whose class occurs at least twice among them."""
    blocks = blocks_of(container)
    counts = Counter(type(b) for b in blocks)
    return sum(count_parameters(b) for b in blocks if counts[type(b)] > 1)


def _is_list_of_blocks(container: nn.Module) -> bool:
    """Whether a class repeats among the blocks of ``container`` and, unless it is an ``nn.Sequential``, it is no
    wrapper (blocks of several classes, one of them a container)."""
    blocks = blocks_of(container)
    classes = {type(b) for b in blocks}
    repeated = len(blocks) > len(classes)
    if isinstance(container, nn.Sequential):
        return repeated
    wrapper = len(classes) > 1 and any(isinstance(b, CONTAINERS) for b in blocks)
    return repeated and not wrapper


def _best(module: nn.Module, candidates: dict[str, int]) -> str:
    if not candidates:
        raise ValueError(
            f"{type(module).__name__} has no container of blocks to cut into stages (an nn.Sequential, nn.ModuleList "
            f"or nn.ModuleDict with at least two blocks of one class): define the blocks as one (e.g. "
            f"self.blocks = nn.Sequential(...)) or pass pipeline=<dotted path>"
        )
    most = max(candidates.values())
    tied = [path for path, count in candidates.items() if count == most]
    innermost = [path for path in tied if not any(other.startswith(path + ".") for other in tied)]
    if len(innermost) > 1:
        raise ValueError(
            f"Several containers of {type(module).__name__} could be the pipeline, their repeated blocks holding "
            f"{most} parameters each ({', '.join(innermost)}): pass pipeline=<dotted path>"
        )
    return innermost[0]


def _checked(module: nn.Module, path: str, candidates: dict[str, int]) -> str:
    found = _submodule(module, path)
    if found is None:
        problem = "nothing is there"
    elif not isinstance(found, CONTAINERS):
        problem = f"found a {type(found).__name__}"
    elif len(found) == 0:
        problem = f"found an empty {type(found).__name__}"
    else:
        return path
    automatic = ", ".join(candidates) or "none"
    raise ValueError(
        f"pipeline={path!r}: {problem} in {type(module).__name__}; the pipeline must be an nn.Sequential, "
        f"nn.ModuleList or nn.ModuleDict of blocks (containers found automatically: {automatic})"
    )


def _submodule(module: nn.Module, path: str) -> Optional[nn.Module]:
    if not path:
        return None
    try:
        return module.get_submodule(path)
    except AttributeError:
        return None


def _check_held_once(module: nn.Module, path: str) -> None:
    container = module.get_submodule(path)
    places = [
        _join(parent_path, name)
        for parent_path, parent in module.named_modules()
        for name, child in parent._modules.items()
        if child is container
    ]
    if len(places) > 1:
        raise ValueError(
            f"The pipeline {path!r} is also held at {', '.join(p for p in places if p != path)}: the swarm puts the "
            f"remote pipeline in one place only; keep one reference to it (e.g. a property for the others)"
        )


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def blocks_of(container: nn.Module) -> list[nn.Module]:
    """The blocks of a pipeline container in call order (a ``ModuleDict``'s in the order of its keys)."""
    return list(container._modules.values())


def block_names(container: nn.Module) -> list[str]:
    """The names of the blocks inside their container ("0", "1", ... or a ``ModuleDict``'s keys), as in its state
    dict."""
    # named_children() would skip a block held twice, which the state dict lists under both names
    return list(container._modules)


def replace_pipeline(module: nn.Module, path: str, new: nn.Module) -> nn.Module:
    """Put ``new`` at the dotted ``path`` of ``module`` (e.g. the remote pipeline in the container's place); returns
    the module that was there."""
    parent_path, _, name = path.rpartition(".")
    parent = module.get_submodule(parent_path)
    old = parent.get_submodule(name)
    setattr(parent, name, new)
    return old


def count_parameters(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def balance_by_parameters(blocks: Sequence[nn.Module], num_stages: int) -> list[StageSpan]:
    """Contiguous spans of blocks, one per stage, that minimise the largest stage's parameter count."""
    if num_stages < 1:
        raise ValueError(f"num_stages must be at least 1, got {num_stages}")
    if len(blocks) < num_stages:
        raise ValueError(f"Cannot cut a pipeline of {len(blocks)} blocks into {num_stages} stages")
    costs = [max(count_parameters(b), 1) for b in blocks]
    prefix = [0]
    for c in costs:
        prefix.append(prefix[-1] + c)
    n = len(costs)
    inf = float("inf")
    # best[s][i]: the smallest achievable max-stage cost for the first i blocks in s stages
    best = [[inf] * (n + 1) for _ in range(num_stages + 1)]
    cut = [[0] * (n + 1) for _ in range(num_stages + 1)]
    best[0][0] = 0
    for s in range(1, num_stages + 1):
        for i in range(s, n - (num_stages - s) + 1):
            for j in range(s - 1, i):
                cost = max(best[s - 1][j], prefix[i] - prefix[j])
                if cost < best[s][i]:
                    best[s][i], cut[s][i] = cost, j
    bounds, i = [], n
    for s in range(num_stages, 0, -1):
        bounds.append((cut[s][i], i))
        i = cut[s][i]
    return [StageSpan(k, start, end) for k, (start, end) in enumerate(reversed(bounds))]


def stage_module(pipeline: nn.Module, span: StageSpan) -> nn.Sequential:
    """The stage's blocks as their own ``nn.Sequential`` (sharing the pipeline's parameters)."""
    return nn.Sequential(*blocks_of(pipeline)[span.start : span.end])


def stage_state_key(pipeline_path: str, names: Sequence[str], span: StageSpan, key: str) -> str:
    """Map a stage-local state-dict key ('0.attn.weight') to the LightningModule's ('model.layers.2.attn.weight'),
    ``names`` being the pipeline's :func:`block_names`."""
    block, _, rest = key.partition(".")
    return f"{pipeline_path}.{names[span.start + int(block)]}.{rest}"


def stage_optimizer(module: LightningModule, pipeline_path: str, stage: nn.Module) -> torch.optim.Optimizer:
    """The user's optimizer (class and per-group hyper-parameters) over ``stage``'s parameters only.

    ``configure_optimizers`` runs with the stage in the pipeline's place, so that ``self.parameters()`` covers
    exactly the local modules and this stage.
    """
    pipeline = replace_pipeline(module, pipeline_path, stage)
    try:
        optimizers, _ = _init_optimizers_and_lr_schedulers(module)
    finally:
        replace_pipeline(module, pipeline_path, pipeline)
    return restrict_to(single_optimizer(optimizers), stage.parameters())


def single_optimizer(optimizers: list[torch.optim.Optimizer]) -> torch.optim.Optimizer:
    """The one optimizer ``configure_optimizers`` returned (a swarm trains with one)."""
    if len(optimizers) != 1:
        raise ValueError(f"SwarmStrategy supports one optimizer; configure_optimizers returned {len(optimizers)}")
    return optimizers[0]


def release(blocks: nn.Module) -> None:
    """Free the parameters and persistent buffers of ``blocks`` (to the meta device, keeping their shapes). The
    non-persistent buffers stay: no state dict holds them (a causal mask, a rotary cache), so none could restore
    them."""
    _reallocate(blocks, torch.device("meta"), _in_state_dict)


def materialize(blocks: nn.Module, device: torch.device, init: Optional[Callable[[nn.Module], None]] = None) -> None:
    """Allocate every tensor of ``blocks`` that is on the meta device on ``device``, uninitialised, tied tensors
    staying tied. Then, if anything was allocated and ``init`` is given (see :func:`initializer`), run it over
    ``blocks``; a tensor it left unset (still NaN in part, or, not floating-point, never written) is a
    ``ValueError`` naming its module.

    Without ``init`` the caller loads a state dict (a peer downloading its stage's state), which holds no
    non-persistent buffers: those must not be on the meta device then (:func:`release` keeps them).
    """
    if init is None:
        _check_no_meta_outside_state_dict(blocks)
    allocated = _reallocate(blocks, device, lambda module, slots, name: slots[name].is_meta)
    if init is None or not allocated:
        return
    with torch.no_grad():
        marked = _mark_unset(allocated)
        init(blocks)
    unset = [
        (path, module, name) for (path, module, name), mark in zip(allocated, marked) if _is_unset(module, name, mark)
    ]
    if unset:
        where = _some([f"{_join(path, name)} ({type(module).__name__})" for path, module, name in unset])
        classes = sorted({type(module).__name__ for _, module, _ in unset})
        raise ValueError(
            f"Initialising the blocks left {where} unset: define reset_parameters() in {', '.join(classes)} (or "
            f"initialise them in the model's _init_weights)"
        )


def initializer(root: nn.Module, path: str) -> Callable[[nn.Module], None]:
    """How the model at ``root`` initialises the blocks of its pipeline at ``path``: each submodule's
    ``reset_parameters()`` (or ``_reset_parameters()``, ``nn.MultiheadAttention``'s), as its constructor ran it, then
    ``_init_weights`` (applied to every submodule) of the nearest module along ``path`` that has one: a transformers
    ``PreTrainedModel``, a LitGPT ``GPT`` (whose ``_init_weights`` covers the linear layers only, the norms keeping
    their own), or the LightningModule itself."""
    names = path.split(".")
    along = [root.get_submodule(".".join(names[:i])) for i in range(len(names) + 1)]  # from the root down
    owner = next((m for m in reversed(along) if callable(getattr(m, "_init_weights", None))), None)

    def init(blocks: nn.Module) -> None:
        blocks.apply(_reset)
        if owner is not None:
            blocks.apply(owner._init_weights)

    return init


def _reset(module: nn.Module) -> None:
    reset = getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)
    if callable(reset):
        reset()


def _tensor_slots(blocks: nn.Module) -> Iterator[tuple[str, nn.Module, Slots, str]]:
    """(module path, module, its parameters or buffers, name) of every tensor of ``blocks``."""
    for path, module in blocks.named_modules():
        for slots in (module._parameters, module._buffers):
            for name, tensor in list(slots.items()):
                if tensor is not None:
                    yield path, module, slots, name


def _reallocate(
    blocks: nn.Module, device: torch.device, chosen: Callable[[nn.Module, Slots, str], bool]
) -> list[tuple[str, nn.Module, str]]:
    """Replace the chosen tensors of ``blocks`` by empty ones on ``device``; returns where they are."""
    moved: dict[torch.Tensor, torch.Tensor] = {}  # by identity: a tensor held by two modules stays shared
    where = []
    for path, module, slots, name in _tensor_slots(blocks):
        tensor = slots[name]
        if chosen(module, slots, name):
            if tensor not in moved:
                moved[tensor] = _empty_like(tensor, device)
            slots[name] = moved[tensor]
            where.append((path, module, name))
    return where


def _empty_like(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    empty = torch.empty_like(tensor, device=device)
    return nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty


def _in_state_dict(module: nn.Module, slots: Slots, name: str) -> bool:
    return slots is module._parameters or name not in module._non_persistent_buffers_set


def _check_no_meta_outside_state_dict(blocks: nn.Module) -> None:
    lost = [
        _join(path, name)
        for path, module, slots, name in _tensor_slots(blocks)
        if slots[name].is_meta and not _in_state_dict(module, slots, name)
    ]
    if lost:
        raise ValueError(
            f"The non-persistent buffers {_some(lost)} are on the meta device and no state dict holds them: "
            f"materialize these blocks with init=initializer(...)"
        )


def _mark_unset(where: list[tuple[str, nn.Module, str]]) -> list[tuple[torch.Tensor, int]]:
    """Fill the floating-point tensors at ``where`` with NaN; returns each tensor with its version, which an in-place
    write changes (what tells whether an init set a tensor of another dtype)."""
    marked = []
    for _, module, name in where:
        tensor = getattr(module, name)
        if tensor.is_floating_point():
            tensor.fill_(float("nan"))
        marked.append((tensor, tensor._version))
    return marked


def _is_unset(module: nn.Module, name: str, mark: tuple[torch.Tensor, int]) -> bool:
    """Whether the tensor marked by :func:`_mark_unset` was left so: NaN in it, or (not floating-point) the same
    tensor, never written."""
    tensor = getattr(module, name)
    if tensor is None:
        return False
    if tensor.is_floating_point():
        return bool(tensor.isnan().any())
    return tensor is mark[0] and tensor._version == mark[1]


def _some(items: list[str], shown: int = 3) -> str:
    more = f" and {len(items) - shown} more" if len(items) > shown else ""
    return ", ".join(items[:shown]) + more
