"""Per-layer profiler: forward/backward time and memory of every weight-holding unit, measured
during normal training and written as the planner's :class:`~megatron_odyssey.planning.profile.ModelProfile`.

Units are the planner's (``planning.plan``): 0 = embedding, ``k + 1`` = global transformer layer
``k``, ``L + 1`` = output (final norm + LM head + loss). One :class:`LayerProfiler` watches one stage
model (``StageGPTModel``: ``embedding``, ``decoder.layers[i]`` = global layer ``layer_start + i``,
``decoder.final_layernorm``, ``output_layer``); each rank reports the units it holds as a
:class:`StageProfile`, and :func:`merge_profiles` takes the per-unit medians over ranks into one
full ``ModelProfile``.

How each number is measured (one model forward call = one micro-batch):

- **forward_s**: wall time from the unit's forward pre-hook to its forward hook (the output unit:
  from ``final_layernorm``'s pre-hook to the end of the model's forward, so the LM head and the
  per-token loss are included). Work between units (rotary tables, ``set_input_tensor``) is not
  attributed to any unit.
- **backward_s**: from the moment the gradient of the unit's output is computed (a tensor hook on
  the output; on the last stage, on the model's output) until both the gradient of the unit's input
  is computed (a tensor hook on the input, i.e. the next unit's backward may start) and every
  parameter of the unit has its gradient accumulated (``register_post_accumulate_grad_hook``; this
  closes the embedding, whose input has no gradient). Module *full* backward hooks are not used:
  megatron calls its layers with keyword arguments, which those hooks do not see.
- **param_bytes / grad_bytes**: bytes of this rank's parameter shards (fp32 here) and of their
  gradients (``main_grad`` when present, else one gradient of the parameter's dtype).
- **optimizer_bytes**: the optimizer's real state bytes for the unit's parameters when an optimizer
  with populated state is given, else ``optimizer_state_factor`` x param bytes (default 2: Adam's
  ``exp_avg`` and ``exp_avg_sq`` in fp32; torch Adam keeps nothing else per parameter but a scalar
  step, and on CPU there are no fp16 copies or master weights).
- **activation_bytes**: bytes of the distinct tensor storages the unit's forward saves for backward
  (``torch.autograd.graph.saved_tensors_hooks`` around the unit, parameters excluded), i.e. what a
  micro-batch in flight holds until its backward. Counted on the first ``activation_passes``
  micro-batches only (shapes do not change), so the counting hooks never slow the timed passes when
  ``warmup >= activation_passes``. A stage's input is counted by the unit that saves it (the first
  layer's norm), as the estimator's per-unit sum expects.
- **optimizer_s**: when the caller reports the optimizer step's duration
  (:meth:`LayerProfiler.observe_optimizer_step`), split over units in proportion to parameter bytes.

Hooks only read clocks and sizes; the pack hook returns the very tensor it is given, so training
results are bit-identical with and without the profiler (the tests check the gradients).
"""
from __future__ import annotations

import statistics
import time
from collections import deque
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Callable, Iterable, Mapping, Sequence

import torch
import torch.distributed as dist

from ..planning.profile import LayerCost, ModelProfile

OPTIMIZER_STATE_FACTOR = 2  # Adam: exp_avg + exp_avg_sq, same dtype as the (fp32) parameter

__all__ = [
    "LayerProfiler", "StageProfile", "merge_profiles", "gather_stage_profiles", "measure_p2p_s", "pipeline_p2p_s",
    "unit_name", "OPTIMIZER_STATE_FACTOR",
]


def unit_name(unit: int, num_layers: int) -> str:
    """The planner's entry name of a unit: ``embedding``, ``layer{k}``, ``output``."""
    if unit == 0:
        return "embedding"
    if unit == num_layers + 1:
        return "output"
    return f"layer{unit - 1}"


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for item in x:
            if isinstance(item, torch.Tensor):
                return item
    return None


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


