"""Process bodies for the multi-process runtime tests (torch.multiprocessing.spawn targets).

Kept in a plain module (not a test file) so spawned children can import them by name.
"""

from __future__ import annotations

import warnings
from typing import Dict, List, Tuple

import torch

warnings.filterwarnings("ignore", message=".*(Apex|Transformer Engine).*")


def make_batch(vocab_size: int, seq_length: int, batch_size: int = 2, seed: int = 7) -> Dict[str, torch.Tensor]:
    """A fixed random micro-batch (own generator: identical in every process)."""
    gen = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, vocab_size, (batch_size, seq_length + 1), generator=gen)
    loss_mask = torch.ones(batch_size, seq_length)
    loss_mask[0, :3] = 0.0  # exercise the mask
    return {
        "tokens": tokens[:, :-1].contiguous(),
        "labels": tokens[:, 1:].contiguous(),
        "loss_mask": loss_mask,
        "position_ids": torch.arange(seq_length).expand(batch_size, seq_length).contiguous(),
    }


def run_split(stages: List[torch.nn.Module], batch: Dict[str, torch.Tensor]) -> torch.Tensor:
    """Forward through consecutive stages by hand, backprop through every boundary; returns loss."""
    from megatron_odyssey.runtime.model import masked_lm_loss, stage_forward

    outputs: List[Tuple[torch.Tensor, torch.Tensor]] = []  # (stage input, stage output)
    x = None
    for stage in stages:
        inp = None if x is None else x.detach().requires_grad_()
        out = stage_forward(stage, batch, inp)
        outputs.append((inp, out))
        x = out
    loss = masked_lm_loss(x, batch["loss_mask"])
    loss.backward()
    # Send each stage's input gradient back to the previous stage's output.
    for i in range(len(stages) - 1, 0, -1):
        inp, _ = outputs[i]
        _, prev_out = outputs[i - 1]
        prev_out.backward(inp.grad)
    return loss.detach()


def run_megatron_schedule(stage: torch.nn.Module, batches: List[Dict[str, torch.Tensor]]) -> List[torch.Tensor]:
    """One training step of ``batches`` through megatron's ``get_forward_backward_func()``
    (no-pipelining or 1F1B, depending on parallel_state); returns the last stage's losses."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from megatron_odyssey.runtime.model import masked_lm_loss

    def forward_step(data_iterator, model):  # type: ignore[no-untyped-def]
        b = next(data_iterator)
        # megatron's schedule has already called model.set_input_tensor() on non-first stages.
        out = model(
            input_ids=b["tokens"] if model.pre_process else None,
            position_ids=b["position_ids"] if model.pre_process else None,
            attention_mask=None,
            labels=b["labels"] if model.post_process else None,
        )

        def loss_func(output: torch.Tensor):  # type: ignore[no-untyped-def]
            loss = masked_lm_loss(output, b["loss_mask"])
            # clone: megatron divides the returned loss in place by the micro-batch count
            return loss, {"lm loss": loss.detach().clone()}

        return out, loss_func

    out = get_forward_backward_func()(
        forward_step_func=forward_step,
        data_iterator=iter(batches),
        model=[stage],
        num_microbatches=len(batches),
        seq_length=batches[0]["tokens"].shape[1],
        micro_batch_size=batches[0]["tokens"].shape[0],
        forward_only=False,
    )
    return [d["lm loss"] for d in out]


def tp_and_data_worker(rank: int, world_size: int, init_file: str, out_path: str, data_dir: str) -> None:
    """2 ranks: TP=1 reference vs TP=2 model (whole and split), and rank-independent data."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from megatron_odyssey.runtime.accelerator import enable_cpu_mode, seed_all
    from megatron_odyssey.runtime.data import DataConfig, MicroBatchData, build_indexed_dataset
    from megatron_odyssey.runtime.model import ModelConfig, build_stage_model, initial_full_state_dict

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    enable_cpu_mode()
    cfg = ModelConfig()
    L = cfg.num_layers
    batch = make_batch(cfg.vocab_size, cfg.seq_length)
    results: Dict[str, object] = {}

    # TP=1 reference (DP=2: both ranks compute the same thing).
    parallel_state.initialize_model_parallel(1, 1)
    seed_all(cfg.seed)
    ref = build_stage_model(cfg, 0, L)
    results["loss_tp1"] = run_split([ref], batch)
    results["grads_tp1"] = ref.global_grads(gather=False)
    parallel_state.destroy_model_parallel()

    # TP=2, whole model and split into [0, 1) + [1, L).
    parallel_state.initialize_model_parallel(2, 1)
    seed_all(cfg.seed)
    whole = build_stage_model(cfg, 0, L)
    params_tp2 = whole.global_state_dict(gather=True)
    results["params_match_init"] = all(
        torch.equal(params_tp2[k], v) for k, v in initial_full_state_dict(cfg).items()
    ) and set(params_tp2) == set(initial_full_state_dict(cfg))
    results["loss_tp2"] = run_split([whole], batch)
    results["grads_tp2"] = whole.global_grads(gather=True)
    first, second = build_stage_model(cfg, 0, 1), build_stage_model(cfg, 1, L)
    results["loss_tp2_split"] = run_split([first, second], batch)
    results["grads_tp2_split"] = {**first.global_grads(gather=True), **second.global_grads(gather=True)}
    results["local_qkv_rows"] = whole.decoder.layers[0].self_attention.linear_qkv.weight.shape[0]
    parallel_state.destroy_model_parallel()

    # PP=2 through megatron's own 1F1B schedule (p2p over gloo): stages [0, 1) and [1, L).
    parallel_state.initialize_model_parallel(1, 2)
    seed_all(cfg.seed)
    stage = build_stage_model(cfg, 0, 1) if rank == 0 else build_stage_model(cfg, 1, L)
    losses = run_megatron_schedule(stage, [batch, batch])  # empty except on the last stage
    pp_out: List[object] = [None] * world_size
    dist.all_gather_object(pp_out, (losses, stage.global_grads()))
    results["pp2_losses"] = [l for ls, _ in pp_out for l in ls]  # type: ignore[misc]
    results["grads_pp2"] = {k: v for _, g in pp_out for k, v in g.items()}  # type: ignore[misc]
    parallel_state.destroy_model_parallel()

    # Data: every rank builds the datasets and computes addresses in a different order.
    if rank == 0:
        build_indexed_dataset(f"{data_dir}/demo")
    dist.barrier()
    addresses = [(t, j) for t in (0, 1, 7) for j in range(4)]
    order = addresses if rank == 0 else list(reversed(addresses))
    per_rank: Dict[str, Dict[Tuple[int, int], Dict[str, torch.Tensor]]] = {}
    for name, dcfg in {
        "mock": DataConfig(),
        "real": DataConfig(data_path=f"{data_dir}/demo", path_to_cache=f"{data_dir}/cache"),
    }.items():
        data = MicroBatchData(dcfg)
        per_rank[name] = {a: data.micro_batch(*a) for a in order}
    gathered: List[object] = [None] * world_size
    dist.all_gather_object(gathered, per_rank)
    results["data"] = gathered

    if rank == 0:
        torch.save(results, out_path)
    dist.barrier()
    dist.destroy_process_group()


