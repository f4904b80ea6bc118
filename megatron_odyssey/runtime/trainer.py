"""One rank's training loop, through failures.

Each generation: join the world of the generation's plan, build groups, (re)build the stage model
and move state into it, then step: pipeline executor -> per-layer gradient sync -> *ready* ->
wait for the agent's *commit* -> optimizer. Any communication error, or the agent's abort, sends the
rank into recovery: tear the group down at once (so peers blocked on us fail fast too), apply the
step if the agent had committed it, register, wait for the next generation's plan, and go on.

Run as ``python -m megatron_odyssey.runtime.trainer --config CFG --rank R --store HOST:PORT``
(under torchrun: ``$RANK``, ``$MASTER_ADDR:$MASTER_PORT``); normally the agent forks ranks directly.
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from .config import TrainConfig
from .errors import STARTED_KEY, exit_if_stopped, fail_locally, is_peer_failure, stop_now
from .executor import PipelineExecutor
from .grad_sync import GradientSync, params_by_unit
from .transport import P2P
from .world import (RankMap, abort_all_groups, build_plan_groups, clear_parallel_state, connect_peers, init_world,
                    install_parallel_state, peer_pairs, plan_process_groups, shut_connections)


@dataclass
class MegatronStage:
    """StageRunner over megatron-core's GPTModel for one stage."""

    model: Any

    @property
    def is_first(self) -> bool:
        return self.model.pre_process

    @property
    def is_last(self) -> bool:
        return self.model.post_process

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor:
        from .model import stage_forward

        return stage_forward(self.model, batch, input_tensor)


