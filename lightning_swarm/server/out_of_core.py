"""Serving a stage larger than the device's memory: layer swapping, recomputation, host-side updates (KARMA).

KARMA (Wahib et al., SC 2020, arXiv 2008.11421) trains a model beyond one device's memory by keeping the layers'
parameters in host memory, copying each onto the device just before it runs while the previous one computes,
keeping only the layers' inputs and recomputing the rest in backward, and updating the parameters on the host.
:class:`OutOfCoreStage` does this for a stage's blocks:

- every block's parameters (the master copy the stage optimizer steps) live on the host, pinned on CUDA;
- :func:`plan_out_of_core` picks the blocks whose device copy stays between passes (resident, refreshed after the
  optimizer changed them) and those copied in for each pass (swapped), from a performance model of the copies and
  the compute within a device-memory budget;
- the forward runs block by block without autograd, keeping each block's input; a side CUDA stream copies the next
  block in while the current one computes;
- the backward recomputes block by block in reverse order (prefetching the block before), and copies each block's
  parameter gradients to pinned host memory as the block finishes; autograd hands them to the host parameters.

On the CPU (no separate device memory) the copies are plain synchronous copies: the schedule still runs, which is
what the CPU tests check. :func:`prepare_stage` turns a stage's blocks and the strategy's settings into the module
its server runs, resident as before or out of core.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence, Union

import torch
from torch import nn
from torch.func import functional_call

from lightning_swarm.block_calls import Call, activation_of
from lightning_swarm.partitioning import materialize
from lightning_swarm.precision import parameter_dtype

log = logging.getLogger(__name__)

BUDGET_MARGIN = 0.2  # of the device's free memory, left out of the default budget (activations, workspace)
BACKWARD_COST = 3.0  # a block's recompute and backward, in forwards (backward costs about two)
MEASURE_PASSES = 2  # training forwards timed (after a first, warm-up one) before the stage plans again


@dataclass(frozen=True)
class OutOfCorePlan:
    """Which blocks keep a device copy between passes (``resident``) and which are copied in for each pass."""

    resident: tuple[int, ...]
    swapped: tuple[int, ...]
    block_bytes: tuple[int, ...]
    budget: Optional[int]  # device bytes for the stage's parameters and gradients (None: no limit)
    device_bytes: int  # what the plan holds on the device at most: parameters and gradients
    predicted_s: Optional[float]  # one training pass (forward, then recompute and backward); None: no timings
    compute_s: Optional[float]  # the same pass's compute alone, nothing copied

    @property
    def max_blocks_on_device(self) -> int:
        """Blocks whose parameters are on the device at once, at most: the resident ones, the one computing and
        the one being copied in."""
        return len(self.resident) + min(2, len(self.swapped))

    def describe(self) -> str:
        mib = 2**20
        timing = ""
        if self.predicted_s is not None and self.compute_s:
            timing = f"; predicted {self.compute_s / self.predicted_s:.2f} of the compute-bound speed"
        budget = "no limit" if self.budget is None else f"{self.budget / mib:.0f} MiB"
        return (
            f"{len(self.resident)} of {len(self.block_bytes)} blocks resident, {len(self.swapped)} swapped "
            f"(at most {self.max_blocks_on_device} on the device, {self.device_bytes / mib:.0f} MiB of "
            f"parameters and gradients within a budget of {budget}){timing}"
        )


def device_bytes(block_bytes: Sequence[int], resident: set[int]) -> int:
    """Peak device bytes of parameters and gradients: the resident blocks, two swapped ones (computing, copied in),
    and the gradients of two blocks (computing, copied out)."""
    swapped = sorted((block_bytes[i] for i in range(len(block_bytes)) if i not in resident), reverse=True)
    largest = sorted(block_bytes, reverse=True)
    return sum(block_bytes[i] for i in resident) + sum(swapped[:2]) + sum(largest[:2])


def predict_pass_s(
    block_bytes: Sequence[int], compute_s: Sequence[float], bandwidth: float, resident: set[int]
) -> float:
    """Seconds of one training pass under the schedule :class:`OutOfCoreStage` runs: one compute stream and one copy
    stream; before block ``s`` computes, the next swapped block's copy is queued behind the compute queued so far
    (it overlaps block ``s``), and in backward each block's gradients are copied out once it computed."""
    n = len(block_bytes)
    copy_s = [b / bandwidth for b in block_bytes]
    total = 0.0
    for order, cost, grads_out in ((range(n), 1.0, False), (range(n - 1, -1, -1), BACKWARD_COST, True)):
        order = list(order)
        ready: dict[int, float] = {}
        copy_free = compute_end = 0.0
        previous_end = 0.0  # the compute queued before this step's prefetch
        for step, block in enumerate(order):
            if block not in resident and block not in ready:  # not prefetched: copied now, waited for
                copy_free = max(copy_free, previous_end) + copy_s[block]
                ready[block] = copy_free
            upcoming = next((b for b in order[step + 1 :] if b not in resident), None)
            if upcoming is not None and upcoming not in ready:
                copy_free = max(copy_free, previous_end) + copy_s[upcoming]
                ready[upcoming] = copy_free
            start = max(compute_end, ready.get(block, 0.0))
            compute_end = start + cost * compute_s[block]
            previous_end = compute_end
            if grads_out:
                copy_free = max(copy_free, compute_end) + copy_s[block]
        total += max(compute_end, copy_free)
    return total