def build_cached_dataset_worker(prefix: str, cache: str, num_samples: int, barrier, out) -> None:
    """Build the training dataset of ``prefix`` with its index cache in ``cache`` once every worker
    reached the barrier; put ``(ok, (built it?, some samples' tokens) or the error)`` on ``out``."""
    import logging
    import traceback

    from megatron_odyssey.runtime.data import DataConfig, MicroBatchData

    class Said(logging.Handler):  # megatron logs whether it built the index or loaded the cache
        lines: list[str] = []

        def emit(self, record: logging.LogRecord) -> None:
            self.lines.append(record.getMessage())

    log = logging.getLogger("megatron.core.datasets.gpt_dataset")
    log.setLevel(logging.INFO)
    log.addHandler(Said())
    cfg = DataConfig(seq_length=16, micro_batch_size=1, global_batch_size=num_samples, train_steps=1,
                     data_path=prefix, path_to_cache=cache)
    barrier.wait()
    try:
        data = MicroBatchData(cfg)
        n = len(data.dataset)
        tokens = torch.stack([data.dataset[i]["tokens"] for i in range(0, n, max(1, n // 64))])
        built = any(line.startswith("Build and save") for line in Said.lines)
        out.put((True, (built, tokens.tolist())))  # plain data: a tensor would travel as shared memory
    except BaseException:  # the test shows what went wrong in the worker
        out.put((False, traceback.format_exc()))


def _descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (from /proc: psutil is not a test dependency)."""
    from megatron_odyssey.runtime.process_probe import children_of

    out, todo = [], [pid]
    while todo:
        try:
            children = children_of(todo.pop())
        except OSError:  # (gone meanwhile)
            continue
        out += children
        todo += children
    return out


def spawn_bounded(worker, args: tuple, nprocs: int, timeout_s: float) -> None:
    """``torch.multiprocessing.spawn`` that cannot hold the suite: ranks still running after ``timeout_s`` (a wait
    that never ends, as Megatron's checkpoint writer without psutil) are killed with everything they started, and
    the test fails saying so. A rank's error is raised as spawn raises it."""
    import os
    import signal
    import time

    import torch.multiprocessing as mp

    context = mp.spawn(worker, args=args, nprocs=nprocs, join=False)
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, min(5.0, deadline - time.monotonic()))):
        if time.monotonic() >= deadline:
            pids = [p.pid for p in context.processes if p.is_alive()]
            for pid in [d for p in pids for d in _descendants(p)] + pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            raise TimeoutError(f"ranks {[i for i, p in enumerate(context.processes) if p.pid in pids]} still ran "
                               f"after {timeout_s:.0f} s: killed")


def on_two_gloo_ranks(worker, timeout_s: float):
    """Run ``worker(rank, port, out)`` in two spawned processes that form a gloo world on a fresh port; returns
    what one of them put on ``out``."""
    import multiprocessing as mp

    from megatron_odyssey.runtime.agent import free_port

    ctx = mp.get_context("spawn")
    out, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=worker, args=(r, port, out)) for r in range(2)]
    for p in procs:
        p.start()
    result = out.get(timeout=timeout_s)
    for p in procs:
        p.join(60)
    return result


def classify_gloo_errors_worker(rank: int, port: int, out) -> None:
    """Two gloo ranks: rank 1 SIGKILLs itself, rank 0 classifies what the broken recv raises, a local
    bug, and a store timeout; results go to ``out`` as (case, exception type, is_peer_failure)."""
    import os
    import signal
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_odyssey.runtime.errors import is_peer_failure

    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    t = torch.ones(4)
    dist.all_reduce(t)
    if rank == 1:
        time.sleep(0.3)
        os.kill(os.getpid(), signal.SIGKILL)
    results = []
    try:
        dist.recv(t, src=1)
    except Exception as exc:
        results.append(("peer killed", type(exc).__name__, is_peer_failure(exc, store, 0)))
    try:
        torch.ones(2, 3) @ torch.ones(4, 5)  # a shape bug of our own
    except Exception as exc:
        results.append(("shape bug", type(exc).__name__, is_peer_failure(exc, store, 0)))
        store.set("odyssey/gen0/abort", "ranks [1] failed")  # the agent aborted the generation meanwhile
        results.append(("shape bug in an aborted generation", type(exc).__name__, is_peer_failure(exc, store, 0)))
    try:
        store.wait(["never-set"], timedelta(milliseconds=200))
    except Exception as exc:
        results.append(("store timeout", type(exc).__name__, is_peer_failure(exc)))
    out.put(results)


def in_collective_worker(rank: int, port: int, out) -> None:
    """Two gloo ranks: rank 0's main thread waits in a barrier, an all-gather of objects, a receive's Work handle
    (named, and held in a ``__slots__`` field) that rank 1 joins only after a while, and in a threading Event; a side
    thread of rank 0 samples ``liveness.in_collective`` while it waits and while it sleeps; results go to ``out`` as
    (case, sampled)."""
    import threading
    import time
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_odyssey.runtime.liveness import in_collective

    class Slotted:
        __slots__ = ("work",)

        def __init__(self, work: dist.Work) -> None:
            self.work = work

    cases = ("barrier", "all_gather_object", "work", "slotted work", "event")
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    if rank == 1:
        for case in cases:
            store.wait(["sampled"])
            store.delete_key("sampled")
            if case == "barrier":
                dist.barrier()
            elif case == "all_gather_object":
                dist.all_gather_object([None, None], rank)
            elif case in ("work", "slotted work"):
                dist.send(torch.ones(4), 0)
        return
    results: list = []
    event = threading.Event()

    def sample(case: str) -> None:
        time.sleep(0.5)  # the main thread is in it by now
        results.append((case, in_collective()))
        store.set("sampled", "1")
        event.set()

    for case in cases:
        side = threading.Thread(target=sample, args=(case,))
        side.start()
        if case == "barrier":
            dist.barrier()
        elif case == "all_gather_object":
            dist.all_gather_object([None, None], rank)
        elif case == "work":
            work = dist.irecv(torch.zeros(4), 1)
            work.wait()
        elif case == "slotted work":
            held = Slotted(dist.irecv(torch.zeros(4), 1))
            held.work.wait()
        else:
            event.wait()
        side.join()
    side = threading.Thread(target=lambda: results.append(("sleeping", in_collective())))
    side.start()
    time.sleep(0.3)
    side.join()
    out.put(results)


def overlapped_grad_sync_worker(rank: int, world: int, store_file: str, out: str) -> None:
    """Two data-parallel ranks of a 4-unit chain (embedding, 2 layers, output): the same backward, once with
    the gradient all-reduces overlapped and once after it; rank 0 saves what both did."""
    import time

    import torch.distributed as dist

    from megatron_odyssey.planning.plan import symmetric_plan
    from megatron_odyssey.runtime.grad_sync import GradientSync, params_by_unit
    from megatron_odyssey.runtime.op_trace import OpTrace
    from megatron_odyssey.runtime.world import RankMap, build_plan_groups

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    plan = symmetric_plan(1, world, 2, 2 * world)
    groups = build_plan_groups(plan, RankMap.for_plan(plan, 1), rank)
    names = ["embedding.w", "decoder.layers.0.w", "decoder.layers.1.w", "output_layer.w"]

    def local_grads(r: int) -> list:
        """This chain's gradients for rank ``r``'s input (a big hidden size: each backward step takes time)."""
        torch.manual_seed(5)
        weights = [torch.nn.Parameter(torch.randn(256, 256) / 16) for _ in names]
        x = torch.randn(64, 256, generator=torch.Generator().manual_seed(100 + r))
        for w in weights:
            x = torch.tanh(x @ w)
        return weights, x.square().sum()

    result = {}
    for overlap in (False, True):
        weights, loss = local_grads(rank)
        trace = OpTrace(rank, rank)
        sync = GradientSync(plan, groups, params_by_unit(list(zip(names, weights)), 2), trace=trace, overlap=overlap)
        with sync.overlapping():
            loss.backward()
        backward_end = time.time()
        # the complete local gradients (an overlapped all-reduce has started but not yet replaced them);
        # each pass is checked against its own: two computations of the same chain need not agree to the
        # bit on a CPU (MKL's kernels depend on buffer alignment and thread count)
        local = [w.grad.clone() for w in weights]
        everyone = [None] * world
        dist.all_gather_object(everyone, local)
        joined = sync()
        sync.close()
        result[overlap] = {"grads": [w.grad.clone() for w in weights], "joined": joined,
                           "local": everyone, "reductions": list(trace.reductions), "backward_end": backward_end}
    if rank == 0:
        torch.save(result, out)
    dist.barrier()
    dist.destroy_process_group()


def _megatron_cpu_patches(*prefixes: str) -> None:
    """CPU mode, and the Megatron-LM CPU-mode patches whose targets start with ``prefixes`` (megatron-core modules
    that only Megatron-LM's training loop reaches; no Megatron-LM checkout needed)."""
    from megatron_odyssey.megatron_lm.cpu_mode import install_megatron_lm_cpu_patches
    from megatron_odyssey.runtime.accelerator import enable_cpu_mode

    enable_cpu_mode()
    install_megatron_lm_cpu_patches([], prefixes)


def replica_optimizer_worker(rank: int, world: int, store_file: str, out: str, dtypes: list[str]) -> None:
    """``world`` ranks holding one stage (every unit on every rank): Megatron's optimizer (bf16: with fp32 main
    copies; fp32: stepping the model parameters) cut down to each rank's replicated shards
    (megatron_lm.replica_optimizer) against the plain one, over the same gradients; rank 0 saves what both
    did, the shares, and the checkpoint dictionaries, for each of ``dtypes`` (one spawn: each process imports
    megatron-core once)."""
    import copy

    import torch.distributed as dist
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params, FP32Optimizer

    from megatron_odyssey.megatron_lm.replica_optimizer import ReplicaShards
    from megatron_odyssey.planning.plan import symmetric_plan
    from megatron_odyssey.runtime.world import RankMap, build_plan_groups, install_parallel_state
    import megatron.core.optimizer.optimizer as core_optimizer

    _megatron_cpu_patches("megatron.core.optimizer.optimizer.")  # the optimizer module's own
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    plan = symmetric_plan(1, world, 2, world)
    groups = build_plan_groups(plan, RankMap.for_plan(plan, 1), rank)
    install_parallel_state(groups)
    shapes = {"embedding.word_embeddings.weight": (7, 5), "decoder.layers.0.mlp.weight": (13,),
              "decoder.layers.0.mlp.bias": (4,), "decoder.layers.1.mlp.weight": (5, 3), "output_layer.weight": (6, 5)}

    def case(dtype: str) -> dict:
        def build(cut: bool):
            torch.manual_seed(0)
            named = []
            for name, shape in shapes.items():
                p = torch.nn.Parameter(torch.randn(shape).to(getattr(torch, dtype)))
                p.main_grad = torch.zeros(shape)  # Megatron DDP's fp32 gradient buffer
                named.append((name, p))
            decay = [p for n, p in named if not n.endswith("bias")]
            # the keys Megatron's _get_param_groups adds
            megatron_keys = {"lr_mult": 1.0, "is_expert_parallel": False, "is_decoupled_lr": False}
            adam = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1, "wd_mult": 1.0, **megatron_keys},
                                      {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0,
                                       "wd_mult": 0.0, **megatron_keys}],
                                     lr=0.05, betas=(0.9, 0.95), eps=1e-8)

            def init_state(opt, config=None):
                for group in opt.param_groups:
                    for q in group["params"]:
                        if not opt.state[q]:
                            opt.state[q]["exp_avg"] = torch.zeros_like(q)
                            opt.state[q]["exp_avg_sq"] = torch.zeros_like(q)

            if dtype == "bfloat16":
                opt = Float16OptimizerWithFloat16Params(adam, OptimizerConfig(bf16=True, lr=0.05, clip_grad=1.0), None,
                                                        init_state)
            else:
                opt = FP32Optimizer(adam, OptimizerConfig(lr=0.05, clip_grad=1.0), init_state)
            shards = ReplicaShards(opt, named, groups.unit_groups, rank, 2, copies=2) if cut else None
            return named, opt, shards

        plain, sharded = build(False), build(True)
        for step in range(3):
            g = torch.Generator().manual_seed(10 + step)
            grads = {n: torch.randn(s, generator=g) * 3 for n, s in shapes.items()}  # the same reduced gradients
            norm = float(torch.cat([v.reshape(-1) for v in grads.values()]).norm())
            for named, opt, shards in (plain, sharded):
                for n, p in named:
                    p.main_grad.copy_(grads[n])
                # the plan-wide norm, agreed before the commit (megatron_lm.patches replaces this function so)
                core_optimizer.get_grad_norm_fp32 = lambda *_, norm=norm, **__: norm
                ok, _, _ = opt.step()
                assert ok
                if shards is not None:
                    shards.gather_params()
        named_p, opt_p, _ = plain
        named_s, opt_s, shards = sharded

        def by_key(tree, out):
            """Megatron's checkpoint as it lands on disk: each ShardedTensor's data under its key."""
            if isinstance(tree, dict):
                for v in tree.values():
                    by_key(v, out)
            elif isinstance(tree, ShardedTensor):
                out[tree.key] = tree.data.detach().clone()
            return out

        def filled(tree, saved):
            """What Megatron's load makes of a template: the saved data in place of each ShardedTensor."""
            if isinstance(tree, dict):
                return {k: filled(v, saved) for k, v in tree.items()}
            return saved[tree.key].clone() if isinstance(tree, ShardedTensor) else copy.deepcopy(tree)

        model_sd = {n: ShardedTensor.from_rank_offsets(n, p) for n, p in named_s}
        written = opt_s.sharded_state_dict(model_sd)  # (collective: gathers the full state)
        saved = by_key(written, {})
        common = {k: v for k, v in written.items() if k != "param_state"}
        # a fresh cut-down optimizer loads it the way Megatron's load_checkpoint does (template, then load_state_dict)
        named_l, opt_l, shards_l = build(True)
        template = opt_l.sharded_state_dict({n: ShardedTensor.from_rank_offsets(n, p) for n, p in named_l},
                                            is_loading=True)
        opt_l.load_state_dict({**filled(template, saved), **copy.deepcopy(common)})  # (common: the checkpoint's own)
        share = shards.capture(plan)
        shares = [None] * world
        dist.all_gather_object(shares, share)
        loaded = [None] * world
        dist.all_gather_object(loaded, shards_l.capture(plan))
        main_of = ({id(m): f for mg, fg in zip(opt_p.float16_groups, opt_p.fp32_from_float16_groups)
                    for m, f in zip(mg, fg)} if dtype == "bfloat16" else {id(p): p for _, p in named_p})
        reference = {n: {"param": main_of[id(p)].detach().clone(),
                         **{k: v.clone() for k, v in opt_p.optimizer.state[main_of[id(p)]].items()}}
                     for n, p in named_p}
        return {"plain_params": {n: p.detach().clone() for n, p in named_p},
                "sharded_params": {n: p.detach().clone() for n, p in named_s},
                "kept": shards.kept_numel(), "total": sum(p.numel() for _, p in named_p),
                "reference": reference, "shares": shares, "loaded": loaded, "saved": saved, "common": common}

    results = {dtype: case(dtype) for dtype in dtypes}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def tied_embeddings_worker(rank: int, world: int, store_file: str, out: str) -> None:
    """Three nodes of a plan with tied embeddings: node 0 holds the whole 4-layer model (one weight for both
    ends), nodes 1 and 2 a two-stage pipeline (embedding | output layer, each with its own copy). Each gives its
    copy a known gradient; then node 0 hands the output unit to node 2 and back (state.transfer with the aliases).
    Rank 0 saves what every rank ended with."""
    import torch.distributed as dist

    from megatron_odyssey.planning.plan import layout
    from megatron_odyssey.runtime import state as st
    from megatron_odyssey.runtime.grad_sync import GradientSync, params_by_unit
    from megatron_odyssey.runtime.world import RankMap, build_plan_groups

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    plan = layout([((4,), 2), ((2, 2), 2)], num_layers=4)
    groups = build_plan_groups(plan, RankMap.for_plan(plan, 1), rank, tied=True)
    names = {0: ["embedding.word_embeddings.weight", *(f"decoder.layers.{k}.w" for k in range(4)),
                 "decoder.final_layernorm.weight"],
             1: ["embedding.word_embeddings.weight", "decoder.layers.0.w", "decoder.layers.1.w"],
             2: ["decoder.layers.2.w", "decoder.layers.3.w", "decoder.final_layernorm.weight", "output_layer.weight"]}
    named = [(n, torch.nn.Parameter(torch.full((3,), float(rank + 1)))) for n in names[rank]]
    for i, (n, p) in enumerate(named):
        p.grad = torch.full((3,), 10.0 ** rank * (i + 1))  # every rank's and parameter's gradient differ
    tied = [p for n, p in named if n in ("embedding.word_embeddings.weight", "output_layer.weight")]
    sync = GradientSync(plan, groups, params_by_unit(named, 4), tied=tied)
    joined = sync()
    grads = {n: p.grad.clone() for n, p in named}
    # the output unit (5) from node 0 (no output weight of its own) to node 2, and from node 2 back to node 0
    old = st.capture(named, torch.optim.Adam([p for _, p in named]))
    wanted = {n: p.shape for n, p in named}
    received = st.transfer([(5, 0, 2), (5, 2, 0)], rank, 0, lambda node, tp: node, 4, old, wanted,
                           aliases=st.TIED_ALIASES)
    everyone = [None] * world
    dist.all_gather_object(everyone, {"grads": grads, "joined": joined,
                                      "received": {n: s["param"] for n, s in received.items()}})
    if rank == 0:
        torch.save(everyone, out)
    dist.destroy_process_group()


