"""The standalone host: one rank of ``odyssey train`` / ``odyssey demo`` through failures.

It drives the shared protocol (:class:`~megatron_odyssey.runtime.generation.GenerationRank`) with our
own Llama-style megatron-core stage (any layer range), deterministic data and torch's Adam: each
step is pipeline executor -> per-layer gradient sync -> *ready* -> the agent's *commit* -> optimizer,
with periodic checkpoints for the restart fallback.

Run as ``python -m megatron_odyssey.standalone.trainer --config CFG --rank R --store HOST:PORT``;
normally the agent starts the ranks.
"""
from __future__ import annotations

import argparse
import functools
import json
import sys
import time
from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..runtime import weight_grad
from ..runtime.config import TrainConfig
from ..runtime.control_plane import client
from ..runtime.errors import STARTED_KEY, fail_locally, is_peer_failure, stop_now
from ..runtime.generation import GenerationRank
from ..runtime.liveness import WAITING, Heartbeat, Progress, track
from ..runtime.transport import P2P
from ..runtime.world import abort_all_groups, plan_process_groups


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
        from ..runtime.model import stage_forward

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
        stash = weight_grad.active()
        if stash is None:
            time.sleep(ctx.backward_s)
        else:  # a filled reroute's B: the weight-gradient half (the estimator's default share) waits for W
            time.sleep(ctx.backward_s / 2)
            stash.later.append(functools.partial(time.sleep, ctx.backward_s / 2))
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