def plan_out_of_core(
    block_bytes: Sequence[int],
    compute_s: Optional[Sequence[float]] = None,
    copy_bandwidth: Optional[float] = None,
    budget: Optional[int] = None,
) -> OutOfCorePlan:
    """Choose the resident blocks within ``budget`` (device bytes; None: no limit) by KARMA's reasoning.

    Starting from every block swapped, blocks are made resident one at a time, each time the one that shortens the
    predicted pass most per byte, while that fits the budget and shortens it at all. With per-block forward times
    ``compute_s`` and the host-device ``copy_bandwidth`` (bytes/s) measured, a swap that the compute hides costs
    nothing and its block stays swapped, leaving memory to the activations; without them every copy counts (as if
    nothing hid it), so as many blocks as fit stay resident.
    """
    n = len(block_bytes)
    if n == 0:
        raise ValueError("a stage needs at least one block")
    timed = compute_s is not None and copy_bandwidth is not None and copy_bandwidth > 0
    compute = list(compute_s) if timed else [0.0] * n
    bandwidth = float(copy_bandwidth) if timed else 1.0

    def cost(resident: set[int]) -> float:
        return predict_pass_s(block_bytes, compute, bandwidth, resident)

    resident: set[int] = set()
    if budget is not None and device_bytes(block_bytes, resident) > budget:
        need = device_bytes(block_bytes, resident)
        raise ValueError(
            f"device_memory_budget={budget} bytes cannot hold even the out-of-core window of this stage ({need} bytes: "
            f"two blocks' parameters and two blocks' gradients): give the stage fewer or smaller blocks, or more memory"
        )
    current = cost(resident)
    while len(resident) < n:
        best, best_gain = None, 0.0
        for block in sorted(set(range(n)) - resident, reverse=True):  # ties: the later block (turn of the pass)
            candidate = resident | {block}
            if budget is not None and device_bytes(block_bytes, candidate) > budget:
                continue
            gain = (current - cost(candidate)) / max(block_bytes[block], 1)
            if gain > best_gain:
                best, best_gain = block, gain
        if best is None:
            break
        resident.add(best)
        current = cost(resident)
    return OutOfCorePlan(
        resident=tuple(sorted(resident)),
        swapped=tuple(i for i in range(n) if i not in resident),
        block_bytes=tuple(block_bytes),
        budget=budget,
        device_bytes=device_bytes(block_bytes, resident),
        predicted_s=current if timed else None,
        compute_s=(1.0 + BACKWARD_COST) * sum(compute) if timed else None,
    )