def loss_scale_worker(rank: int, world: int, store_file: str, out: str) -> None:
    """--fp16 under the step commit (megatron_lm.loss_scale) with megatron-core's own mixed-precision optimizer and
    dynamic loss scaler: rank 0 trains two steps (an overflow, then a finite step) with a model-parallel group of its
    own while rank 1 waits; rank 0 saves what happened."""
    import torch.distributed as dist
    from megatron.core.optimizer import OptimizerConfig
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import Float16OptimizerWithFloat16Params

    from megatron_odyssey.megatron_lm import loss_scale

    # the optimizer and loss-scaler modules' own (and Tensor.cuda: the scaler's load_state_dict moves to the device)
    _megatron_cpu_patches("megatron.core.optimizer.optimizer.", "megatron.core.optimizer.grad_scaler.",
                          "torch.Tensor.cuda")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    rank0 = dist.new_group([0])  # rank 0's model-parallel group (its found-inf all-reduce), made by every rank

    def build():
        torch.manual_seed(0)
        p = torch.nn.Parameter(torch.randn(4, 3).half())
        p.main_grad = torch.zeros(4, 3)  # Megatron DDP's fp32 gradient buffer (--accumulate-allreduce-grads-in-fp32)
        adam = torch.optim.AdamW([{"params": [p], "weight_decay": 0.0, "wd_mult": 1.0, "lr_mult": 1.0,
                                   "is_expert_parallel": False, "is_decoupled_lr": False}], lr=0.1)

        def init_state(opt, config=None):
            for q in opt.param_groups[0]["params"]:
                if not opt.state[q]:
                    opt.state[q]["exp_avg"] = torch.zeros_like(q)
                    opt.state[q]["exp_avg_sq"] = torch.zeros_like(q)

        scaler = DynamicGradScaler(initial_scale=1024.0, min_scale=1.0, growth_factor=2.0, backoff_factor=0.5,
                                   growth_interval=1, hysteresis=1)
        opt = Float16OptimizerWithFloat16Params(adam, OptimizerConfig(fp16=True, lr=0.1, clip_grad=0.0), scaler,
                                                init_state)
        opt.get_grad_stats_parallel_group = lambda: rank0
        return p, opt

    p, opt = build()
    record: dict = {}
    if rank == 0:
        # generation 0: Megatron's prepare_grads before the commit, its scaler update held back
        p.main_grad.copy_(torch.tensor(float("inf")).expand(4, 3))
        p.main_grad[0, 0] = 1.0
        before = p.detach().clone()
        with loss_scale.deferred_scaler_updates(opt) as updates:
            overflow = opt.prepare_grads()
        record["overflow"], record["scale_before_commit"] = overflow, float(opt.get_loss_scale())
        with loss_scale.decided(opt, overflow, updates):
            record["step1"] = opt.step()[0]
        record["scale_after_skip"], record["unchanged"] = float(opt.get_loss_scale()), torch.equal(p, before)
        # a plan step: gradients scaled by the loss scale and DP = 2 (backward_scale); a finite agreed decision
        g = torch.arange(12, dtype=torch.float32).reshape(4, 3) / 8
        p.main_grad.copy_(g * record["scale_after_skip"] * 2)
        record["norm"] = loss_scale.unscaled_norm(float(p.main_grad.norm()), opt, 2)
        record["norm_inf"] = loss_scale.unscaled_norm(float("inf"), opt, 2)
        record["norm_nan"] = loss_scale.unscaled_norm(float("nan"), opt, 2)
        with loss_scale.agreed_overflow(opt, False, 2):
            record["step2"] = opt.step()[0]
        record["main_grad_unscaled"] = torch.equal(opt.fp32_from_float16_groups[0][0].grad, g)
        record["scale_after_step"] = float(opt.get_loss_scale())
        record["changed"] = not torch.equal(p, before)
        # a rebuild: a fresh optimizer takes the scaler where the last commit left it
        states = loss_scale.scaler_states(opt)
        _, fresh = build()
        loss_scale.load_scaler_states(fresh, states)
        record["rebuilt_scale"] = float(fresh.get_loss_scale())
        record["rebuilt_trackers"] = (fresh.grad_scaler._growth_tracker, fresh.grad_scaler._hysteresis_tracker)
        record["trackers"] = (opt.grad_scaler._growth_tracker, opt.grad_scaler._hysteresis_tracker)
    if rank == 0:
        torch.save(record, out)
    dist.destroy_process_group()


