"""A failure between two of Megatron's iterations: in ``training_log`` (its interval barrier, the timers'
all-gathers), in a checkpoint save, or anywhere after ``train_step`` returned.

Inside ``train_step`` a peer's failure is caught by the step itself (``MegatronRank.megatron_train_step``)
and the step is redone. Outside it, Megatron's own loop runs collectives over the world, and a dead peer
makes them raise in code that is not ours: each guarded function below turns that into the same recovery
(register, tear down, enter the agent's next generation) and then runs the call again, in the new layout,
from the state it began in, and says so on stderr:

- ``training_log``: its loss totals are put back, so the iteration is logged once, as stock Megatron would (and
  it runs with the live world's size, :func:`live_world_size`; a rank that joined the running job logs its first
  iteration as the job's steady state, not as ``train()``'s first);
- but only when every survivor was in the call: a rank that lagged in it while the others had gone on to
  the next iteration (a collective that completed for some ranks before the failure reached them) does not
  run it again, since its collectives would wait for them (its log line, if it is the logging rank, is lost; a
  failure nobody chose can land so, the planner's drop of a slow node does not: ``runtime.drop_gate``);
- a save (``save_checkpoint_and_time`` and ``save_checkpoint``, also the final one): Megatron marks a
  checkpoint as the latest only after every rank finished writing it (rank 0, after the save's closing
  collective), so an interrupted save is never marked; the survivors write it again. Inside
  ``save_checkpoint_and_time`` the whole of it is redone, not only its ``save_checkpoint``: from 0.19 on it
  passes the process groups it reads off the model (``pg_collection``), and a redo with the arguments of the
  first attempt would save over groups that died with the old world;
- the exit check (``checkpoint_and_decide_exit``, after every iteration): with ``--exit-signal-handler`` it
  gathers every rank's SIGTERM flag over the world, with ``--exit-duration-in-mins`` it all-reduces the elapsed
  time; a failure there is recovered from and the check run again (the flags and the clock are where they were;
  a save it makes is guarded as above); once it decided to exit, the world barrier ``train()`` passes before
  ``sys.exit`` (0.18+) is guarded too, so that the survivors still leave with the job's exit code;
- with ``--log-energy``, the energy monitor's closing lap and total (:mod:`.energy`);
- a timer's barrier outside those calls (``train()`` starts and stops the ``eval-time`` and ``interval-time``
  timers with ``barrier=True`` around an evaluation): recovered from, and the barrier passed in the new layout;
- the parameter norm (``--log-params-norm``): computed over the plan, with one all-reduce over the world;
- ``--adlr-autoresume``'s check (a world barrier every ``--adlr-autoresume-interval`` iterations): run again;
- ``print_datetime``'s world barrier once ``train()`` has returned, before the final save and validation: passed
  again in the new layout, so that the survivors still write the final checkpoint;
- with --overlap-param-gather, generation 0's forced weight all-gather before an evaluation and at ``train()``'s
  end (``disable_forward_pre_hook``): recovered from.

Megatron's timers are put back as they were when the guarded call began (a timer a failure left started
or stopped would assert at its next use).
"""
from __future__ import annotations

import contextlib
import functools
import sys
from typing import Any, Callable, Iterator

from .hooks import STATE


def _megatron_timers() -> dict[str, Any]:
    """Megatron's timers by name; none when they are not set up (tests of the guard alone)."""
    try:
        from megatron.training.global_vars import get_timers

        return getattr(get_timers(), "_timers", {})
    except Exception:
        return {}


def _timer_states() -> dict[str, tuple[bool, float]]:
    return {name: (t._started, t._start_time) for name, t in _megatron_timers().items() if hasattr(t, "_started")}


def _restore_timers(states: dict[str, tuple[bool, float]]) -> None:
    for name, timer in _megatron_timers().items():
        if hasattr(timer, "_started"):
            timer._started, timer._start_time = states.get(name, (False, timer._start_time))