def _tensor_bytes(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


class _Copies:
    """Host-device copies on a side stream (CUDA), ordered with the compute stream by events; plain synchronous
    copies on the CPU."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def to_device(self, host: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Optional[torch.cuda.Event]]:
        """Device copies of ``host`` and the event that marks them complete. They are allocated on the compute
        stream, and the copy waits for the compute queued so far: memory a finished block gave back is reused only
        once its kernels ran."""
        if self.stream is None:
            return {name: t.detach().clone() for name, t in host.items()}, None
        copies = {name: torch.empty_like(t, device=self.device) for name, t in host.items()}
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for name, t in host.items():
                copies[name].copy_(t.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(self.stream)
        return copies, done

    def to_host(self, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
        """Host copies (pinned on CUDA) of ``tensors`` once the compute queued so far produced them; complete after
        :meth:`synchronize`."""
        if self.stream is None:
            return [t.clone() for t in tensors]
        copies = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for host, t in zip(copies, tensors):
                host.copy_(t, non_blocking=True)
                t.record_stream(self.stream)  # not reused by the compute stream before this copy read it
        return copies

    def wait(self, event: Optional[torch.cuda.Event]) -> None:
        """Make the compute stream wait for the copies ``event`` marks."""
        if event is not None:
            torch.cuda.current_stream(self.device).wait_event(event)

    def synchronize(self) -> None:
        """Wait for the copies queued (the host tensors they read or write are free to change or be read)."""
        if self.stream is not None:
            self.stream.synchronize()


class _Window:
    """The device copies one pass over ``order`` (block indices) uses: resident blocks from the stage's cache
    (copied in when missing or stale), swapped ones copied in one step ahead and dropped after their step."""

    def __init__(self, stage: OutOfCoreStage, order: Sequence[int]) -> None:
        self.stage, self.order = stage, list(order)
        self.held: dict[int, tuple[dict[str, torch.Tensor], Optional[torch.cuda.Event]]] = {}
        # the host tensors change between passes only (the optimizer steps on the same thread): checked once
        self.current = {block for block in stage._cached if stage._cached_copy(block)}

    def acquire(self, step: int) -> dict[str, torch.Tensor]:
        """Block ``order[step]``'s device tensors, ready for the compute stream; the next block that needs a copy is
        queued behind them so that it arrives while this one computes."""
        block = self.order[step]
        tensors, done = self._fetch(block)
        upcoming = next((b for b in self.order[step + 1 :] if b not in self.current), None)
        if upcoming is not None and upcoming not in self.held:  # one block ahead at most
            self._fetch(upcoming)
        self.stage._copies.wait(done)
        return tensors

    def release(self, step: int) -> None:
        """Block ``order[step]`` computed: a swapped block's copy goes (its memory is reused by later allocations
        on the compute stream, which run after its kernels)."""
        if self.held.pop(self.order[step], None) is not None:
            self.stage._count(-1)

    def close(self) -> None:
        for block in list(self.held):
            del self.held[block]
            self.stage._count(-1)
        self.stage._copies.synchronize()

    def _fetch(self, block: int) -> tuple[dict[str, torch.Tensor], Optional[torch.cuda.Event]]:
        stage = self.stage
        if block in self.held:
            return self.held[block]
        cached = stage._cached.get(block)
        if block in self.current:
            return cached[1], cached[2]
        with torch.no_grad():
            tensors, done = stage._copies.to_device(stage._host[block])
        stage.copied_bytes += stage.plan.block_bytes[block]
        if block in stage._resident:
            if cached is None:
                stage._count(+1)
            stage._cached[block] = (stage._signature(block), tensors, done)
            self.current.add(block)
        else:
            self.held[block] = (tensors, done)
            stage._count(+1)
        return tensors, done


class _SwappedPass(torch.autograd.Function):
    """The stage's training forward as one autograd node: its backward recomputes and differentiates the blocks in
    reverse and returns the parameters' gradients on the host."""

    @staticmethod
    def forward(
        ctx: Any, stage: OutOfCoreStage, inputs: torch.Tensor, calls: list[Call], *params: torch.Tensor
    ) -> torch.Tensor:
        ctx.stage, ctx.calls = stage, calls
        ctx.autocast = _autocast_state(stage.device)
        outputs, block_inputs, ctx.rng = stage._forward_pass(inputs, keep=True, calls=calls)
        ctx.save_for_backward(*block_inputs)
        return outputs

    @staticmethod
    def backward(ctx: Any, grad_outputs: torch.Tensor) -> tuple[Optional[torch.Tensor], ...]:
        stage = ctx.stage
        grad_inputs, grads = stage._backward_pass(
            list(ctx.saved_tensors), grad_outputs, ctx.rng, ctx.autocast, ctx.needs_input_grad[1], ctx.calls
        )
        return (None, grad_inputs, None, *(grads.get(id(p)) for p in stage._params))