def host_staging_worker(rank: int, port: int, out) -> None:
    """Two gloo ranks with every operation staged through host copies (``stage_host_tensors``: on this CPU
    machine the host tensors too, so a missing copy-back leaves an output unwritten): each operation Megatron-LM
    and Odyssey use, blocking, asynchronous and coalesced, and what it left in its outputs; rank 0's results go to
    ``out`` as {case: value}."""
    import sys
    import types
    from datetime import timedelta

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    # a module that took the name before staging was enabled, as megatron-core's param_and_grad_buffer does
    early = types.ModuleType("early_importer")
    early.coalesce, early.gather = c10d._coalescing_manager, dist.all_gather_into_tensor
    sys.modules["early_importer"] = early
    from megatron_odyssey.runtime.host_staging import StagedWork, enable_host_staging

    enable_host_staging(stage_host_tensors=True)
    store = dist.TCPStore("127.0.0.1", port, 2, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    me, other = float(rank + 1), 1 - rank
    got: dict = {"rebound": (early.coalesce is dist._coalescing_manager is c10d._coalescing_manager,
                             early.gather is dist.all_gather_into_tensor)}

    t = torch.full((3,), me)
    dist.all_reduce(t)
    got["all_reduce"] = t.tolist()
    t = torch.full((3,), me)
    work = dist.all_reduce(t, async_op=True)
    got["async all_reduce handle"] = isinstance(work, StagedWork)
    work.wait()
    got["async all_reduce"] = t.tolist()
    a, b = torch.full((2,), me), torch.full((4,), 10 * me)
    with dist._coalescing_manager():
        dist.all_reduce(a)
        dist.all_reduce(b)
    got["coalesced all_reduce"] = (a.tolist(), b.tolist())
    buffer = torch.zeros(4)  # megatron-core's distributed optimizer: gather each rank's shard, a view of the buffer
    buffer[2 * rank:2 * rank + 2] = me
    with early.coalesce(None, async_ops=True) as cm:
        early.gather(buffer, buffer[2 * rank:2 * rank + 2], async_op=True)
    cm.wait()
    got["coalesced async all_gather_into_tensor"] = buffer.tolist()
    grads = torch.arange(4.0) * me  # ... and reduce-scatter gradients into each rank's shard of the same buffer
    dist.reduce_scatter_tensor(grads[2 * rank:2 * rank + 2], grads)
    got["reduce_scatter_tensor into a shard"] = grads.tolist()
    t = torch.full((2,), me)
    dist.broadcast(t, src=1)
    got["broadcast"] = t.tolist()
    parts = [torch.zeros(2) for _ in range(2)]
    dist.all_gather(parts, torch.full((2,), me))
    got["all_gather"] = [p.tolist() for p in parts]
    received = torch.zeros(2)
    ops = [dist.P2POp(dist.isend, torch.full((2,), me), other), dist.P2POp(dist.irecv, received, other)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    got["batch_isend_irecv"] = received.tolist()
    received = torch.zeros(2)
    if rank == 0:
        dist.send(torch.full((2,), 7.0), dst=1)
        dist.irecv(received, src=1).wait()
    else:
        dist.recv(received, src=0)
        dist.isend(received * 2, dst=0).wait()
    got["send, recv, isend, irecv"] = received.tolist()
    exchanged = torch.zeros(2)
    dist.all_to_all_single(exchanged, torch.tensor([me, 10 * me]))
    got["all_to_all_single"] = exchanged.tolist()
    dist.barrier()
    if rank == 0:
        out.put(got)
    dist.destroy_process_group()


#: the three CPU-mode wrappers of a torch-Adam distributed-optimizer load (megatron_lm.cpu_mode), by method name
RESUME_WRAPPERS = ("state_dict", "_set_main_param_and_optimizer_states", "load_state_dict")


def distributed_optimizer_resume_worker(rank: int, world: int, store_file: str, ckpt_root: str, out: str) -> None:
    """``world`` data-parallel ranks run megatron-core's own DDP and DistributedOptimizer (torch's Adam: no Apex or
    TE) on a tiny module: two steps, a dist_checkpointing save of model and optimizer (the way Megatron-LM's
    checkpointing writes them), two more steps; then a fresh model and optimizer load the checkpoint and take the
    same two steps. Each dtype and format, with the CPU-mode load wrappers and with each of them put back to
    Megatron's own method; rank 0 saves every rank's outcome."""
    import itertools
    import os
    import traceback

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer.distrib_optimizer import DistributedOptimizer
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.module import MegatronModule

    _megatron_cpu_patches("megatron.core.", "torch.Tensor.cuda")  # (the layout-free save gathers with .cuda())
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)

    class Tiny(MegatronModule):
        def __init__(self, config: TransformerConfig) -> None:
            super().__init__(config)
            self.first = torch.nn.Linear(6, 7)  # 42 + 7 + 21 elements: shards split parameters
            self.second = torch.nn.Linear(7, 3, bias=False)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.second(torch.tanh(self.first(x)))

    def build(dtype: torch.dtype):
        torch.manual_seed(0)
        bf16 = dtype == torch.bfloat16
        config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, bf16=bf16, params_dtype=dtype,
                                   use_cpu_initialization=True)
        ddp = DistributedDataParallel(config, DistributedDataParallelConfig(use_distributed_optimizer=True,
                                                                            grad_reduce_in_fp32=True),
                                      Tiny(config).to(dtype))
        opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=0.05, weight_decay=0.1, clip_grad=1.0,
                                                     bf16=bf16, params_dtype=dtype, use_distributed_optimizer=True),
                                     [ddp])
        return ddp, opt

    def train(ddp, opt, step: int, dtype: torch.dtype) -> None:
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank)).to(dtype)
        ddp.zero_grad_buffer()
        opt.zero_grad()
        ddp(x).float().pow(2).mean().backward()
        ddp.finish_grad_sync()
        assert opt.step()[0]

    def sharded(ddp, opt, fmt: str, loading: bool) -> dict:
        model = ddp.module.sharded_state_dict()
        return {"model": model, "optimizer": opt.sharded_state_dict(
            model, is_loading=loading, metadata={"distrib_optim_sharding_type": fmt})}

    def case(dtype: torch.dtype, fmt: str, path: str) -> dict:
        ddp, opt = build(dtype)
        for step in range(2):
            train(ddp, opt, step, dtype)
        if rank == 0:
            os.makedirs(path)
        dist.barrier()
        dist_checkpointing.save(sharded(ddp, opt, fmt, False), path)
        for step in range(2, 4):
            train(ddp, opt, step, dtype)
        try:
            resumed, ropt = build(dtype)
            loaded = dist_checkpointing.load(sharded(resumed, ropt, fmt, True), path)
            resumed.module.load_state_dict(loaded["model"])
            ropt.load_state_dict(loaded["optimizer"])
            for step in range(2, 4):
                train(resumed, ropt, step, dtype)
        except Exception as e:  # the same on every rank: each fails at the same point of the same load
            tb = traceback.extract_tb(e.__traceback__)
            return {"error": type(e).__name__, "message": str(e), "in": tb[-1].name}
        steps = [s["step"] for s in ropt.optimizer.state.values()]
        return {"max_diff": max(float((a.detach().float() - b.detach().float()).abs().max())
                                for a, b in zip(ddp.parameters(), resumed.parameters())),
                "steps": [float(s) for s in steps], "step_tensors": len({id(s) for s in steps})}

    results = {}
    for without, dtype, fmt in itertools.product((None, *RESUME_WRAPPERS), (torch.float32, torch.bfloat16),
                                                 ("dp_reshardable", "fully_reshardable")):
        wrapper = getattr(DistributedOptimizer, without) if without else None
        if without:
            setattr(DistributedOptimizer, without, wrapper.__wrapped__)  # Megatron's own method
        try:
            name = f"{without}-{str(dtype).removeprefix('torch.')}-{fmt}"
            outcome = case(dtype, fmt, os.path.join(ckpt_root, name))
        finally:
            if without:
                setattr(DistributedOptimizer, without, wrapper)
        everyone = [None] * world
        dist.all_gather_object(everyone, outcome)
        results[(without, str(dtype).removeprefix("torch."), fmt)] = everyone
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def save_writer_death_worker(rank: int, world: int, store_file: str, port: int, ckpt: str, case: str) -> None:
    """One of ``world`` gloo ranks saving a sharded tensor twice with megatron-core's dist_checkpointing (its
    torch_dist writers: processes forked per save), with a heartbeat to the store at ``port`` that says when the
    rank is in a save, as the Megatron-LM host's does. The first save is healthy (``first-saved-RANK`` is written
    after it); in the second each writer dies at its start: ``no-psutil`` (as without psutil from core_r0.13 on:
    megatron-core's own flag set off) or ``killed`` (SIGKILLed as it starts, as by the OOM killer: the fault
    ``kind=kill-writer`` injects, its at-fork hook). The rank leads its own
    process group, as under odyssey-launch (which kills the group of a rank that ended: megatron-core's manager
    process of the writers' results outlives a rank that leaves at once)."""
    import os

    import torch.distributed as dist
    from megatron.core import dist_checkpointing, parallel_state
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.strategies import filesystem_async

    from megatron_odyssey.runtime.faults import _killed_at_start
    from megatron_odyssey.runtime.liveness import Heartbeat, Progress

    os.setsid()
    _megatron_cpu_patches("megatron.core.", "torch.Tensor.cuda")
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1)
    progress = Progress()
    Heartbeat("127.0.0.1", port, rank, 0.2, progress).start()
    sharded = {"w": ShardedTensor.from_rank_offsets("w", torch.arange(8.0) + rank, (0, rank, world))}
    for step, name in enumerate(("first", "second")):
        if name == "second" and case == "no-psutil":
            filesystem_async.HAVE_PSUTIL = False
        elif name == "second" and case == "killed":
            os.register_at_fork(after_in_child=_killed_at_start)  # as faults.Injector fires kind=kill-writer
        os.makedirs(os.path.join(ckpt, name), exist_ok=True)
        dist.barrier()
        progress.rest(step, "save")
        dist_checkpointing.save(sharded, os.path.join(ckpt, name))
        progress.rest(step, "between")
        open(os.path.join(ckpt, f"{name}-saved-{rank}"), "w").close()
    dist.destroy_process_group()