@dataclass
class _Pass:
    """Clock readings of one micro-batch (one model forward call) and its backward."""

    index: int
    fwd_start: dict[int, float] = field(default_factory=dict)
    fwd_end: dict[int, float] = field(default_factory=dict)
    bwd_start: dict[int, float] = field(default_factory=dict)
    bwd_input: dict[int, float] = field(default_factory=dict)  # gradient of the unit's input ready
    param_done: dict[int, float] = field(default_factory=dict)  # last parameter gradient accumulated
    activation_bytes: dict[int, int] = field(default_factory=dict)


@dataclass
class StageProfile:
    """What one rank measured: a ``LayerCost`` per unit it holds (medians over its micro-batches)."""

    num_layers: int
    units: dict[int, LayerCost]
    samples: int = 0  # micro-batches whose forward and backward were both timed
    micro_batch: int = 1
    seq_length: int = 0
    tp: int = 1

    def to_dict(self) -> dict[str, Any]:
        return {"num_layers": self.num_layers, "samples": self.samples, "micro_batch": self.micro_batch,
                "seq_length": self.seq_length, "tp": self.tp,
                "units": {str(u): asdict(c) for u, c in sorted(self.units.items())}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "StageProfile":
        return cls(num_layers=int(data["num_layers"]), samples=int(data.get("samples", 0)),
                   micro_batch=int(data.get("micro_batch", 1)), seq_length=int(data.get("seq_length", 0)),
                   tp=int(data.get("tp", 1)),
                   units={int(u): LayerCost(**c) for u, c in data["units"].items()})


class LayerProfiler:
    """Times and sizes every unit of one stage model through hooks; see the module docstring.

    Usage::

        prof = LayerProfiler(model, optimizer=opt).attach()
        ... train as usual (forward + backward per micro-batch, optimizer step) ...
        prof.observe_optimizer_step(seconds)   # optional, per step
        stage = prof.stage_profile()            # this rank's units
        prof.detach()

    On an asynchronous device pass ``synchronize`` (e.g. ``torch.cuda.synchronize``): hooks run when
    work is *queued*, so without it the times are launch times (the synchronisations cost speed).
    ``warmup`` micro-batches are left out of the timings (first calls pay lazy initialisation);
    the activation bytes are counted on the first ``activation_passes`` micro-batches. At most
    ``max_passes`` recent micro-batches are kept.
    """

    def __init__(self, model: torch.nn.Module, *, num_layers: int | None = None,
                 optimizer: torch.optim.Optimizer | None = None, micro_batch: int = 1,
                 warmup: int = 1, activation_passes: int = 1,
                 optimizer_state_factor: float = OPTIMIZER_STATE_FACTOR, max_passes: int = 512,
                 clock: Callable[[], float] = time.perf_counter, synchronize: Callable[[], None] | None = None):
        self.model = model
        self.optimizer = optimizer
        self.micro_batch = int(micro_batch)  # recorded in the profile: timings are per micro-batch of this size
        self.num_layers = int(num_layers if num_layers is not None else model.model_config.num_layers)
        self.layer_start = int(getattr(model, "layer_start", 0))
        self.warmup = warmup
        self.activation_passes = activation_passes
        self.optimizer_state_factor = optimizer_state_factor
        if synchronize is not None:  # asynchronous devices: wait for queued kernels before each reading
            def clock(_read: Callable[[], float] = clock) -> float:
                synchronize()
                return _read()
        self.clock = clock
        self._passes: deque[_Pass] = deque(maxlen=max_passes)
        self._count = 0
        self._current: _Pass | None = None  # pass whose forward is running
        self._backward: _Pass | None = None  # pass whose backward ran last
        self._handles: list[Any] = []
        self._saving: list[tuple[int, Any]] = []  # open saved_tensors_hooks contexts
        self._optimizer_s: list[float] = []
        self._params = self._params_by_unit()
        self._param_ptrs = {p.untyped_storage().data_ptr() for ps in self._params.values() for p in ps}
        self.attached = False

    # -- structure ------------------------------------------------------------------------------------
    def _params_by_unit(self) -> dict[int, list[torch.nn.Parameter]]:
        from .grad_sync import unit_of
        from .model import to_global_name

        out: dict[int, list[torch.nn.Parameter]] = {}
        for name, p in self.model.named_parameters():
            out.setdefault(unit_of(to_global_name(name, self.layer_start), self.num_layers), []).append(p)
        return out

    @property
    def units(self) -> list[int]:
        """Units this stage holds, in model order."""
        return sorted(self._params)

    def _modules(self) -> list[tuple[int, torch.nn.Module, str]]:
        """(unit, module, role) to hook: role 'unit' spans one module; 'output' starts at the final
        norm (or the LM head) and ends with the model's forward."""
        m = self.model
        out: list[tuple[int, torch.nn.Module, str]] = []
        if getattr(m, "pre_process", False) and getattr(m, "embedding", None) is not None:
            out.append((0, m.embedding, "unit"))
        for i, layer in enumerate(m.decoder.layers):
            out.append((self.layer_start + i + 1, layer, "unit"))
        if getattr(m, "post_process", False):
            head = getattr(m.decoder, "final_layernorm", None) or getattr(m, "output_layer")
            out.append((self.num_layers + 1, head, "output"))
        return out

    # -- hooks ----------------------------------------------------------------------------------------
    def attach(self) -> "LayerProfiler":
        if self.attached:
            return self
        h = self._handles
        h.append(self.model.register_forward_pre_hook(self._model_pre))
        h.append(self.model.register_forward_hook(self._model_post, always_call=True))
        for unit, module, role in self._modules():
            h.append(module.register_forward_pre_hook(self._make_pre(unit), with_kwargs=True))
            if role == "unit":
                h.append(module.register_forward_hook(self._make_post(unit), always_call=True))
        for unit, params in self._params.items():
            for p in params:
                h.append(p.register_post_accumulate_grad_hook(self._make_param_hook(unit)))
        self.attached = True
        return self

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._close_saving()
        self.attached = False

    def __enter__(self) -> "LayerProfiler":
        return self.attach()

    def __exit__(self, *exc: object) -> None:
        self.detach()

    def _model_pre(self, module: torch.nn.Module, args: Any) -> None:
        self._close_saving()  # a forward that raised left a counting context open
        if not torch.is_grad_enabled():
            self._current = None
            return
        self._current = _Pass(self._count)
        self._count += 1
        self._passes.append(self._current)

    def _model_post(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        rec = self._current
        self._close_saving()
        if rec is None or not self.attached:
            return
        out_unit = self.num_layers + 1
        if out_unit in rec.fwd_start:
            rec.fwd_end[out_unit] = self.clock()
            t = _first_tensor(output)
            if t is not None and t.requires_grad:
                t.register_hook(self._make_bwd_start(rec, out_unit))
        self._current = None

    def _counting(self, rec: _Pass) -> bool:
        return rec.index < self.activation_passes

    def _make_pre(self, unit: int) -> Callable:
        def pre(module: torch.nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            rec = self._current
            if rec is None:
                return
            inp = _first_tensor(args) if args else None
            if inp is None:
                inp = kwargs.get("hidden_states")
            if isinstance(inp, torch.Tensor) and inp.requires_grad:
                inp.register_hook(self._make_bwd_input(rec, unit))
            if self._counting(rec):
                self._open_saving(rec, unit)
            rec.fwd_start[unit] = self.clock()
        return pre

    def _make_post(self, unit: int) -> Callable:
        def post(module: torch.nn.Module, args: Any, output: Any) -> None:
            rec = self._current
            if rec is None or unit not in rec.fwd_start:
                return
            rec.fwd_end[unit] = self.clock()
            self._close_saving(unit)
            out = _first_tensor(output)
            if out is not None and out.requires_grad:
                out.register_hook(self._make_bwd_start(rec, unit))
        return post

    def _make_bwd_start(self, rec: _Pass, unit: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            rec.bwd_start.setdefault(unit, self.clock())
            self._backward = rec
        return hook

    def _make_bwd_input(self, rec: _Pass, unit: int) -> Callable:
        def hook(grad: torch.Tensor) -> None:
            rec.bwd_input[unit] = self.clock()
        return hook

    def _make_param_hook(self, unit: int) -> Callable:
        def hook(param: torch.Tensor) -> None:
            rec = self._backward
            if rec is not None:
                rec.param_done[unit] = self.clock()
        return hook

    # -- activation counting --------------------------------------------------------------------------
    def _open_saving(self, rec: _Pass, unit: int) -> None:
        seen: set[int] = set()
        rec.activation_bytes.setdefault(unit, 0)
        param_ptrs = self._param_ptrs

        def pack(t: torch.Tensor) -> torch.Tensor:
            storage = t.untyped_storage()
            ptr = storage.data_ptr()
            if ptr not in seen and ptr not in param_ptrs:
                seen.add(ptr)
                rec.activation_bytes[unit] += storage.nbytes()
            return t

        def unpack(t: torch.Tensor) -> torch.Tensor:
            return t

        ctx = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
        ctx.__enter__()
        self._saving.append((unit, ctx))

    def _close_saving(self, unit: int | None = None) -> None:
        """Close the counting context of ``unit`` (the output unit's closes with the model forward);
        with no unit, close every open one (innermost first)."""
        while self._saving:
            if unit is not None and self._saving[-1][0] != unit:
                return
            _, ctx = self._saving.pop()
            ctx.__exit__(None, None, None)
            if unit is not None:
                return

    # -- results --------------------------------------------------------------------------------------
    def observe_optimizer_step(self, seconds: float) -> None:
        """Report one optimizer step's duration; it is split over units by parameter bytes."""
        self._optimizer_s.append(float(seconds))

    def reset(self) -> None:
        """Forget every measurement (e.g. after a plan change); hooks stay attached."""
        self._passes.clear()
        self._optimizer_s.clear()
        self._count = 0
        self._current = self._backward = None

    def samples(self) -> dict[int, dict[str, list[float]]]:
        """Per unit, the raw per-micro-batch ``forward_s`` / ``backward_s`` of the timed passes
        (after ``warmup``) and the counted ``activation_bytes``."""
        out = {u: {"forward_s": [], "backward_s": [], "activation_bytes": []} for u in self.units}
        for rec in self._passes:
            for u, b in rec.activation_bytes.items():
                if u in out:
                    out[u]["activation_bytes"].append(b)
            if rec.index < self.warmup or not self._complete(rec):
                continue
            for u in self.units:
                out[u]["forward_s"].append(rec.fwd_end[u] - rec.fwd_start[u])
                end = max(rec.bwd_input.get(u, 0.0), rec.param_done.get(u, 0.0))
                out[u]["backward_s"].append(max(0.0, end - rec.bwd_start[u]))
        return out

    def _complete(self, rec: _Pass) -> bool:
        if rec is self._current:
            return False
        return all(u in rec.fwd_end and u in rec.bwd_start and (u in rec.bwd_input or u in rec.param_done)
                   for u in self.units)

    def _unit_bytes(self, unit: int) -> tuple[int, int, int]:
        params = self._params[unit]
        param_b = sum(p.numel() * p.element_size() for p in params)
        grad_b = 0
        for p in params:
            g = getattr(p, "main_grad", None)
            grad_b += g.numel() * g.element_size() if isinstance(g, torch.Tensor) else p.numel() * p.element_size()
        opt_b = self._optimizer_bytes(params)
        if opt_b is None:
            opt_b = int(self.optimizer_state_factor * param_b)
        return param_b, grad_b, opt_b

    def _optimizer_bytes(self, params: list[torch.nn.Parameter]) -> int | None:
        """Real optimizer state bytes of these parameters, or None before the optimizer has state."""
        if self.optimizer is None:
            return None
        total, found = 0, False
        for p in params:
            state = self.optimizer.state.get(p)
            if not state:
                return None
            found = True
            total += sum(v.numel() * v.element_size() for v in state.values()
                         if isinstance(v, torch.Tensor) and v.dim() > 0)
        return total if found else None

    def stage_profile(self) -> StageProfile:
        """This rank's units as ``LayerCost`` entries (medians over the timed micro-batches)."""
        raw = self.samples()
        sizes = {u: self._unit_bytes(u) for u in self.units}
        total_param = sum(s[0] for s in sizes.values()) or 1
        opt_step = _median(self._optimizer_s)
        units = {}
        for u in self.units:
            param_b, grad_b, opt_b = sizes[u]
            acts = raw[u]["activation_bytes"]
            units[u] = LayerCost(
                name=unit_name(u, self.num_layers),
                forward_s=_median(raw[u]["forward_s"]), backward_s=_median(raw[u]["backward_s"]),
                param_bytes=param_b, grad_bytes=grad_b, optimizer_bytes=opt_b,
                activation_bytes=int(statistics.median(acts)) if acts else 0,
                optimizer_s=opt_step * param_b / total_param)
        cfg = getattr(self.model, "model_config", None)
        return StageProfile(num_layers=self.num_layers, units=units,
                            samples=min((len(raw[u]["forward_s"]) for u in self.units), default=0),
                            seq_length=int(getattr(cfg, "seq_length", 0) or 0),
                            tp=int(getattr(self.model, "tp_size", 1)),
                            micro_batch=self.micro_batch)


# -- ranks -> one profile ----------------------------------------------------------------------------


_HARDWARE = ("allreduce_bandwidth_Bps", "allreduce_latency_s", "transfer_bandwidth_Bps", "device_memory_bytes")


def merge_profiles(parts: Iterable[StageProfile | Mapping[str, Any]], *, p2p_s: float,
                   base: ModelProfile | None = None, name: str = "measured",
                   **hardware: float) -> ModelProfile:
    """One full ``ModelProfile`` from the stage profiles of several ranks.

    Every unit takes the median, over the ranks that hold it, of each field. ``p2p_s`` is the
    one-way time of one activation between neighbouring stages (e.g. :func:`measure_p2p_s`).
    The fields no profiler measures (all-reduce and transfer bandwidth, device memory, recovery
    overheads) come from ``base`` or from keyword arguments (``allreduce_bandwidth_Bps``,
    ``allreduce_latency_s``, ``transfer_bandwidth_Bps``, ``device_memory_bytes``, ...); a unit that
    no rank measured is taken from ``base`` if given, else it is an error.
    """
    stages = [p if isinstance(p, StageProfile) else StageProfile.from_dict(p) for p in parts]
    if not stages:
        raise ValueError("merge_profiles needs at least one stage profile")
    num_layers = {s.num_layers for s in stages}
    if len(num_layers) != 1:
        raise ValueError(f"stage profiles disagree on the number of layers: {sorted(num_layers)}")
    L = num_layers.pop()
    for key in ("micro_batch", "tp"):
        vals = {getattr(s, key) for s in stages}
        if len(vals) != 1:
            raise ValueError(f"stage profiles disagree on {key}: {sorted(vals)}")
    by_unit: dict[int, list[LayerCost]] = {}
    for s in stages:
        for u, c in s.units.items():
            by_unit.setdefault(u, []).append(c)
    if base is not None and base.num_layers != L:
        raise ValueError(f"base profile has {base.num_layers} layers, the measurements {L}")
    base_units = base.units() if base is not None else None
    merged: list[LayerCost] = []
    missing = []
    for u in range(L + 2):
        costs = by_unit.get(u)
        if not costs:
            if base_units is None:
                missing.append(unit_name(u, L))
                continue
            merged.append(replace(base_units[u], name=unit_name(u, L)))
            continue
        merged.append(LayerCost(
            name=unit_name(u, L),
            forward_s=_median([c.forward_s for c in costs]), backward_s=_median([c.backward_s for c in costs]),
            param_bytes=int(statistics.median(c.param_bytes for c in costs)),
            grad_bytes=int(statistics.median(c.grad_bytes for c in costs)),
            optimizer_bytes=int(statistics.median(c.optimizer_bytes for c in costs)),
            activation_bytes=int(statistics.median(c.activation_bytes for c in costs)),
            optimizer_s=_median([c.optimizer_s for c in costs])))
    if missing:
        raise ValueError(f"no rank measured {missing}; pass base= to fill them in")
    seq = max(s.seq_length for s in stages)
    common = dict(name=name, embedding=merged[0], layers=tuple(merged[1:L + 1]), output=merged[L + 1],
                  p2p_s=float(p2p_s), tp=stages[0].tp, micro_batch=stages[0].micro_batch)
    if seq:
        common["seq_length"] = seq
    if base is not None:
        return replace(base, **common, **hardware)
    absent = [k for k in _HARDWARE if k not in hardware]
    if absent:
        raise ValueError(f"without base=, give {absent} (the profiler does not measure them)")
    known = {f.name for f in fields(ModelProfile)}
    unknown = sorted(set(hardware) - known)
    if unknown:
        raise ValueError(f"unknown profile field(s) {unknown}")
    return ModelProfile(**common, **hardware)


def gather_stage_profiles(stage: StageProfile, group: dist.ProcessGroup | None = None) -> list[StageProfile]:
    """Every rank's stage profile on every rank of ``group`` (a collective: all must call it)."""
    out: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, stage.to_dict(), group=group)
    return [StageProfile.from_dict(d) for d in out]


def measure_p2p_s(peer: int, shape: Sequence[int], dtype: torch.dtype = torch.float32, iters: int = 20,
                  warmup: int = 3, group: dist.ProcessGroup | None = None) -> float:
    """One-way time of one activation tensor between this rank and ``peer`` (global ranks):
    the median of ``iters`` ping-pongs, halved. Both ranks must call it with each other as peer;
    the lower rank sends first."""
    me = dist.get_rank()
    if peer == me:
        return 0.0
    buf = torch.zeros(tuple(shape), dtype=dtype)
    first = me < peer
    times = []
    for i in range(warmup + iters):
        t0 = time.perf_counter()
        if first:
            dist.send(buf, peer, group=group)
            dist.recv(buf, peer, group=group)
        else:
            dist.recv(buf, peer, group=group)
            dist.send(buf, peer, group=group)
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return _median(times) / 2


def pipeline_p2p_s(plan: Any, rank_of_node: Callable[[int], int], shape: Sequence[int],
                   dtype: torch.dtype = torch.float32, iters: int = 20) -> float:
    """:func:`measure_p2p_s` between the first two stages of the first multi-stage pipeline of
    ``plan`` (an ``ExecutionPlan``), the result shared with every rank (a collective over the
    default group: every rank must call it). ``rank_of_node`` maps a plan node to the global rank
    that measures for it (e.g. ``lambda n: rank_map.rank(n, 0)``). 0.0 when no pipeline has two
    live stages."""
    pair = None
    for pipe in plan.pipelines:
        nodes = [s.node for s in pipe.stages]
        if len(nodes) > 1 and nodes[0] not in plan.failed and nodes[1] not in plan.failed:
            pair = (rank_of_node(nodes[0]), rank_of_node(nodes[1]))
            break
    value = torch.zeros(1, dtype=torch.float64)
    me = dist.get_rank()
    if pair is not None and me in pair:
        value[0] = measure_p2p_s(pair[1] if me == pair[0] else pair[0], shape, dtype, iters)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value[0])