class _Sleep(torch.autograd.Function):
    """Identity whose forward and backward each take a set time (estimator-fidelity mode)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:  # type: ignore[override]
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx, grad: torch.Tensor):  # type: ignore[override]
        time.sleep(ctx.backward_s)
        return grad, None, None


class SleepStage(torch.nn.Module):
    """A stage whose layers sleep instead of computing, so timing has no CPU contention. It holds one
    weight per unit (embedding, each layer, output) so gradient sync runs the real per-unit groups."""

    def __init__(self, cfg: TrainConfig, layer_start: int, layer_end: int):
        super().__init__()
        self.cfg = cfg
        self.layers = layer_end - layer_start
        self.is_first = layer_start == 0
        self.is_last = layer_end == cfg.layers
        self.names = ((["embedding.sleep"] if self.is_first else [])
                      + [f"decoder.layers.{k}.sleep" for k in range(layer_start, layer_end)]
                      + (["output_layer.sleep"] if self.is_last else []))
        self.unit_weights = torch.nn.ParameterList(torch.nn.Parameter(torch.ones(cfg.hidden)) for _ in self.names)

    def named_global_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return list(zip(self.names, self.unit_weights))

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor:
        weight = torch.stack(list(self.unit_weights)).prod(0)
        if input_tensor is None:
            x = batch["tokens"].t().unsqueeze(-1).float().expand(-1, -1, self.cfg.hidden) * weight
        else:
            x = input_tensor * weight
        x = _Sleep.apply(x, self.cfg.sleep_forward_s * self.layers, self.cfg.sleep_backward_s * self.layers)
        return x.mean(-1).t() if self.is_last else x


def _node_stage(plan: ExecutionPlan, node: int) -> tuple[int, int]:
    k, i = plan.position_of()[node]
    s = plan.pipelines[k].stages[i]
    return s.layer_start, s.layer_end


class Abort(RuntimeError):
    """The agent aborted this generation (a failure elsewhere)."""


def keys(gen: int) -> dict[str, str]:
    g = f"odyssey/gen{gen}"
    return {"plan": f"{g}/plan", "abort": f"{g}/abort", "ready": f"{g}/ready", "commit": f"{g}/commit",
            "recover": f"{g}/recover", "transfer": f"{g}/transfer_s", "ckpt": f"{g}/ckpt"}


class Heartbeat(threading.Thread):
    """Proves liveness to the agent; stops with the process (SIGSTOP stops it too)."""

    def __init__(self, host: str, port: int, ident: int, interval_s: float):
        super().__init__(daemon=True, name="odyssey-heartbeat")
        self.store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))
        self.key, self.interval_s = f"odyssey/hb/{ident}", interval_s

    def run(self) -> None:
        while True:
            try:
                self.store.set(self.key, repr(time.time()))
            except Exception:  # the agent is gone: nothing left to prove liveness to
                return
            time.sleep(self.interval_s)


class RankRuntime:
    def __init__(self, cfg: TrainConfig, ident: int, store: dist.Store, store_addr: tuple[str, int]):
        from .faults import Injector

        self.cfg, self.ident, self.store = cfg, ident, store
        self.node, self.tp_rank = divmod(ident, cfg.tp)
        self.injector = Injector(cfg.fail_specs(), ident, store)
        self.store_addr = store_addr
        self.sleep_mode = cfg.sleep_forward_s is not None
        self.device = torch.device("cpu") if self.sleep_mode else _bind_device(cfg, ident)
        self.backend = cfg.backend or ("gloo" if self.sleep_mode else _default_backend(cfg.shared_device))
        self.p2p = P2P.for_backend(self.backend, self.device)
        store.set(f"odyssey/device/{ident}", f"{self.device} ({self.backend})")  # for the report
        if ident == 0 and not self.sleep_mode:  # the planner's device (the agent plans from it, see agent)
            from .agent import DEVICE_KEY
            from .device_profile import measure_device

            store.set(DEVICE_KEY, json.dumps(measure_device(self.device, torch.float32)))
        self.gen = 0
        self.model: Any = None
        self.optimizer: torch.optim.Optimizer | None = None
        self.committed = -1
        self.pending: int | None = None
        self.saved: Any = None  # state captured at teardown, restored into the next generation's model
        self.named: list = []
        from .data import MicroBatchData

        self.data = MicroBatchData(cfg.data_config())

    # -- generations --------------------------------------------------------------------------------
    def enter(self, gen: int, plan: ExecutionPlan, policy: str, transfers: list, checkpoint_step: int | None) -> None:
        from . import state as st

        cfg = self.cfg
        self.gen, self.plan, self.k = gen, plan, keys(gen)
        self.rank_map = RankMap.for_plan(plan, cfg.tp)
        if self.node not in self.rank_map.live_nodes:  # not part of this generation: nothing left to do
            sys.exit(0)
        rank = self.rank_map.rank(self.node, self.tp_rank)
        if gen > 0:
            self._join(gen)
        marks = [time.perf_counter()]
        init_world(self.store, gen, rank, self.rank_map.world_size, self.backend, cfg.timeout_s)
        marks.append(time.perf_counter())
        self.groups = build_plan_groups(plan, self.rank_map, rank)
        if self.backend != "gloo":  # NCCL/HCCL open pair communicators lazily: open them in one global order
            connect_peers(peer_pairs(plan, self.rank_map, transfers), rank, self.p2p, self.device)
        if not self.sleep_mode:
            install_parallel_state(self.groups)
        marks.append(time.perf_counter())
        old = self.saved  # kept until this generation commits a step: a failure before that restarts from it
        self._build_model(*_node_stage(plan, self.node))
        marks.append(time.perf_counter())
        t0 = time.perf_counter()
        if policy == "restart":
            if checkpoint_step is not None and checkpoint_step >= 0:
                st.restore(self.named, self.optimizer, st.load_checkpoint(self._ckpt_root(), checkpoint_step,
                                                                          self.tp_rank, dict(self.named), self.device))
        elif old is not None:
            received = st.transfer(transfers, self.node, self.tp_rank, self.rank_map.rank, cfg.layers, old,
                                   {n: p.shape for n, p in self.named}, self.device, self.p2p)
            st.restore(self.named, self.optimizer, {**old, **received})
        self.store.set(f"{self.k['transfer']}/{self.ident}", repr(time.perf_counter() - t0))
        self.store.set(f"odyssey/gen{gen}/rebuild/{self.ident}", json.dumps(
            {"world_s": marks[1] - marks[0], "groups_s": marks[2] - marks[1], "model_s": marks[3] - marks[2]}))
        self.executor = PipelineExecutor(plan, self.groups, self.runner, self.data.micro_batch,
                                         (cfg.seq, cfg.micro_batch, cfg.hidden), device=self.device, p2p=self.p2p)
        self.sync = GradientSync(plan, self.groups, params_by_unit(self.named, cfg.layers))

    def _join(self, gen: int) -> None:
        """Wait until the agent saw every member of ``gen`` alive and joining (or aborted ``gen``), so a
        member that dies now cannot strand the others inside the process-group rendezvous."""
        self.store.set(f"odyssey/gen{gen}/join/{self.ident}", "1")
        go, abort = f"odyssey/gen{gen}/go", f"odyssey/gen{gen}/abort"
        deadline = time.monotonic() + self.cfg.timeout_s
        while not self.store.check([go]):
            if self.store.check([abort]):
                exit_if_stopped(self.store, self.ident)
                raise Abort(self.store.get(abort).decode())
            if time.monotonic() > deadline:
                raise TimeoutError(f"generation {gen} never started")
            time.sleep(0.002)

    def _build_model(self, start: int, end: int) -> None:
        """A fresh stage model on this generation's groups (state is restored into it afterwards)."""
        cfg = self.cfg
        if self.sleep_mode:
            self.model = SleepStage(cfg, start, end)
            self.runner = self.model
            self.named = list(self.model.named_global_parameters())
        else:
            from .accelerator import seed_all
            from .model import build_stage_model

            seed_all(cfg.seed, tp_rank=self.tp_rank)
            # built (and initialised, plan-independently) on the host, then moved to this rank's device
            self.model = build_stage_model(cfg.model_config(), start, end,
                                           pg_collection=plan_process_groups(self.groups)).to(self.device)
            self.runner = MegatronStage(self.model)
            self.named = list(self.model.named_global_parameters())
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.profiler = None
        if cfg.profile_out and not self.sleep_mode:  # hooks time every unit; results are unchanged
            from .profiler import LayerProfiler

            self.profiler = LayerProfiler(self.model, num_layers=cfg.layers, optimizer=self.optimizer,
                                          micro_batch=cfg.micro_batch).attach()

    def _ckpt_root(self) -> str:
        return os.path.join(self.cfg.workdir or ".", "checkpoints")

    # -- steps ----------------------------------------------------------------------------------------
    def token_count(self, step: int) -> float:
        """Loss tokens in the whole global batch of ``step`` (any rank can compute it)."""
        return float(sum(self.data.micro_batch(step, j)["loss_mask"].sum() for j in range(self.cfg.num_micro_batches)))

    def train_step(self, step: int) -> None:
        self.pending = step
        self.optimizer.zero_grad(set_to_none=True)
        phase = {"F": "forward", "B": "backward"}
        result = self.executor.run_step(step, lambda: self.token_count(step),
                                        on_op=lambda kind: self.injector(step, phase[kind]))
        self.injector(step, "grad-sync")
        self.sync()
        self.store.set(f"{self.k['ready']}/{step}/{self.ident}", repr(result.loss_sum if self.tp_rank == 0 else 0.0))
        self._wait_commit(step)
        self.injector(step, "optimizer")
        self._apply(step)
        interval = self.cfg.checkpoint_interval
        if interval and (step + 1) % interval == 0:
            from .state import capture, save_checkpoint

            save_checkpoint(self._ckpt_root(), step, self.node, self.tp_rank, capture(self.named, self.optimizer))
            self.store.set(f"{self.k['ckpt']}/{step}/{self.ident}", "1")

    def _apply(self, step: int) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        if getattr(self, "profiler", None) is not None:
            self.profiler.observe_optimizer_step(time.perf_counter() - t0)
        self.committed, self.pending = step, None
        self.saved = None  # the live model now holds the newest state

    def _wait_commit(self, step: int) -> None:
        commit, abort = f"{self.k['commit']}/{step}", self.k["abort"]
        while True:
            if self.store.check([commit]):
                return
            if self.store.check([abort]):
                exit_if_stopped(self.store, self.ident)  # the agent gave up: no plan will follow
                raise Abort(self.store.get(abort).decode())
            time.sleep(0.001)

    # -- recovery -------------------------------------------------------------------------------------
    def recover(self, step: int) -> int:
        """Leave the broken generation and join the next one; returns the step to resume at."""
        if self.pending is not None and self.store.check([f"{self.k['commit']}/{self.pending}"]):
            self._apply(self.pending)  # the agent committed it before the failure: keep it
        self.pending = None
        while True:
            # register first: the agent seals membership while we clean up
            self.store.set(f"{self.k['recover']}/{self.ident}", str(self.committed))
            self.teardown()
            try:
                self.injector(step, "recovery")
                msg = self._wait_plan(self.gen + 1)
                self.enter(self.gen + 1, ExecutionPlan.from_dict(msg["plan"]), msg["policy"],
                           [tuple(t) for t in msg["transfers"]], msg.get("checkpoint_step"))
                return int(msg["resume_step"])
            except Exception as exc:  # another failure while setting up: recover again, unless it is ours
                if not is_peer_failure(exc, self.store, self.gen):
                    fail_locally(self.store, self.ident, exc, f"recovery into generation {self.gen + 1}")
                abort_all_groups()

    def _wait_plan(self, gen: int) -> dict:
        """The agent's plan for generation ``gen``; exits at once if the agent gives up instead."""
        nxt = keys(gen)["plan"]
        deadline = time.monotonic() + self.cfg.timeout_s
        while True:  # polled: a failure must never leave us waiting on a lost wake-up
            exit_if_stopped(self.store, self.ident)
            if self.store.check([nxt]):
                return json.loads(self.store.get(nxt))
            if time.monotonic() > deadline:
                raise TimeoutError(f"no plan for generation {gen} after {self.cfg.timeout_s} s")
            time.sleep(0.005)

    def teardown(self) -> None:
        """Close this generation's connections now, so peers blocked on us fail at once instead of
        waiting out a timeout: abort every group first, then capture the state and drop every
        holder of a group (a destroyed but still referenced gloo group keeps its sockets open)."""
        from .state import capture

        abort_all_groups()
        if self.backend == "gloo":  # peers blocked on us fail now (see shut_connections)
            shut_connections({self.store_addr[1]})
        if self.saved is None and self.model is not None:
            self.saved = capture(self.named, self.optimizer)
        if getattr(self, "profiler", None) is not None:
            self.profiler.detach()
        self.model = self.runner = self.executor = self.sync = self.groups = self.optimizer = self.profiler = None
        self.named = []
        if not self.sleep_mode:
            clear_parallel_state()
        try:
            dist.destroy_process_group()
        except Exception:  # already torn down by a previous failure
            pass
        gc.collect()  # a group still referenced from a cycle keeps its sockets open: peers would wait

    def main(self) -> None:
        plan = self.cfg.validate()
        try:
            self.enter(0, plan, "initial", [], None)
        except Exception as exc:  # start-up: the agent ends the job with the first real error
            if is_peer_failure(exc):
                stop_now(self.ident, f"start-up failed with a peer ({type(exc).__name__}: {str(exc)[:200]})", 1)
            fail_locally(self.store, self.ident, exc, "start-up")
        # Heartbeats start once set-up (dataset building holds the GIL for seconds) is done; until
        # then the agent judges the rank by its process alone.
        Heartbeat(*self.store_addr, self.ident, self.cfg.heartbeat_interval_s).start()
        self.store.set(STARTED_KEY.format(self.ident), "1")  # from now on a failure is recovered from
        self.store.check([STARTED_KEY.format(self.ident)])  # a round trip: in the store before any fault fires
        step = 0
        while step < self.cfg.steps:
            failed = False
            try:
                self.train_step(step)
                step += 1
            except Exception as exc:
                if not is_peer_failure(exc, self.store, self.gen):
                    fail_locally(self.store, self.ident, exc, f"step {step}")  # ours: report it and leave
                abort_all_groups()  # at once: peers blocked on us fail now, not after our clean-up
                failed = True
                print(f"[rank {self.ident}] step {step}: {type(exc).__name__} at {time.time():.3f}; recovering",
                      file=sys.stderr, flush=True)
            if failed:  # outside the except block: the traceback's frames (pending sends) are gone
                step = self.recover(step)
        self.finish()

    def finish(self) -> None:
        if self.profiler is not None:
            self._write_profile()
        state = self.gathered_state() if self.cfg.save_params else None
        if dist.get_rank() == 0 and self.cfg.save_params:
            torch.save(state, self.cfg.save_params)
        self.store.set(f"odyssey/done/{self.ident}", "1")
        dist.barrier()
        dist.destroy_process_group()

    def _write_profile(self) -> None:
        """Merge every rank's measured units into one planner profile (collective; lowest rank writes)."""
        from .cpu_profile import estimated_profile
        from .profiler import gather_stage_profiles, merge_profiles, pipeline_p2p_s

        cfg = self.cfg
        parts = gather_stage_profiles(self.profiler.stage_profile())
        p2p = pipeline_p2p_s(self.plan, lambda n: self.rank_map.rank(n, 0), (cfg.seq, cfg.micro_batch, cfg.hidden))
        if dist.get_rank() == 0:
            merge_profiles(parts, p2p_s=p2p, base=estimated_profile(cfg), name="measured").save(cfg.profile_out)

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """The full model by global name, at the lowest surviving rank (collective over the world)."""
        if self.sleep_mode:
            local = {n: p.detach().clone() for n, p in self.model.named_global_parameters()}
        else:
            local = self.model.global_state_dict(gather=True)
        mine = {n: t.cpu() for n, t in local.items()} if self.tp_rank == 0 else {}
        gathered: list[Any] | None = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(mine, gathered, dst=0)
        out: dict[str, torch.Tensor] = {}
        for part in gathered or []:
            for name, t in part.items():
                out.setdefault(name, t)
        return out