def plan_norms_worker(rank: int, world: int, store_file: str, out: str) -> None:
    """Three nodes of a re-arranged job (one pipeline of two stages, one of a single stage) hold known gradients
    and weights; each rank computes the plan-wide gradient norm, parameter norm and zero count
    (megatron_lm.plan_norms), and rank 0 saves what every rank got."""
    import torch.distributed as dist

    from megatron_odyssey.megatron_lm.plan_norms import plan_grad_norm, plan_params_norm, plan_zero_count, unit_owners
    from megatron_odyssey.planning.plan import layout

    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)
    plan = layout([((2, 2), 2), ((4,), 2)], num_layers=4)  # node 0: emb + layers 0-1; 1: 2-3 + out; 2: all
    names = {0: ["embedding.word_embeddings.weight", "decoder.layers.0.mlp.weight", "decoder.layers.1.mlp.weight"],
             1: ["decoder.layers.2.mlp.weight", "decoder.layers.3.mlp.weight", "decoder.final_layernorm.weight",
                 "output_layer.weight"],
             2: ["embedding.word_embeddings.weight", *(f"decoder.layers.{i}.mlp.weight" for i in range(4)),
                 "decoder.final_layernorm.weight", "output_layer.weight"]}[rank]
    named = []
    for k, name in enumerate(names):
        p = torch.nn.Parameter(torch.full((2, 3), float(rank + 1)))
        p.main_grad = torch.arange(6, dtype=torch.float32).reshape(2, 3) * (k + 1) * (rank + 1)  # one zero each
        if name == "output_layer.weight" and rank == 1:
            p.shared = True  # a tied output layer's copy of the word embeddings: never counted
        named.append((name, p))
    owners = unit_owners(plan)
    got = [f(named, owners, rank, 0, 4, torch.device("cpu"))
           for f in (plan_grad_norm, plan_params_norm, plan_zero_count)]
    everyone = [None] * world
    dist.all_gather_object(everyone, {"owners": owners, "got": got})
    if rank == 0:
        torch.save(everyone, out)
    dist.barrier()
    dist.destroy_process_group()


