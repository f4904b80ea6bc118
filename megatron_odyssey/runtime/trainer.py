"""One rank's training loop: build the world and groups for the plan, the stage model, the data,
then step: pipeline executor -> per-layer gradient sync -> optimizer (torch Adam on fp32 params).

Run as ``python -m megatron_odyssey.runtime.trainer --config CFG --rank R --store HOST:PORT``;
the launcher (``odyssey train``) starts one per process and hosts the store.
"""
from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..planning.plan import ExecutionPlan
from .config import TrainConfig
from .executor import PipelineExecutor
from .grad_sync import GradientSync, params_by_unit
from .world import PlanGroups, RankMap, build_plan_groups, init_world, install_parallel_state, plan_process_groups


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
    """A stage whose layers sleep instead of computing, so timing has no CPU contention."""

    def __init__(self, cfg: TrainConfig, layer_start: int, layer_end: int):
        super().__init__()
        self.cfg = cfg
        self.layers = layer_end - layer_start
        self.is_first = layer_start == 0
        self.is_last = layer_end == cfg.layers
        self.weight = torch.nn.Parameter(torch.ones(cfg.hidden))

    def forward(self, batch: Mapping[str, torch.Tensor], input_tensor: torch.Tensor | None) -> torch.Tensor:
        if input_tensor is None:
            x = batch["tokens"].t().unsqueeze(-1).float().expand(-1, -1, self.cfg.hidden) * self.weight
        else:
            x = input_tensor * self.weight
        x = _Sleep.apply(x, self.cfg.sleep_forward_s * self.layers, self.cfg.sleep_backward_s * self.layers)
        return x.mean(-1).t() if self.is_last else x


def _node_stage(plan: ExecutionPlan, node: int) -> tuple[int, int]:
    k, i = plan.position_of()[node]
    s = plan.pipelines[k].stages[i]
    return s.layer_start, s.layer_end


class RankTrainer:
    def __init__(self, cfg: TrainConfig, plan: ExecutionPlan, groups: PlanGroups):
        from .data import MicroBatchData

        self.cfg, self.plan, self.groups = cfg, plan, groups
        start, end = _node_stage(plan, groups.node)
        if cfg.sleep_forward_s is not None:
            self.model = SleepStage(cfg, start, end)
            self.runner = self.model
            named = [(f"decoder.layers.{start}.sleep", self.model.weight)]
        else:
            from .accelerator import seed_all
            from .model import build_stage_model

            seed_all(cfg.seed, tp_rank=groups.tp_rank)
            self.model = build_stage_model(cfg.model_config(), start, end, pg_collection=plan_process_groups(groups))
            self.runner = MegatronStage(self.model)
            named = list(self.model.named_global_parameters())
        self.data = MicroBatchData(cfg.data_config())
        self.executor = PipelineExecutor(plan, groups, self.runner, self.data.micro_batch,
                                         (cfg.seq, cfg.micro_batch, cfg.hidden))
        self.sync = GradientSync(plan, groups, params_by_unit(named, cfg.layers))
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self._token_counts: dict[int, float] = {}

    def token_count(self, step: int) -> float:
        """Loss tokens in the whole global batch of ``step`` (any rank can compute it)."""
        if step not in self._token_counts:
            self._token_counts[step] = float(sum(self.data.micro_batch(step, j)["loss_mask"].sum()
                                                 for j in range(self.cfg.num_micro_batches)))
        return self._token_counts[step]

    def step(self, step: int) -> dict[str, float]:
        t0 = time.perf_counter()
        self.optimizer.zero_grad(set_to_none=True)
        result = self.executor.run_step(step, self.token_count(step))
        t_pipe = time.perf_counter()
        self.sync()
        self.optimizer.step()
        loss = torch.tensor([result.loss_sum if self.groups.tp_rank == 0 else 0.0], dtype=torch.float64)
        dist.all_reduce(loss)
        return {"loss": float(loss), "time_s": time.perf_counter() - t0, "pipeline_s": t_pipe - t0}

    def gathered_state(self) -> dict[str, torch.Tensor]:
        """The full model by global name, at the lowest rank (a collective: every rank calls it)."""
        if isinstance(self.model, SleepStage):
            local = {f"sleep.{self.groups.node}": self.model.weight.detach().clone()}
        else:
            local = self.model.global_state_dict(gather=True)
        mine = local if self.groups.tp_rank == 0 else {}
        gathered: list[Any] = [None] * dist.get_world_size() if dist.get_rank() == 0 else None  # type: ignore[assignment]
        dist.gather_object(mine, gathered, dst=0)
        out: dict[str, torch.Tensor] = {}
        for part in gathered or []:
            for name, t in part.items():
                out.setdefault(name, t)
        return out


def run(cfg: TrainConfig, rank: int, store: dist.Store) -> None:
    plan = cfg.validate()
    rank_map = RankMap.for_plan(plan, cfg.tp)
    if cfg.sleep_forward_s is None:
        from .accelerator import dist_backend, enable_cpu_mode, get_accelerator

        if get_accelerator().is_cpu:
            enable_cpu_mode()
        backend = cfg.backend or dist_backend()
    else:
        backend = cfg.backend or "gloo"
    init_world(store, 0, rank, rank_map.world_size, backend, cfg.timeout_s)
    groups = build_plan_groups(plan, rank_map, rank)
    if cfg.sleep_forward_s is None:
        install_parallel_state(groups)
    trainer = RankTrainer(cfg, plan, groups)
    steps = []
    for step in range(cfg.steps):
        stats = trainer.step(step)
        steps.append({"step": step, "loss": stats["loss"], "time_s": stats["time_s"], "plan_id": plan.plan_id,
                      "alive": rank_map.world_size})
        if rank == 0:
            print(f"step {step} loss {stats['loss']:.6f} time {stats['time_s']:.3f}s", flush=True)
    state = trainer.gathered_state() if cfg.save_params else None
    if rank == 0:
        if cfg.save_params:
            torch.save(state, cfg.save_params)
        if cfg.report:
            with open(cfg.report, "w") as f:
                json.dump({"steps": steps, "failures": [], "plan": plan.to_dict()}, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one odyssey training rank (started by `odyssey train`)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, default=None, help="default: $RANK (torchrun)")
    parser.add_argument("--store", default=None, help="HOST:PORT of the agent's store (default $MASTER_ADDR:$MASTER_PORT)")
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    rank = args.rank if args.rank is not None else int(os.environ["RANK"])
    host, port = (args.store or f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}").rsplit(":", 1)
    store = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    torch.set_num_threads(1)
    run(cfg, rank, store)


if __name__ == "__main__":
    main()