def _autocast_state(device: torch.device) -> tuple[bool, torch.dtype, bool]:
    kind = device.type
    return torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind), torch.is_autocast_cache_enabled()


class OutOfCoreStage(nn.Module):
    """A stage's blocks served out of core on ``device`` (see the module's docstring), following ``plan``.

    Its state dict, parameters and their ``.grad`` are those of the blocks (on the host), with the same keys as the
    resident stage. ``blocks_on_device`` counts the blocks with parameters on the device now, and
    ``peak_blocks_on_device`` its highest value; ``copied_bytes`` the bytes copied either way.

    With the host-device ``copy_bandwidth`` (bytes/s) given, the stage times its blocks' compute in
    ``measure_passes`` training forwards (after a first one, which warms up), then plans again with those timings
    (:meth:`replan`): a plan made before any input was seen knows only the blocks' sizes.
    """

    def __init__(
        self,
        blocks: Sequence[nn.Module],
        device: torch.device,
        plan: OutOfCorePlan,
        copy_bandwidth: Optional[float] = None,
        measure_passes: int = MEASURE_PASSES,
    ) -> None:
        super().__init__()
        for index, block in enumerate(blocks):
            self.add_module(str(index), block)
        self.device, self.plan = device, plan
        self._resident = set(plan.resident)
        self._blocks = list(blocks)
        owners: dict[int, int] = {}
        for index, block in enumerate(self._blocks):
            for p in block.parameters():
                if owners.setdefault(id(p), index) != index:
                    raise ValueError(f"blocks {owners[id(p)]} and {index} share a parameter: they cannot swap apart")
        if device.type == "cuda":  # pinned: copies run asynchronously, overlapping compute
            with torch.no_grad():
                for t in [*self.parameters(), *self.buffers()]:
                    if not t.is_pinned():
                        t.data = t.data.pin_memory()
        self._host = [dict([*b.named_parameters(), *b.named_buffers()]) for b in self._blocks]
        self._params = [p for p in self.parameters()]
        self._copies = _Copies(device)
        self._cached: dict[int, tuple[tuple, dict[str, torch.Tensor], Optional[torch.cuda.Event]]] = {}
        self.blocks_on_device = self.peak_blocks_on_device = 0
        self.copied_bytes = 0
        self.copy_bandwidth = copy_bandwidth
        self._measure_passes = measure_passes
        self._unmeasured = measure_passes + 1 if copy_bandwidth else 0  # training forwards until the stage replans
        self._events: list[tuple[int, Any, Any]] = []  # (block, start, end) of each forward compute, when profiled

    def _apply(self, fn: Callable, recurse: bool = True) -> OutOfCoreStage:
        """``.to()`` and the like change the host tensors: the device copies of the old ones go."""
        self.blocks_on_device -= len(self._cached)
        self._cached.clear()
        return super()._apply(fn, recurse)

    def forward(self, inputs: torch.Tensor, calls: Optional[list[Call]] = None) -> torch.Tensor:
        """The blocks in turn, each called with the activation and its side inputs in ``calls`` (None: none)."""
        calls = [((), {})] * len(self._blocks) if calls is None else calls
        if torch.is_grad_enabled() and (inputs.requires_grad or any(p.requires_grad for p in self._params)):
            return _SwappedPass.apply(self, inputs, calls, *self._params)
        with torch.no_grad():
            return self._forward_pass(inputs, keep=False, calls=calls)[0]

    def _forward_pass(self, hidden: torch.Tensor, keep: bool, calls: list[Call]) -> tuple[torch.Tensor, list, list]:
        """The blocks in order without autograd; with ``keep`` (training), each block's input and random state too."""
        window, block_inputs, rng = _Window(self, range(len(self._blocks))), [], []
        timed = keep and 0 < self._unmeasured <= self._measure_passes  # the first training forward warms up
        try:
            for step, block in enumerate(window.order):
                tensors = window.acquire(step)
                if keep:
                    block_inputs.append(hidden)
                    rng.append(self._rng_state())
                with self._timed(block) if timed else contextlib.nullcontext():
                    args, kwargs = calls[block]
                    hidden = activation_of(functional_call(self._blocks[block], tensors, (hidden, *args), kwargs))
                if self.training and any(True for _ in self._blocks[block].buffers()):
                    self._write_back_buffers(block, tensors)
                window.release(step)
        finally:
            window.close()
        if keep and self._unmeasured:
            self._unmeasured -= 1
            if not self._unmeasured:
                self.replan(self.plan.budget, self.copy_bandwidth)
        return hidden, block_inputs, rng

    def _backward_pass(
        self,
        block_inputs: list[torch.Tensor],
        grad: torch.Tensor,
        rng: list,
        autocast: tuple,
        input_grad: bool,
        calls: list[Call],
    ) -> tuple[Optional[torch.Tensor], dict[int, torch.Tensor]]:
        """Recompute and differentiate the blocks in reverse; the input's gradient and the parameters' (host) ones
        by ``id``. Unused parameters get zeros, as the resident stage server gives them."""
        enabled, dtype, cache = autocast
        window, grads = _Window(self, range(len(self._blocks) - 1, -1, -1)), {}
        try:
            for step, block in enumerate(window.order):
                tensors = window.acquire(step)
                params = dict(self._blocks[block].named_parameters())
                trained = [n for n in params if params[n].requires_grad]
                leaves = {n: t.detach().requires_grad_(n in trained) for n, t in tensors.items()}
                wants_input = block > 0 or input_grad
                hidden = block_inputs[block].detach().requires_grad_(wants_input)
                with (
                    torch.enable_grad(),
                    self._restored_rng(rng[block]),
                    torch.autocast(self.device.type, dtype=dtype, enabled=enabled, cache_enabled=cache),
                ):
                    args, kwargs = calls[block]
                    outputs = activation_of(functional_call(self._blocks[block], leaves, (hidden, *args), kwargs))
                wanted = ([hidden] if wants_input else []) + [leaves[n] for n in trained]
                found = torch.autograd.grad(outputs, wanted, grad, allow_unused=True) if wanted else ()
                grad = found[0] if wants_input else None
                found = found[int(wants_input) :]
                device_grads = [torch.zeros_like(leaves[n]) if g is None else g for n, g in zip(trained, found)]
                self.copied_bytes += _tensor_bytes(device_grads)
                for n, host in zip(trained, self._copies.to_host(device_grads)):
                    grads[id(params[n])] = host
                del outputs, found, device_grads, leaves, tensors
                window.release(step)
        finally:
            window.close()
        return grad, grads

    # ---- helpers --------------------------------------------------------------------------------------------------

    def _cached_copy(self, block: int) -> bool:
        """Whether a current copy of resident ``block`` is on the device."""
        cached = self._cached.get(block)
        return cached is not None and cached[0] == self._signature(block)

    def _signature(self, block: int) -> tuple:
        """Changes whenever a host tensor of ``block`` changes (in place, or replaced): a resident copy is stale."""
        return tuple((t.data_ptr(), t._version) for t in self._host[block].values())

    def _count(self, change: int) -> None:
        self.blocks_on_device += change
        self.peak_blocks_on_device = max(self.peak_blocks_on_device, self.blocks_on_device)

    def _write_back_buffers(self, block: int, tensors: dict[str, torch.Tensor]) -> None:
        """A training forward updated the block's buffers (e.g. running statistics) on the device copy."""
        with torch.no_grad():
            for name, buffer in self._blocks[block].named_buffers():
                buffer.copy_(tensors[name])

    def _rng_state(self) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        cuda = torch.cuda.get_rng_state(self.device) if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda

    @contextlib.contextmanager
    def _restored_rng(self, state: tuple[torch.Tensor, Optional[torch.Tensor]]):
        """The random state the block's forward ran with (its dropout draws the same), the caller's kept."""
        cpu, cuda = state
        devices = [self.device] if cuda is not None else []
        with torch.random.fork_rng(devices=devices, device_type=self.device.type):
            torch.set_rng_state(cpu)
            if cuda is not None:
                torch.cuda.set_rng_state(cuda, self.device)
            yield

    @contextlib.contextmanager
    def _timed(self, block: int):
        if self.device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            yield
            end.record()
        else:
            start = time.perf_counter()
            yield
            end = time.perf_counter()
        self._events.append((block, start, end))

    def timings(self) -> list[float]:
        """Mean forward seconds of each block over the timed passes (0 for a block never timed)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        totals, counts = [0.0] * len(self._blocks), [0] * len(self._blocks)
        for block, start, end in self._events:
            elapsed = start.elapsed_time(end) / 1000 if self.device.type == "cuda" else end - start
            totals[block] += elapsed
            counts[block] += 1
        return [t / c if c else 0.0 for t, c in zip(totals, counts)]

    def replan(self, budget: Optional[int], bandwidth: float) -> OutOfCorePlan:
        """Plan again from the forward times profiled so far and ``bandwidth``; resident copies no longer planned
        go at once."""
        self.plan = plan_out_of_core(self.plan.block_bytes, self.timings(), bandwidth, budget)
        self._events.clear()
        self._resident = set(self.plan.resident)
        for block in [b for b in self._cached if b not in self._resident]:
            del self._cached[block]
            self._count(-1)
        log.warning("Out-of-core stage planned again from measured timings: %s", self.plan.describe())
        return self.plan


def measure_copy_bandwidth(device: torch.device, nbytes: int = 64 * 2**20) -> Optional[float]:
    """Bytes/s of pinned host-to-device copies on ``device`` (CUDA; None elsewhere)."""
    if device.type != "cuda":
        return None
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    target.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(3):
        target.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 3 * nbytes / (time.perf_counter() - start)


def default_budget(device: torch.device) -> Optional[int]:
    """What the device has free now, less a margin for activations and workspace (None on the CPU: no limit)."""
    if device.type != "cuda":
        return None
    free, _ = torch.cuda.mem_get_info(device)
    return int(free * (1 - BUDGET_MARGIN))


def block_bytes(blocks: Sequence[nn.Module], dtype: Optional[torch.dtype] = None) -> list[int]:
    """Bytes of each block's parameters and buffers, floating-point ones counted in ``dtype`` if given (meta
    tensors count as what they will hold)."""
    sizes = []
    for block in blocks:
        total = 0
        for t in [*block.parameters(), *block.buffers()]:
            itemsize = dtype.itemsize if dtype is not None and t.is_floating_point() else t.element_size()
            total += t.numel() * itemsize
        sizes.append(total)
    return sizes


OutOfCore = Union[bool, str]


def check_out_of_core(value: Union[bool, str]) -> OutOfCore:
    """``value`` as True, False or ``"auto"`` (also from the environment's words: true/false, 1/0, yes/no, on/off)."""
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word == "auto":
        return "auto"
    if word in ("1", "true", "yes", "on"):
        return True
    if word in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"out_of_core={value!r}: choose True, False or 'auto'")


