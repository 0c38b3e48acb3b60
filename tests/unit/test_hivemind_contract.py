"""What lightning_swarm relies on inside hivemind: the private methods its optimizer overrides, the private pipe its
node swaps, and what those overrides assume of the code around them. This is why ``hivemind==1.1.12`` is pinned
exactly (pyproject.toml): each test fails with the reason when a hivemind release changes one of them, so that the
override is re-checked before the pin moves. Cheap: signatures and source, and hivemind objects that start nothing.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import multiprocessing
import textwrap
from typing import Callable

import hivemind
import pytest
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.control import StepControl
from hivemind.averaging.matchmaking import Matchmaking, PotentialLeaders
from hivemind.dht import DHT
from hivemind.optim.grad_averager import GradientAverager
from hivemind.optim.progress_tracker import GlobalTrainingProgress, LocalTrainingProgress, ProgressTracker
from hivemind.optim.state_averager import TrainingStateAverager
from hivemind.p2p import P2P

from lightning_swarm import node, optimizer

Optimizer = hivemind.Optimizer
PIN = "re-check the override in lightning_swarm before moving the hivemind pin"


def source(function: Callable) -> str:
    return textwrap.dedent(inspect.getsource(function))


def calls_in(function: Callable) -> set[str]:
    """The dotted names ``function`` calls (``self.tracker.pause_updates``, ``super().step`` as ``super.step``)."""

    def name(node: ast.AST) -> str:
        if isinstance(node, ast.Attribute):
            return f"{name(node.value)}.{node.attr}"
        if isinstance(node, ast.Call):
            return name(node.func)
        return node.id if isinstance(node, ast.Name) else "?"

    return {name(n.func) for n in ast.walk(ast.parse(source(function))) if isinstance(n, ast.Call)}


def assigned_in(function: Callable) -> set[str]:
    """The attributes ``function`` assigns on ``self``."""
    tree = ast.parse(source(function))
    targets = [t for n in ast.walk(tree) if isinstance(n, (ast.Assign, ast.AnnAssign)) for t in _targets(n)]
    return {t.attr for t in targets if isinstance(t, ast.Attribute) and getattr(t.value, "id", None) == "self"}


def _targets(node: ast.AST) -> list[ast.AST]:
    found = node.targets if isinstance(node, ast.Assign) else [node.target]
    return [e for t in found for e in (t.elts if isinstance(t, ast.Tuple) else [t])]


def parameters(function: Callable) -> list[str]:
    """The parameter names of ``function``, ``**`` before a keywords catch-all."""
    found = inspect.signature(function).parameters.items()
    return [("**" if p.kind is p.VAR_KEYWORD else "") + name for name, p in found]


# ---- the private methods of hivemind that optimizer.py overrides ----------------------------------------------

# (hivemind's class, method, its parameters as the override takes them, what the override relies on)
OVERRIDES = [
    (ProgressTracker, "_parse_swarm_progress_data", ["self", "metadata"], "CountingProgressTracker recounts the peers"),
    (Optimizer, "_make_progress_tracker", ["self", "target_batch_size", "**kwargs"], "builds CountingProgressTracker"),
    (Optimizer, "_make_state_averager", ["self", "**kwargs"], "builds ConsistentStateAverager"),
    (Optimizer, "_update_global_epoch", ["self", "grad_scaler"], "times the wait for a background step"),
    (
        Optimizer,
        "_average_gradients_and_load_into_optimizer",
        ["self", "maybe_step_control"],
        "bounds a triggered round's matchmaking, counts failed rounds",
    ),
    (Optimizer, "_tag_along_with_zero_weight", ["self", "control"], "bounds the round it tags along with"),
    (Optimizer, "_load_averaged_gradients_into_optimizer_", ["self"], "copies all at once, onto the device"),
    (Optimizer, "_should_load_state_from_peers", ["self"], "lets a peer one epoch behind join the round"),
    (Optimizer, "_maybe_schedule_gradient_averaging", ["self"], "schedules no gradient round ahead of its trigger"),
    (Optimizer, "_maybe_schedule_state_averaging", ["self"], "averages parameters only after an incomplete round"),
    (Optimizer, "_begin_averaging_gradients", ["self", "grad_scaler"], "tells the round how many partners to expect"),
    (Optimizer, "_load_local_gradients_into_optimizer", ["self"], "steps alone on the device's mean gradient"),
    (TrainingStateAverager, "_load_local_tensors_into_averager_", ["self"], "copies all at once, waited for"),
    (TrainingStateAverager, "_apply_averaging_results_", ["self"], "copies all at once, waited for"),
]
OURS = {
    ProgressTracker: optimizer.CountingProgressTracker,
    Optimizer: optimizer.SwarmOptimizer,
    TrainingStateAverager: optimizer.ConsistentStateAverager,
}


@pytest.mark.parametrize("base, name, expected, why", OVERRIDES, ids=[f"{b.__name__}.{n}" for b, n, _, _ in OVERRIDES])
def test_each_overridden_private_method_exists_with_the_signature_the_override_has(base, name, expected, why):
    found = getattr(base, name, None)
    assert callable(found), f"hivemind {hivemind.__version__}: {base.__name__}.{name} is gone ({why}); {PIN}"
    assert parameters(found) == expected, (
        f"hivemind {hivemind.__version__}: {base.__name__}.{name}{inspect.signature(found)} is not what the override "
        f"takes ({', '.join(expected)}; it {why}); {PIN}"
    )
    ours = OURS[base]
    assert name in vars(ours), f"{ours.__name__} no longer overrides {name}: drop it from this list (and the pin's)"


def test_the_optimizer_still_calls_the_overridden_methods_where_the_overrides_expect():
    """Each override only acts if hivemind still calls it where it did: the tracker and state averager are built
    through the factory methods, step() decides downloads and epochs through them, and the epoch update averages
    gradients (synchronously, or as the state averager's trigger with delayed updates)."""
    init, step, epoch = calls_in(Optimizer.__init__), calls_in(Optimizer.step), calls_in(Optimizer._update_global_epoch)
    expected = [
        ("__init__", init, "self._make_progress_tracker"),
        ("__init__", init, "self._make_state_averager"),
        ("__init__", init, "self._make_gradient_averager"),
        ("step", step, "self._should_load_state_from_peers"),
        ("step", step, "self._update_global_epoch"),
        ("step", step, "self._maybe_schedule_gradient_averaging"),
        ("step", step, "self._maybe_schedule_state_averaging"),
        ("_update_global_epoch", epoch, "self._average_gradients_and_load_into_optimizer"),
        ("_update_global_epoch", epoch, "self._begin_averaging_gradients"),
        ("_update_global_epoch", epoch, "self.state_averager.step"),
        ("_update_global_epoch", epoch, "self.tracker.pause_updates"),
    ]
    for where, found, call in expected:
        assert call in found, f"hivemind {hivemind.__version__}: Optimizer.{where} no longer calls {call}; {PIN}"
    text = source(Optimizer._update_global_epoch)
    assert "partial(self._average_gradients_and_load_into_optimizer, self.scheduled_grads)" in text, (
        f"hivemind {hivemind.__version__}: with delayed updates the gradient round is no longer the state "
        f"averager's trigger (SwarmOptimizer counts failed background rounds from there); {PIN}"
    )
    # _update_global_epoch: SwarmOptimizer waits for the background step itself first (timed), as hivemind does
    assert (
        "if self.delay_optimizer_step:\n                    self.state_averager.step(wait_for_delayed_updates=True)"
        in (inspect.getsource(Optimizer._update_global_epoch))
    ), f"hivemind {hivemind.__version__}: _update_global_epoch no longer waits for the delayed step first; {PIN}"
    begin = calls_in(Optimizer._begin_averaging_gradients)
    assert {"self._tag_along_with_zero_weight", "self.grad_averager.step"} <= begin, (
        f"hivemind {hivemind.__version__}: _begin_averaging_gradients changed how it joins a round; {PIN}"
    )


def test_the_state_averager_hands_each_step_to_its_executor_and_waits_for_a_synchronous_one():
    """ConsistentStateAverager runs a step in the caller's thread when hivemind's step waits for all of it: that
    needs the delays among step's keywords, with hivemind's defaults (delay_averaging None: as the optimizer step),
    the step handed to ``self.step_executor`` (made in ``__init__``), and its future waited for unless delayed."""
    found = inspect.signature(TrainingStateAverager.step).parameters
    defaults = {name: found[name].default for name in ("delay_optimizer_step", "averaging_round", "delay_averaging")}
    assert defaults == {"delay_optimizer_step": False, "averaging_round": False, "delay_averaging": None}, (
        f"hivemind {hivemind.__version__}: TrainingStateAverager.step{inspect.signature(TrainingStateAverager.step)} "
        f"changed the delays ConsistentStateAverager.step reads; {PIN}"
    )
    assert "step_executor" in assigned_in(TrainingStateAverager.__init__)
    calls = calls_in(TrainingStateAverager.step)
    assert {"self.step_executor.submit", "pending_update.result"} <= calls, (
        f"hivemind {hivemind.__version__}: TrainingStateAverager.step no longer runs each step through its executor "
        f"and waits for a synchronous one; {PIN}"
    )
    assert "if delay_averaging is None:\n            delay_averaging = delay_optimizer_step" in inspect.getsource(
        TrainingStateAverager.step
    ), f"hivemind {hivemind.__version__}: step's default for delay_averaging changed; {PIN}"


def test_the_state_averager_is_built_with_the_arguments_hivemind_gives_it():
    """SwarmOptimizer._make_state_averager repeats hivemind's arguments to build ConsistentStateAverager: an argument
    hivemind adds would be silently dropped."""

    def keywords(function: Callable) -> set[str]:
        calls = [n for n in ast.walk(ast.parse(source(function))) if isinstance(n, ast.Call) and n.keywords]
        return {k.arg for k in calls[0].keywords if k.arg is not None}

    theirs, ours = keywords(Optimizer._make_state_averager), keywords(optimizer.SwarmOptimizer._make_state_averager)
    ours -= {"sync_epoch_when_averaging"}  # added on purpose: hivemind leaves it off
    assert theirs == ours, (
        f"hivemind {hivemind.__version__} builds its state averager with {sorted(theirs - ours)} more and "
        f"{sorted(ours - theirs)} fewer arguments than SwarmOptimizer._make_state_averager; {PIN}"
    )
    theirs, ours = keywords(Optimizer._make_progress_tracker), keywords(optimizer.SwarmOptimizer._make_progress_tracker)
    assert theirs == ours, f"hivemind {hivemind.__version__} builds its progress tracker differently; {PIN}"


def test_what_the_overrides_read_and_write_on_hivemind_objects_is_still_there():
    """Attributes the overrides use: set in hivemind's constructors (or properties of the class)."""
    needs = {
        Optimizer: [
            "run_id",
            "matchmaking_time",
            "tracker",
            "dht",
            "client_mode",
            "status_loglevel",
            "allreduce_timeout",
            "shutdown_timeout",
            "offload_optimizer",
            "next_chunk_timeout",
            "auxiliary",
            "delay_optimizer_step",
            "delay_grad_averaging",
            "grad_averager",
            "state_averager",
            "scheduled_grads",
            "load_state_timeout",
            "averaging_timeout",
            "local_epoch",
            "use_gradient_averaging",
        ],
        ProgressTracker: ["performance_ema", "local_progress", "dht", "target_batch_size", "global_epoch"],
        DecentralizedAverager: ["matchmaking_kwargs", "state_sharing_priority", "_outer_pipe"],
        TrainingStateAverager: ["pending_updates", "lock_optimizer", "main_parameters", "local_epoch"],
        GradientAverager: ["local_samples_accumulated", "_anchor_batch_size"],  # BoundedGradientAverager.mean_scale
    }
    for cls, names in needs.items():
        have = {n for klass in cls.__mro__ if klass.__module__.startswith("hivemind") for n in vars(klass)}
        have |= {a for klass in cls.__mro__ if "__init__" in vars(klass) for a in _assigned(klass)}
        missing = [n for n in names if n not in have]
        assert not missing, f"hivemind {hivemind.__version__}: {cls.__name__} has no {missing} any more; {PIN}"
    init = source(DecentralizedAverager.__init__)
    assert "min_matchmaking_time=" in init and "request_timeout=request_timeout" in init, (
        f"hivemind {hivemind.__version__}: matchmaking_kwargs lost min_matchmaking_time or request_timeout (the "
        f"swarm's rounds are bounded by them); {PIN}"
    )
    assert "_matchmaking" in assigned_in(DecentralizedAverager._run_internal), (  # in the averager's process
        f"hivemind {hivemind.__version__}: the averager's process no longer keeps _matchmaking; {PIN}"
    )
    for cls in (Matchmaking, PotentialLeaders):  # a round told how many partners to expect begins once they joined
        assert "target_group_size" in assigned_in(cls.__init__), (
            f"hivemind {hivemind.__version__}: {cls.__name__} no longer keeps target_group_size; {PIN}"
        )
    assert "potential_leaders" in assigned_in(Matchmaking.__init__), f"Matchmaking lost potential_leaders; {PIN}"
    for name in ("began_allreduce", "triggered", "scheduled_time", "weight", "allow_allreduce", "cancel", "done"):
        assert hasattr(StepControl, name), f"hivemind {hivemind.__version__}: StepControl.{name} is gone; {PIN}"
    for name in ("peer_id", "epoch", "samples_accumulated", "samples_per_second", "time", "client_mode"):
        assert name in LocalTrainingProgress.__fields__, f"LocalTrainingProgress lost {name}; {PIN}"
    fields = {f.name for f in dataclasses.fields(GlobalTrainingProgress)}
    assert {"num_peers", "epoch", "samples_accumulated"} <= fields, f"GlobalTrainingProgress has {fields}; {PIN}"


def _assigned(cls: type) -> set[str]:
    try:
        return assigned_in(cls.__init__)
    except (OSError, TypeError):  # a builtin's
        return set()


def test_the_bounded_rounds_still_get_what_they_bound():
    """_BoundedMatchmaking.step passes scheduled_time, timeout and require_trigger through; a gradient round (and
    a pre-scheduled one) is scheduled with require_trigger=True, which the owner bounds from its trigger on."""
    step = inspect.signature(DecentralizedAverager.step).parameters
    assert {"scheduled_time", "timeout", "require_trigger", "wait"} <= step.keys(), (
        f"hivemind {hivemind.__version__}: DecentralizedAverager.step{inspect.signature(DecentralizedAverager.step)} "
        f"no longer takes what _BoundedMatchmaking.step bounds; {PIN}"
    )
    assert "require_trigger=True" in source(GradientAverager.schedule_step), (
        f"hivemind {hivemind.__version__}: gradient rounds no longer wait for their trigger (BoundedGradientAverager "
        f"leaves such rounds to the optimizer, which bounds them once triggered); {PIN}"
    )
    assert "self.schedule_step(" in source(GradientAverager.step), (
        f"hivemind {hivemind.__version__}: GradientAverager.step no longer schedules its round; {PIN}"
    )
    assert "return" in source(DecentralizedAverager.load_state_from_peers), (
        f"hivemind {hivemind.__version__}: load_state_from_peers no longer returns what it loaded (None: nothing; "
        f"_NotesDownloads tells a downloaded state from none by it); {PIN}"
    )
    assert "get_current_state" in vars(TrainingStateAverager), (
        f"hivemind {hivemind.__version__}: TrainingStateAverager.get_current_state is gone (ConsistentStateAverager "
        f"serves a consistent state through it); {PIN}"
    )


def test_the_averagers_are_processes_that_can_start_by_fork():
    """_StartsByFork puts ForkProcess first among an averager's bases: hivemind's averagers must stay processes."""
    for cls in (GradientAverager, TrainingStateAverager):
        assert issubclass(cls, multiprocessing.process.BaseProcess), f"{cls.__name__} is no longer a process; {PIN}"
    for cls in (optimizer.BoundedGradientAverager, optimizer.ConsistentStateAverager):
        assert cls._Popen is multiprocessing.context.ForkProcess._Popen, f"{cls.__name__} would not start by fork"


def test_a_donor_declaration_is_triggered_and_stored_where_the_coalescing_expects():
    """_DeclaresCoalesced replaces the event that wakes the averager's declaration (hivemind assigns it in the
    averager's process, and sets it on a new priority and as a round averages), and relies on the declaration
    reading the priority when it is stored; BoundedGradientAverager turns sharing off through the constructor."""
    assert "self._state_updated = asyncio.Event()" in source(DecentralizedAverager._run_internal), (
        f"hivemind {hivemind.__version__}: the averager no longer makes its declaration event so (_DeclaresCoalesced); "
        f"{PIN}"
    )
    assert "self._state_updated.set()" in source(DecentralizedAverager._trigger_declare_load_state)
    declare = source(DecentralizedAverager._declare_for_download_periodically)
    assert "value=self.state_sharing_priority" in declare and "self._state_updated.wait()" in declare, (
        f"hivemind {hivemind.__version__}: a declaration no longer stores the priority as it is then; {PIN}"
    )
    assert "allow_state_sharing" in inspect.signature(DecentralizedAverager.__init__).parameters
    assert isinstance(vars(optimizer._DeclaresCoalesced)["_state_updated"], property)


def test_a_round_reads_the_declared_averagers_where_the_pacing_expects():
    """_BoundedMatchmaking paces the group key manager's reads of the declared averagers: hivemind assigns the
    averager's matchmaking in its process, which makes that manager, and a round reads through its method."""
    assert "self._matchmaking = Matchmaking(" in source(DecentralizedAverager._run_internal), (
        f"hivemind {hivemind.__version__}: the averager no longer makes its matchmaking so (_BoundedMatchmaking); {PIN}"
    )
    assert "self.group_key_manager = GroupKeyManager(" in source(Matchmaking.__init__)
    assert "key_manager.get_averagers(" in source(PotentialLeaders._update_queue_periodically)
    assert isinstance(vars(optimizer._BoundedMatchmaking)["_matchmaking"], property)


def test_the_progress_tracker_takes_start_and_its_rate_estimate_can_be_replaced():
    """CountingProgressTracker builds hivemind's tracker with start=False, then replaces performance_ema (a rate
    that never leaves zero) before starting it; hivemind's parse reads that rate."""
    assert "start" in inspect.signature(ProgressTracker.__init__).parameters
    assert "self.performance_ema" in source(ProgressTracker._parse_swarm_progress_data), (
        f"hivemind {hivemind.__version__}: the tracker no longer estimates from performance_ema (the swarm's exact "
        f"sample counting replaces it); {PIN}"
    )
    assert "performance_ema" in assigned_in(ProgressTracker.__init__)


# ---- node.py: the DHT's private request pipe ------------------------------------------------------------------------


def test_the_dht_reads_its_requests_from_the_pipe_the_node_swaps():
    """_SwarmDHT.run wraps ``self._inner_pipe`` before hivemind's run reads it: the attribute must exist on a DHT,
    run must read requests through it (not a reference taken earlier), and dispatch each by its method name, which
    is how a dropped request runs ``_drop_orphan``."""
    dht = DHT(start=False)  # starts nothing: no process, no daemon
    try:
        pipe = getattr(dht, "_inner_pipe", None)
        assert pipe is not None and callable(getattr(pipe, "recv", None)), (
            f"hivemind {hivemind.__version__}: DHT has no _inner_pipe with recv() (node.py's _OrphansDropped wraps "
            f"it); {PIN}"
        )
    finally:
        dht._outer_pipe.close()
        dht._inner_pipe.close()
    run = source(DHT.run)
    for use in ("self._inner_pipe.recv()", "self._inner_pipe.poll()", "self._inner_pipe.fileno()"):
        assert use in run, f"hivemind {hivemind.__version__}: DHT.run no longer calls {use}; {PIN}"
    assert "getattr(self, method)(*args, **kwargs)" in run, (
        f"hivemind {hivemind.__version__}: DHT.run no longer dispatches requests by method name ('_drop_orphan'); {PIN}"
    )
    assert "run" in vars(node._SwarmDHT) and inspect.iscoroutinefunction(node._SwarmDHT._drop_orphan)


def test_the_daemon_pid_is_read_where_hivemind_keeps_the_daemon():
    """node._daemon_pid reads ``P2P._child`` (the p2pd process), to kill a daemon a DHT left behind."""
    assert "_child" in assigned_in(P2P.__init__), f"hivemind {hivemind.__version__}: P2P._child is gone; {PIN}"
    assert "self._child = await asyncio.subprocess.create_subprocess_exec" in inspect.getsource(P2P), (
        f"hivemind {hivemind.__version__}: P2P._child no longer holds the daemon's process; {PIN}"
    )