def abort_shuts_gloo_worker(rank: int, port: int, out, world: str = "gloo") -> None:
    """Three gloo ranks: 0 and 1 wait in an all-reduce that rank 2, alive, never enters (as a failed rank the agent
    could not reach to kill). Ranks 0 and 1 run Megatron's abort watcher over a stand-in of the rank's state; the
    test sets the aborts. Results go to ``out`` as (rank, what happened, seconds after the failure abort).
    ``world="nccl"``: a GPU job's, its all-reduce in a gloo group beside the world's (Megatron's gloo groups); the
    world's backend is torch's ``fake`` one here (no NCCL on a CPU), which the watcher's abort leaves alone."""
    import importlib
    import threading
    import time
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_odyssey.megatron_lm.rank import AbortWatcher

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    group = None
    if world == "nccl":
        importlib.import_module("torch.testing._internal.distributed.fake_pg")  # registers the "fake" backend

        dist.init_process_group("fake", store=dist.PrefixStore("world", store), rank=rank, world_size=3)
        group = dist.new_group([0, 1, 2], backend="gloo", timeout=timedelta(seconds=120))
    else:
        dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=3,
                                timeout=timedelta(seconds=120))
    if rank == 2:
        store.wait(["done"])
        return
    runtime = SimpleNamespace(gen=0, gen_lock=threading.Lock(), backend=world, store_addr=("127.0.0.1", port),
                              ident=rank)
    AbortWatcher(runtime, "127.0.0.1", port, stuck_after_s=1.0).start()

    def next_generation() -> None:  # (the test's word: the generation the failure abort is for; a client of its own)
        dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120)).wait(["generation 1"])
        runtime.gen = 1

    threading.Thread(target=next_generation, daemon=True).start()
    store.set(f"entered/{rank}", "1")
    try:
        dist.all_reduce(torch.ones(4), group=group)
        out.put((rank, "returned", None))
    except Exception as exc:  # noqa: BLE001 - what the shut connections raise
        failed_at = float(store.get("failure abort at"))
        out.put((rank, type(exc).__name__, time.time() - failed_at))
    store.wait(["done"])  # (out of the collective, the watcher must not take this rank for stuck meanwhile)