class StandaloneRank(GenerationRank):
    """One rank of ``odyssey train`` (see module docstring)."""

    def __init__(self, cfg: TrainConfig, ident: int, store: dist.Store, store_addr: tuple[str, int],
                 control: Any = None):
        from ..runtime.faults import Injector

        self.cfg, self.ident, self.store, self.control = cfg, ident, store, control
        self.node, self.tp_rank = divmod(ident, cfg.tp)
        self.injector = Injector(cfg.fail_specs(), ident, store)
        self.progress = Progress()
        track(self.progress)  # marked by the executor and gradient sync around communication (liveness)
        self.store_addr = store_addr
        self.sleep_mode = cfg.sleep_forward_s is not None
        self.device = torch.device("cpu") if self.sleep_mode else _bind_device(cfg, ident)
        self.backend = cfg.backend or ("gloo" if self.sleep_mode else _default_backend(cfg.shared_device))
        self.p2p = P2P.for_backend(self.backend, self.device)
        store.set(f"odyssey/device/{ident}", f"{self.device} ({self.backend})")  # for the report
        if ident == 0 and not self.sleep_mode:  # the planner's device (the agent plans from it, see agent)
            from ..runtime.agent import DEVICE_KEY
            from ..runtime.device_profile import measure_device

            store.set(DEVICE_KEY, json.dumps(measure_device(self.device, torch.float32)))
        self.uses_parallel_state = not self.sleep_mode
        self.profiler: Any = None
        from ..runtime.data import MicroBatchData

        self.data = MicroBatchData(cfg.data_config())

    # -- the host's hooks ------------------------------------------------------------------------------
    def _build_model(self, start: int, end: int) -> None:
        """A fresh stage model on this generation's groups (state is restored into it afterwards)."""
        cfg = self.cfg
        if self.sleep_mode:
            self.model = SleepStage(cfg, start, end)
            self.runner = self.model
            self.named = list(self.model.named_global_parameters())
        else:
            from ..runtime.accelerator import seed_all
            from ..runtime.model import build_stage_model

            seed_all(cfg.seed, tp_rank=self.tp_rank)
            # built (and initialised, plan-independently) on the host, then moved to this rank's device
            self.model = build_stage_model(cfg.model_config(), start, end,
                                           pg_collection=plan_process_groups(self.groups)).to(self.device)
            if cfg.dropout:
                from ..runtime import dropout_rng

                dropout_rng.install(self.model, cfg.seed, self.tp_rank)
            self.runner = MegatronStage(self.model)
            self.named = list(self.model.named_global_parameters())
        self.optimizer = torch.optim.Adam(self.model.parameters(), lr=cfg.lr)
        self.profiler = None
        if cfg.profile_out and not self.sleep_mode:  # hooks time every unit; results are unchanged
            from ..runtime.profiler import LayerProfiler

            self.profiler = LayerProfiler(self.model, num_layers=cfg.layers, optimizer=self.optimizer,
                                          micro_batch=cfg.micro_batch).attach()

    def micro_batch(self, step: int, j: int) -> dict[str, torch.Tensor]:
        self.at(step, "data")
        return self.data.micro_batch(step, j)

    def _capture(self) -> Any:
        from ..runtime.state import capture

        return capture(self.named, self.optimizer)

    def _release(self) -> None:
        if self.profiler is not None:
            self.profiler.detach()
        self.profiler = None

    # -- steps ----------------------------------------------------------------------------------------
    def train_step(self, step: int) -> None:
        self.pending = step
        self.optimizer.zero_grad(set_to_none=True)
        result = self.executor.run_step(step, lambda: self.token_count(step),
                                        on_op=lambda phase: self.at(step, phase))
        self.at(step, "grad-sync")
        t0 = time.perf_counter()
        self.sync()
        if self.trace is not None:
            self.trace.sync_s = time.perf_counter() - t0
        self.ready_and_update(step, result.loss_sum if self.tp_rank == 0 else 0.0)
        if self.checkpoint_due(step):
            from ..runtime.state import capture, save_checkpoint

            self.settle()  # a checkpoint holds committed state only
            self.at_rest(step, "save")
            save_checkpoint(self._ckpt_root(), step, self.node, self.tp_rank, capture(self.named, self.optimizer))
            self.store.set(f"{self.k['ckpt']}/{step}/{self.ident}", "1")
        self.at_rest(step, "between")

    def _apply(self, step: int) -> None:
        self._update()
        self.committed, self.pending = step, None
        self.saved = None  # the live model now holds the newest state

    def _update(self) -> None:
        t0 = time.perf_counter()
        self.optimizer.step()
        if self.profiler is not None:
            self.profiler.observe_optimizer_step(time.perf_counter() - t0)

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
        Heartbeat(*self.store_addr, self.ident, self.cfg.heartbeat_interval_s, self.progress, self.control).start()
        self.store.set(STARTED_KEY.format(self.ident), "1")  # from now on a failure is recovered from
        self.store.check([STARTED_KEY.format(self.ident)])  # a round trip: in the store before any fault fires
        self.train_from(0)

    def join_job(self) -> None:
        """A rank started after the job (a repaired or returning machine): announce itself, wait until the agent
        admits it into a generation (``runtime.joining``), receive its stage's state from live replicas, train on."""
        from ..runtime.joining import announce, wait_for_admission

        Heartbeat(*self.store_addr, self.ident, self.cfg.heartbeat_interval_s, self.progress, self.control).start()
        announce(self.store, self.ident)
        self.progress.set_state(WAITING)
        gen, msg = wait_for_admission(self.store, self.ident)
        resume = self.enter_admitted(gen, msg)
        self.store.set(STARTED_KEY.format(self.ident), "1")
        self.train_from(resume)

    def train_from(self, step: int) -> None:
        """Train until the last step is committed, recovering in-process from peers' failures."""
        while step < self.cfg.steps or self.speculative is not None:
            failed = False
            try:
                if step < self.cfg.steps:
                    self.train_step(step)
                    step += 1
                else:
                    self.settle()  # the last step was applied ahead of its commit (staggered optimizer)
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
        from ..runtime.control_plane import DONE_KEY

        self.store.set(DONE_KEY.format(self.ident), "1")
        dist.barrier()
        dist.destroy_process_group()

    def _write_profile(self) -> None:
        """Merge every rank's measured units into one planner profile (collective; lowest rank writes)."""
        from ..runtime.device_profile import job_profile
        from ..runtime.profiler import gather_stage_profiles, merge_profiles, pipeline_p2p_s

        cfg = self.cfg
        parts = gather_stage_profiles(self.profiler.stage_profile())
        p2p = pipeline_p2p_s(self.plan, lambda n: self.rank_map.rank(n, 0), (cfg.seq, cfg.micro_batch, cfg.hidden))
        if dist.get_rank() == 0:
            merge_profiles(parts, p2p_s=p2p, base=job_profile(cfg), name="measured").save(cfg.profile_out)

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
    """This rank's device: the one of its rank (the agent starts every rank of ``odyssey train`` on one
    machine), or device 0 with ``--shared-device``."""
    from ..runtime.accelerator import bind_rank_device

    return bind_rank_device(ident, shared=cfg.shared_device)


def _default_backend(shared_device: bool = False) -> str:
    from ..runtime.accelerator import enable_cpu_mode, get_accelerator, rank_backend

    if get_accelerator().is_cpu:
        enable_cpu_mode()
    return rank_backend(shared_device)


def run(cfg: TrainConfig, rank: int, store: dist.Store, store_addr: tuple[str, int], control: Any = None) -> None:
    try:
        runtime = StandaloneRank(cfg, rank, store, store_addr, control)  # builds the dataset
    except Exception as exc:
        fail_locally(store, rank, exc, "start-up")
    runtime.main()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="one odyssey training rank (normally forked by the agent)")
    parser.add_argument("--config", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--store", required=True, help="HOST:PORT of the agent's store")
    args = parser.parse_args(argv)
    cfg = TrainConfig.load(args.config)
    host, port = args.store.rsplit(":", 1)
    store = client((host, int(port)), cfg.timeout_s)
    torch.set_num_threads(1)  # a fresh process: safe here, unlike in a forked rank
    run(cfg, args.rank, store, (host, int(port)))


if __name__ == "__main__":
    main()