def _say(runtime: Any, text: str) -> None:
    print(f"[odyssey rank {runtime.ident}] {text}", file=sys.stderr, flush=True)


def guarded(phase: str, what: str, keep: Callable[..., Callable[[], None]] | None = None,
            prepare: Callable[..., None] | None = None, at_rest: bool = True, redone_by: str | None = None
            ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Wrap a Megatron function that runs between iterations: fault injection point ``phase``, at rest (not
    judged by progress; ``at_rest=False``: the call marks its own progress and injection points); a peer's
    failure inside it is recovered from, then the call is redone from the state it began in (Megatron's
    timers, and what ``keep(*args, **kwargs)`` saves and its returned callable puts back);
    ``prepare(runtime, *args, **kwargs)`` runs before every attempt. Called inside the guarded function named
    ``redone_by``, a failure is left to that one, which redoes itself and so computes this call's arguments
    again."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            runtime = STATE.runtime
            if runtime is None:
                return original(*args, **kwargs)
            _ACTIVE.append(original.__name__)
            try:
                if redone_by in _ACTIVE[:-1]:
                    return _attempt(runtime, *args, **kwargs)
                return _attempts(runtime, *args, **kwargs)
            finally:
                _ACTIVE.pop()

        def _attempt(runtime: Any, *args: Any, **kwargs: Any) -> Any:
            if at_rest:
                runtime.at_between_steps(phase)
            if prepare is not None:
                prepare(runtime, *args, **kwargs)
            return original(*args, **kwargs)

        def _attempts(runtime: Any, *args: Any, **kwargs: Any) -> Any:
            while True:
                timers = _timer_states()
                restore = keep(*args, **kwargs) if keep is not None else None
                try:
                    return _attempt(runtime, *args, **kwargs)
                except Exception as exc:
                    redo = runtime.recover_outside_step(exc, f"{what} after iteration {runtime.committed + 1}")
                    _restore_timers(timers)
                    if restore is not None:
                        restore()
                    if not redo:
                        _say(runtime, f"{what} of iteration {runtime.committed + 1} was interrupted by a failure after "
                                      f"other survivors had left it; not run again (its collectives would wait "
                                      f"for them)")
                        return None
                    _say(runtime, f"{what} of iteration {runtime.committed + 1} was interrupted by a failure; the "
                                  f"survivors run it again in the new layout")

        return wrapper

    return wrap


#: the guarded calls in progress on this rank, outermost first (their Megatron names): a timer's barrier inside
#: one is left to it (it redoes the whole call)
_ACTIVE: list[str] = []


def outside_guarded_calls() -> bool:
    return not _ACTIVE


def _keep_log_totals(*args: Any, **kwargs: Any) -> Callable[[], None]:
    """``training_log`` adds the iteration's losses into ``total_loss_dict`` (its 2nd argument) before its
    barrier, and with ``--log-energy`` advances the energy monitor's counters: put both back so the redone call
    counts the iteration once."""
    from .energy import monitor_counters

    restore_energy = monitor_counters()
    totals = kwargs.get("total_loss_dict", args[1] if len(args) > 1 else None)
    saved = {k: (v.clone() if hasattr(v, "clone") else v) for k, v in totals.items()} if isinstance(totals, dict) \
        else None

    def restore() -> None:
        restore_energy()
        if saved is not None:
            totals.clear()
            totals.update(saved)

    return restore


def _keep_energy(*args: Any, **kwargs: Any) -> Callable[[], None]:
    """``save_checkpoint_and_time`` pauses the energy monitor (adds the interval's energy to its lap) before
    the save: put the counters back so the redone call adds it once."""
    from .energy import monitor_counters

    return monitor_counters()


def _fresh_strategies(runtime: Any, *args: Any, **kwargs: Any) -> None:
    """``save_checkpoint`` keeps its save (and load) strategy in ``checkpointing_context`` (6th argument)
    from one save to the next, with the process groups of the world it was made in: made before a recovery,
    its groups are gone. Forget it whenever the generation changed since it was made."""
    context = kwargs.get("checkpointing_context", args[5] if len(args) > 5 else None)
    if isinstance(context, dict) and context.get("odyssey_generation") != runtime.gen:
        context.pop("save_strategy", None)
        context.pop("load_strategy", None)
        context["odyssey_generation"] = runtime.gen


@contextlib.contextmanager
def live_world_size() -> Iterator[None]:
    """``args.world_size`` is the live world's while ``training_log`` runs: it divides by it for the throughput per
    GPU (``--log-throughput``) and the energy per GPU (``--log-energy``), and logs it (``--log-world-size-to-
    tensorboard``); after a failure the survivors do the launch's work. The same as stock until then."""
    import torch.distributed as dist

    from megatron.training import get_args

    args = get_args()
    launch = args.world_size
    args.world_size = dist.get_world_size()
    try:
        yield
    finally:
        args.world_size = launch


def training_log(original: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(original)
    def log(*args: Any, **kwargs: Any) -> Any:
        if STATE.runtime is None:
            return original(*args, **kwargs)
        if kwargs.get("is_first_iteration") and STATE.runtime.joined_the_running_job:
            # (0.16+) train()'s first iteration is logged without emptying the loss totals, so the next line
            # averages both; a rank that joined the running job starts train() mid-job and, as the logging rank,
            # averaged its first two iterations where the job, whose first iteration was long ago, logs each alone
            kwargs["is_first_iteration"] = False
        with live_world_size():
            return original(*args, **kwargs)

    return guarded("log", "training_log", keep=_keep_log_totals)(log)


# save: Megatron marks a checkpoint as the latest only after every rank finished writing it, so an
# interrupted save is never marked; the survivors write it again
save_checkpoint_and_time = guarded("save", "the checkpoint save", keep=_keep_energy)
save_checkpoint = guarded("save", "the checkpoint save", prepare=_fresh_strategies,
                          redone_by="save_checkpoint_and_time")


def checkpoint_and_decide_exit(original: Callable[..., Any]) -> Callable[..., Any]:
    """The exit check, guarded; once it decides to exit, the next world barrier is guarded too: from 0.18 on
    ``train()`` passes one before ``sys.exit`` (after the check's save, so a peer lost there took no state with it,
    but unguarded the survivors would leave with its error instead of the job's exit code)."""
    check = guarded("exit", "the exit check")(original)

    @functools.wraps(original)
    def decide(*args: Any, **kwargs: Any) -> Any:
        should_exit = check(*args, **kwargs)
        if should_exit and STATE.runtime is not None:
            _guard_the_next_world_barrier("the barrier before exiting")
        return should_exit

    return decide


def _guard_the_next_world_barrier(what: str) -> None:
    """``torch.distributed.barrier`` over the world, called next by the main thread outside the calls guarded here,
    becomes :func:`guarded` (fault injection phase ``end``); one call only, after which the name is torch's again.
    ``train()`` reaches the barrier as ``torch.distributed.barrier``, so the name is replaced there, for that call."""
    import threading

    import torch.distributed as dist

    stock = dist.barrier
    if getattr(stock, "_odyssey_guards_once", False):
        return
    inner = guarded("end", what)(stock)

    @functools.wraps(stock)
    def barrier(*args: Any, **kwargs: Any) -> Any:
        group = kwargs.get("group", args[0] if args else None)
        world = group is None and len(args) <= 1 and not set(kwargs) - {"group"}
        if world and threading.current_thread() is threading.main_thread() and outside_guarded_calls():
            dist.barrier = stock
            return inner()
        return stock(*args, **kwargs)

    barrier._odyssey_guards_once = True  # type: ignore[attr-defined]
    dist.barrier = barrier


# --adlr-autoresume: every --adlr-autoresume-interval iterations a world barrier, then (asked to terminate) a save
# and sys.exit(0), which passes through (SystemExit is no Exception)
check_adlr_autoresume_termination = guarded("exit", "the autoresume check")


def once_training(phase: str, what: str, keep: Callable[..., Callable[[], None]] | None = None
                  ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """:func:`guarded` for a Megatron function that also runs at start-up or inside the calls guarded above: guarded
    only once training has started and outside those calls (inside one, that call is run again as a whole); as it
    is otherwise (a failure at start-up stops the job: nothing is trained yet)."""

    def wrap(original: Callable[..., Any]) -> Callable[..., Any]:
        inner = guarded(phase, what, keep=keep)(original)

        @functools.wraps(original)
        def call(*args: Any, **kwargs: Any) -> Any:
            runtime = STATE.runtime
            if runtime is None or not getattr(runtime, "started", False) or not outside_guarded_calls():
                return original(*args, **kwargs)
            return inner(*args, **kwargs)

        return call

    return wrap


#: ``print_datetime``: a barrier over the world, then a time stamp. ``pretrain`` calls it when ``train()`` has
#: returned ("after training is done"), before its final save and validation: a peer lost after the last iteration
#: is met there, and unguarded the survivors would leave with its error and never write the final checkpoint
print_datetime = once_training("end", "print_datetime's barrier")
#: ``disable_forward_pre_hook`` in generation 0 with --overlap-param-gather: ``train()`` calls it before an
#: evaluation and once its loop has ended, and it forces the weight all-gather the pre-hooks deferred, over the
#: distributed optimizer's instance group; a peer's failure there is recovered from, and the call, run again, is
#: a no-op (rebuilt stages gather their weights right after each step: ``hooks.stock_param_gather_only``)
deferred_param_gather = once_training("end", "the deferred weight all-gather")


def params_norm(original: Callable[..., Any]) -> Callable[..., Any]:
    """``calc_params_l2_norm`` as ``train()`` calls it with ``--log-params-norm``, after every iteration outside
    ``train_step``: the norm over the plan (each unit once, ``plan_norms.plan_params_norm``; the same figure as Megatron's
    in the launch layout), with one all-reduce over the world. After a failure Megatron's sums over a
    model-parallel group that holds part of a pipeline (it printed 18.879 for stock's 25.475 after a reroute). And
    even before one: its all-reduces over the model-parallel and data-parallel groups complete for the ranks whose
    groups lost nobody (core_r0.12-0.14 reduce over the model-parallel group only), which then meet the failure in
    the next call while the others meet it here, and no call can be run again by all; over the world every
    survivor meets it here. Guarded."""

    def norm(model: Any, *args: Any, **kwargs: Any) -> Any:
        runtime = STATE.runtime
        if runtime is None:
            return original(model, *args, **kwargs)
        return runtime.params_norm()

    return guarded("between", "the parameter norm")(functools.wraps(original)(norm))


def _timer_barrier(group: Any = None) -> None:
    import torch.distributed as dist

    dist.barrier(group=group)


#: a timer's barrier (``Timer.start/stop/elapsed(barrier=True)``) that ``train()`` runs outside every call above,
#: over the world: around an evaluation (``eval-time``) and after it (``interval-time``). With ``--log-interval``
#: above 1 nothing else after a step waits for every rank, so a peer lost then is met there first
timer_barrier = guarded("between", "a timer's barrier")(_timer_barrier)


def guarded_timer_barrier(original: Callable[..., Any]) -> Callable[..., Any]:
    """``megatron.core.timers.Timer.start`` / ``stop`` / ``elapsed``: with ``barrier=True`` outside the calls
    guarded above, the barrier is :data:`timer_barrier` and the timer then runs without its own."""

    @functools.wraps(original)
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("barrier") and STATE.runtime is not None and outside_guarded_calls():
            timer_barrier(getattr(self, "_barrier_group", None))
            kwargs["barrier"] = False
        return original(self, *args, **kwargs)

    return method