def stuck_gloo_send_worker(rank: int, port: int, size: int, how: str = "send", posted: bool = True) -> None:
    """Two gloo ranks: rank 1 posts a receive of ``size`` floats and stops itself (SIGSTOP: alive, reading nothing),
    so rank 0's send of them fills the socket and waits with the rest of its message in gloo's transmit queue.
    Rank 0 runs Megatron's abort watcher over a stand-in of the rank's state, at step 3; the test sets the abort.
    ``how`` rank 0 sends: ``send`` (blocking, inside torch.distributed) or ``work`` (``isend``, then its handle's
    ``wait()`` from here, as this package's transport does). ``posted=False``: rank 1 stops without posting the
    receive (gloo then sends a notice only, and waits for the peer's answer as a pending send)."""
    import os
    import signal
    import threading
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_odyssey.megatron_lm.rank import AbortWatcher
    from megatron_odyssey.runtime.liveness import Progress

    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=120))
    dist.init_process_group("gloo", store=dist.PrefixStore("world", store), rank=rank, world_size=2,
                            timeout=timedelta(seconds=300))
    message = torch.zeros(size)
    if rank == 1:
        if posted:
            dist.irecv(message, 0)
        store.set("receiving", "1")
        os.kill(os.getpid(), signal.SIGSTOP)
        store.wait(["done"])
        return
    progress = Progress()
    progress.mark(3, "backward")
    runtime = SimpleNamespace(gen=0, gen_lock=threading.Lock(), backend="gloo", store_addr=("127.0.0.1", port),
                              ident=rank, progress=progress)
    AbortWatcher(runtime, "127.0.0.1", port, stuck_after_s=2.0).start()
    store.wait(["receiving"])
    store.set("sending", "1")
    try:
        if how == "send":
            dist.send(message, 1)
        else:
            work = dist.isend(message, 1)
            work.wait()
    except RuntimeError as exc:  # (woken: the connection closed)
        store.set("send raised", str(exc)[:200])
        return
    store.set("send returned", "1")  # (what the test must not see: the send stays for the group's 300 s)