def _bind_device(cfg: TrainConfig, ident: int) -> torch.device:
    """This rank's device: its local rank's (``$LOCAL_RANK`` under torchrun, else its rank: the agent
    starts every rank of ``odyssey train`` on one machine), or device 0 with ``--shared-device``."""
    from .accelerator import bind_rank_device

    return bind_rank_device(int(os.environ.get("LOCAL_RANK", ident)), shared=cfg.shared_device)


def _default_backend(shared_device: bool = False) -> str:
    from .accelerator import enable_cpu_mode, get_accelerator, rank_backend

    if get_accelerator().is_cpu:
        enable_cpu_mode()
    return rank_backend(shared_device)


def run(cfg: TrainConfig, rank: int, store: dist.Store, store_addr: tuple[str, int]) -> None:
    try:
        runtime = RankRuntime(cfg, rank, store, store_addr)  # builds the dataset
    except Exception as exc:
        fail_locally(store, rank, exc, "start-up")
    runtime.main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one odyssey training rank (normally forked by the agent)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun)")
    parser.add_argument("--store", default=None, help="HOST:PORT of the agent's store (default $MASTER_ADDR:$MASTER_PORT)")
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    host, port = (args.store or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    torch.set_num_threads(1)  # a fresh process (torchrun): safe here, unlike in a forked rank
    run(cfg, rank, store, (host, int(port)))


if __name__ == "__main__":
    main()