def prepare_stage(
    blocks: nn.Sequential,
    device: torch.device,
    convert: Callable[[nn.Module], nn.Module],
    precision: str,
    out_of_core: OutOfCore = "auto",
    budget: Optional[int] = None,
    init: Optional[Callable[[nn.Module], None]] = None,
) -> nn.Module:
    """The module a stage server runs: ``blocks`` materialised (if on the meta device: allocated, then initialised by
    ``init``, see :func:`~lightning_swarm.partitioning.materialize`) and converted by ``convert``
    (the precision plugin's, to ``precision``), on ``device`` as they are, or an :class:`OutOfCoreStage` whose
    parameters stay on the host.

    ``out_of_core``: True always, False never, ``"auto"`` when the stage's parameters and gradients exceed
    ``budget`` (bytes of device memory; None: the device's free memory less a margin, no limit on the CPU).
    """
    if budget is None:
        budget = default_budget(device)
    sizes = block_bytes(blocks, parameter_dtype(precision))
    if out_of_core == "auto":
        out_of_core = budget is not None and 2 * sum(sizes) > budget
    if not out_of_core:
        materialize(blocks, device, init)
        return convert(blocks).to(device)
    host = torch.device("cpu")
    materialize(blocks, host, init)
    blocks = convert(blocks).to(host)
    bandwidth = measure_copy_bandwidth(device)
    plan = plan_out_of_core(block_bytes(blocks), None, bandwidth, budget)
    log.warning("Serving the stage out of core: %s", plan.describe())
    return OutOfCoreStage(list(blocks), device, plan, copy_bandwidth=bandwidth)


def spare_bytes(module: nn.Module) -> Optional[int]:
    """Device memory an out-of-core stage's plan leaves to kept activations (None for a resident stage)."""
    if not isinstance(module, OutOfCoreStage) or module.plan.budget is None:
        return None
    return max(0, module.plan.budget - module.plan.device_bytes) // 2
