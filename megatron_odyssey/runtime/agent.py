"""The agent: hosts the control store, starts the local ranks, detects failures and coordinates
recovery. It never trains, so no rank's death can take the store or the coordination with it.

It runs in a fresh process (``python -m megatron_odyssey.runtime.agent``). On the CPU it imports
torch and megatron-core once and forks the ranks while still single-threaded (they inherit the
imports; the store's server starts only afterwards). On a GPU or NPU it spawns them instead: a CUDA
(or NPU) runtime cannot be used in a child forked after the parent touched it, and even asking
``torch.cuda.is_available()`` does. Then it loops:

- **detection**: a rank's process exited, or its heartbeat went stale (a hung rank), which the agent
  fences with SIGKILL so it cannot come back half-alive;
- **commit**: step ``t`` is committed (``commit/t``) only when every live rank has synchronised its
  gradients (``ready/t``); after a failure the generation is aborted instead, so a step is either
  applied by every survivor or redone by all of them;
- **membership**: after a failure the survivor set is sealed only when every rank has registered or
  is dead/fenced;
- **decision**: the planner (plan cache for single failures) picks reroute / reconfigure / restart;
  the agent publishes the next generation's plan, transfer schedule and resume step;
- **report**: per-step loss and time, and per failure its detection, decision, transfer and
  recovery times.

A rank that exits after a *local* error (:mod:`.errors`) left a record: the agent prints it with
its traceback and recovers without the rank, but stops the job when the same error (type and
place) recurs on another rank, or when a rank fails before finishing start-up. Whenever it gives
up it publishes ``odyssey/giveup`` (every rank's waiting loop exits on it at once) and stops the ranks.

What the agent decides with is kept in modules of their own: who is at fault for a stop in progress
(:mod:`.progress_judge`), whether a silent process stopped or starved (:mod:`.process_probe`), what a slow node
calls for (:mod:`.slow_nodes`), the loss a step commits (:mod:`.step_loss`), the report's records
(:mod:`.job_report`), the write-ahead to the standby (:mod:`.control_plane`) and ranks that join
(:mod:`.joining`); the agent owns the processes, the store and the generations.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import threading
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from ..arguments import ends_after
from ..planning.cluster import node_ranks
from ..planning.errors import PlanningError
from ..planning.estimator import fragile
from ..planning.plan import ExecutionPlan
from ..planning.cache import PlanCache
from ..planning.planner import Candidate, Decision, Planner, PlannerOptions
from ..planning.schedule import overlapped_nodes
from ..planning.sharding import lost_units
from .config import TrainConfig
from .control_plane import DISMISSED_KEY, TAKEOVER_KEY, Deposed, Replica, ReplicaLost, free_port, serve
from .quorum import GONE, NoQuorum, Quorum, Witness, standby_check
from .plan_message import checkpoint_due, encode_plan_message
from .liveness import COMM, WAITING, Beat
from .process_probe import SilenceJudge
from .progress_judge import ProgressJudge, Stall
from .rank_exits import RankExits
from .diagnosis import DiagnosisOptions, judged_summary
from . import reachability
from .drop_gate import PendingDrop, commit_value
from .slow_nodes import Action, DiagnosisRecord, SlowNodes
from .joining import ADMIT_KEY, REJOIN_KEY, JoinRecord, JoinRequests, publish_job
from .step_log import StepLog, resident_mb
from .step_loss import committed_loss, ready_shares
from .job_report import FailureRecord, failure_entries, host_summary, takeover_entries, write_report_file
from .errors import (ABORTED, DUMP_STACKS_KEY, GIVEUP_KEY, STACKS_ASKED_KEY, STARTED_KEY, STOP_LINE, ErrorRecord,
                     describe_exit, failure_abort,
                     dump_stacks_on_signals, indented, rank_log_stack, rank_log_traceback, read_error)


def rank_start_method(cfg: TrainConfig) -> str:
    """``fork`` on the CPU (ranks inherit the imports: seconds saved per rank), ``spawn`` on an
    accelerator (no fork after the device runtime is initialised)."""
    if cfg.sleep_forward_s is not None:
        return "fork"
    from .accelerator import detect_device_type

    return "fork" if detect_device_type() == "cpu" else "spawn"


DEVICE_KEY = "odyssey/device_info"  # rank 0's measured device (odyssey train), JSON
DEPOSED_EXIT = 3  # an agent the standby took over from leaves with this code
STEPPED_DOWN_EXIT = 4  # an agent or standby on the smaller side of a partition leaves with this code (runtime.quorum)
# after a takeover, how long a rank's heartbeat may take to reach the new agent: its new store client costs a reverse
# lookup of the address in c10d, where one dropped DNS packet costs the resolver's 5 s (control_plane.serve)
TAKEOVER_RECONNECT_S = 10.0
REACH_ASKS = 2  # a reachability round asks a machine through this many of its ranks at most, one after the other


def preload(sleep_mode: bool) -> None:
    """Import what every forked rank needs before forking (the point of forking)."""
    import torch  # noqa: F401
    import torch.distributed  # noqa: F401

    from . import state  # noqa: F401
    from ..standalone import trainer  # noqa: F401

    if not sleep_mode:
        from . import accelerator, data, model  # noqa: F401


def native_threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else 1


def _rank_main(cfg_path: str, ident: int, port: int, log_path: str, echo: bool) -> None:
    """Body of a forked rank: own log file, own store client, then train."""
    import torch.distributed as dist


    log = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    if not echo:
        os.dup2(log, 1)
    os.dup2(log, 2)
    # no torch.set_num_threads here: OpenMP is not fork-safe; the agent runs with OMP_NUM_THREADS=1
    cfg = TrainConfig.load(cfg_path)
    dump_stacks_on_signals(cfg.stack_dump_signal)  # into the log just opened
    store = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=cfg.timeout_s))
    from ..standalone.trainer import run
    from .control_plane import ControlPlane, judged_lost_after, parse_address

    standby = cfg.extra.get("control", {}).get("standby")
    control = (ControlPlane(("127.0.0.1", port), parse_address(standby), ident, cfg.timeout_s,
                            judged_lost_after(cfg.heartbeat_timeout_s)) if standby else None)
    if control is not None:
        control.ready()  # (this main thread's client of the standby's store, for a takeover)
    run(cfg, ident, store, ("127.0.0.1", port), control)


class Agent:
    def __init__(self, cfg: TrainConfig, cfg_path: Path | None, workdir: Path, echo_rank0: bool = True,
                 procs: dict[int, Any] | None = None, store: Any = None):
        """``procs``/``store`` given: the ranks were started elsewhere (the Megatron-LM launcher), and
        the agent only supervises them; otherwise it forks its own ranks (``odyssey train``)."""
        self.external = procs is not None
        self.cfg, self.cfg_path, self.workdir, self.echo = cfg, cfg_path, workdir, echo_rank0
        self.plan = cfg.validate()
        self.state_plan = self.plan  # layout of the newest committed state (what survivors hold)
        self.state_gen = 0  # the generation that committed it (its optimizer state's scheme: see _lost_shards)
        # the optimizer state is sharded: generation 0's distributed optimizer, then replicated shards (_lost_shards)
        self.sharded_state = bool(cfg.extra.get("distopt_instances"))
        self.ended_by: dict[str, Any] | None = None  # the script's own end of the job, for the report
        self.gen = 0
        self.started_gen = True  # generation 0 needs no join barrier
        self.store = store  # created after the ranks are forked (see run) unless given
        self.procs: dict[int, Any] = dict(procs or {})
        self.dead: set[int] = set()
        self.fenced: set[int] = set()
        self.termination: Any = None  # odyssey-launch's Termination: a signal stops the job (its .signum, .reason)
        # a rank fenced for missed heartbeats -> its last heartbeat; for a stop in progress -> its last progress
        self.silent_since: dict[int, float] = {}
        self.silence = SilenceJudge(cfg.heartbeat_timeout_s, self.log)  # a silent rank: stopped, or starved?
        # how each rank left or is leaving: on purpose, finished, or how it ended (said on the terminal)
        self.exits = RankExits(self.procs, cfg.hard_timeout_s, self.log, self.log_error, self._last_traceback,
                               store)
        # committed steps go to disk as they commit (beside the report, else in the workdir)
        self.steps = StepLog(Path(cfg.report).with_suffix(".steps.jsonl") if cfg.report else workdir / "steps.jsonl")
        self.failures: list[FailureRecord] = []
        self.started = time.time()
        self.next_step = int(cfg.extra.get("start_step", 0))  # a Megatron job may resume from --load
        self.step_started = time.time()
        self.checkpoints: dict[int, set[int]] = {}  # step -> idents expected to write it
        self.phases = {(s.rank, s.step): s.phase for s in cfg.fail_specs()}
        from .device_profile import job_profile

        self.options = PlannerOptions(tp=cfg.tp, stagger=cfg.stagger,
                                      **({"mtbf_hours": cfg.mtbf_hours} if cfg.mtbf_hours else {}))
        # analytic, on the device rank 0 measured (CPU constants on CPU): see runtime/device_profile.py
        self.profile = job_profile(cfg, **cfg.extra.get("profile_overrides", {}))
        self.planner = Planner(self.profile, cfg.global_batch, cfg.micro_batch, self.options)
        self.cache: PlanCache | None = None  # decisions for the current layout, filled in the background
        self.cache_depth = int(cfg.extra.get("max_cached_failures", 1))
        self.profile_iters = int(cfg.extra.get("profile_iters", 0))  # > 0: plan from measured times
        self.measured = False
        self.errors: dict[int, ErrorRecord] = {}  # rank -> the local error it left the job with
        self.stop_reason = ""  # why recover() could not go on
        self.ramp_skipped: set[tuple[str, tuple[int, ...]]] = set()  # actions not taken inside a batch-size ramp
        self.beats: dict[int, Beat] = {}  # rank -> its last heartbeat (liveness and progress)
        self.admitted_at: dict[int, float] = {}  # joined ranks -> when admitted (their silence counts from then)
        self.unexplained = ""  # why every rank left for a recovery nobody called (see _left_waiting): the job stops
        self.named_mismatch: set[tuple[int, int]] = set()  # (generation, step) whose ready shares did not match
        self._members: tuple[Any, list[int]] = (None, [])  # (plan, its ranks): see members()
        self.beats_read = 0.0  # when the heartbeats were last read (at most every half interval)
        # who is at fault for a stop in progress, by the ranks' progress (named at the soft timeout, fenced at the hard)
        self.progress = ProgressJudge(cfg.soft_timeout_s, cfg.hard_timeout_s, cfg.first_step_timeout_s, self.log,
                                      self._dump_stacks)
        self.warm = False  # a step of this generation has committed (its first step warms up: not judged)
        self.replica: Replica | None = None  # the standby's copy of this agent's state (control_plane)
        self.replicated: frozenset[int] = frozenset()  # the ranks of the newest generation the standby acknowledged
        self.quorum: Quorum | None = None  # the standby was lost silently: whom a new generation needs (runtime.quorum)
        self.witness: Witness | None = None  # odyssey-launch --witness-dir: who takes a tie of a partition
        self.published: dict[str, Any] | None = None  # this generation's plan message, as published
        self.takeover_at = 0.0  # this agent took over from a lost one (its ranks' heartbeats come back now)
        # the C4D-style diagnosis of the ranks' operation records, and what the planner does about it
        self.slow_nodes = SlowNodes(cfg.tp, DiagnosisOptions(**cfg.extra.get("diagnosis", {})), cfg.slow_action)
        self.replans: list[FailureRecord] = []  # generations started to rebalance (not failures): their timings
        self.pending_action: Action | None = None  # what the diagnosis asks for, done between agent passes
        self.said_diagnoses = 0  # diagnoses already said on the terminal
        # a standby's inheritance: the lost agent's diagnoses and joins, as report entries (restore; the entry of a
        # drop it left waiting is a live record again)
        self.restored_records: dict[str, list[Any]] = {"diagnoses": [], "joins": []}
        self.join_requests = JoinRequests()  # ranks that asked to join the running job (runtime.joining)
        self.joins: list[JoinRecord] = []
        self.join_polled = 0.0
        self.held: set[int] = set()  # joining ranks the planner holds as standbys (for the current plan)
        self.rejoin = [dict(r) for r in cfg.extra.get("rejoin", [])]  # --rejoin R@S: the agent starts them
        self.joiners: dict[int, Any] = {}  # their processes by rank (stopped with the job if never admitted)
        self.exits_at: dict[int, int] = {}  # launched joiners: how much of the exit log predates their request
        self.redo_between = True  # the last recovery's survivors were all in one call between iterations
        self.dropping: dict[int, DiagnosisRecord] = {}  # ranks fenced because the planner dropped their slow node
        self.pending_drop: PendingDrop | None = None  # a drop decided, waiting for the others inside the next step
        self.reach_round = 0  # rounds of runtime.reachability asked so far
        self.reach_asked: set[tuple[int, tuple[int, ...]]] = set()  # (generation, waiting ranks) a round was asked for
        # the members every other member has waited for to join this generation, and since when (_not_joining)
        self.joining_late: tuple[int, tuple[int, ...], float] | None = None
        self.joining_named: set[tuple[int, int]] = set()  # (generation, rank) named at the soft timeout
        self.joining_looked = 0.0
        self.drop_on_standby = False  # the standby's copy names a drop (waiting, or being fenced)
        self.fence_on_takeover: list[int] = []  # a standby's: the lost agent was fencing these dropped ranks

    # -- bookkeeping ----------------------------------------------------------------------------------
    def members(self) -> list[int]:
        """The current plan's ranks (computed once per plan: the loop asks several times per pass)."""
        if self._members[0] is not self.plan:
            self._members = (self.plan, node_ranks(self.plan.live_nodes(), self.cfg.tp))
        return list(self._members[1])

    def key(self, name: str) -> str:
        return f"odyssey/gen{self.gen}/{name}"

    def alive(self, ident: int) -> bool:
        return ident not in self.dead and self.procs[ident].exitcode is None

    def log(self, msg: str) -> None:
        print(f"[odyssey agent] {msg}", flush=True)

    def log_error(self, msg: str) -> None:
        """Errors go to stderr: the launcher shows it on the terminal (and in its failure message)."""
        print(f"[odyssey agent] {msg}", file=sys.stderr, flush=True)

    def stop_line(self, reason: str) -> None:
        print(STOP_LINE + reason, file=sys.stderr, flush=True)

    # -- main loop ------------------------------------------------------------------------------------
    def run(self, standby: tuple[str, int] | None = None) -> int:
        """``standby``: the standby agent's store, connected only after the ranks are forked: a forked rank
        inherits every socket of this process, and its teardown (``world.shut_connections``) shuts down all
        but the agent's store, which would cut this agent's write-ahead connection to the standby."""
        if not self.external:
            self._fork_ranks()
        if standby is not None:
            self.attach_replica(standby)
        self.started = self.step_started = time.time()  # the report's clock: the ranks start now
        return self.supervise()

    def _fork_ranks(self) -> None:
        method = rank_start_method(self.cfg)
        if method == "fork":
            # Fork while this process has a single thread: a child of a multi-threaded parent can
            # inherit a lock some other thread held (malloc, the store's server loop) and hang.
            preload(self.cfg.sleep_forward_s is not None)
            if native_threads() != 1:
                self.log(f"warning: forking ranks with {native_threads()} threads alive")
        control = self.cfg.extra.get("control", {})
        port = int(control["primary"].rsplit(":", 1)[1]) if "primary" in control else free_port()
        # a gloo error otherwise symbolises a C++ backtrace (seconds on a loaded machine) on every rank
        os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
        ctx = mp.get_context(method)
        for ident in self.members():
            p = ctx.Process(target=_rank_main, name=f"rank{ident}",
                            args=(str(self.cfg_path), ident, port, str(self.workdir / f"rank{ident}.log"),
                                  self.echo and ident == 0))
            p.start()
            self.procs[ident] = p
        self.store = serve("127.0.0.1", port, self.cfg.timeout_s)
        self.exits.store = self.store
        self.port = port
        publish_job(self.store, Path(self.cfg_path).read_text(), self.workdir, port)  # for ranks that join later
        for spec in self.rejoin:
            self._start_joiner(int(spec["rank"]))
    def supervise(self) -> int:
        """Detect, commit, recover until every rank has exited; returns the job's exit code."""
        try:
            code = self._supervise()
        except Deposed as exc:
            self.log(f"deposed: the standby agent took over ({exc}); leaving the ranks to it")
            sys.stdout.flush()
            os._exit(DEPOSED_EXIT)  # no atexit: it would wait for the ranks, which are the standby's now
        except NoQuorum as exc:
            self.step_down(str(exc))
        except Exception as exc:  # a bug in the agent itself (planner, report...): stop the job now, say why
            self.log_error("internal error, stopping the job:\n" + traceback.format_exc())
            self.give_up(f"the agent failed: {type(exc).__name__}: {exc}")
            try:
                self.write_report(ok=False)
            except Exception:  # the report is a courtesy here; the cause is on the terminal already
                pass
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(1)  # its helper threads (plan cache, store server) would keep the process, and the job, alive
        if self.replica is not None:
            self.replica.finish(code)
        return code

    def attach_replica(self, address: tuple[str, int]) -> None:
        """Write this agent's state ahead of every commit and decision into the standby's store."""
        self.replica = Replica(address)
        self.log(f"standby agent at {address[0]}:{address[1]}: state replicated ahead of every commit")

    def _supervise(self) -> int:
        self._refresh_cache()
        if self.replica is not None:
            self._replicate_state()
        while True:
            failed = self.detect(supervising=True)
            if self.unexplained:
                self.failures.append(FailureRecord(ranks=[], step=self.next_step, reason=self.unexplained))
                self.give_up(self.unexplained)
                self.write_report(ok=False)
                return 1
            if self.exits.leaving:
                return self._ended_by_the_script()
            if failed and self._being_stopped():
                return self._stopped_by_signal(failed)
            if failed and self.started_gen:
                # a step every member had declared ready is committed first: a staggered plan's ranks that updated
                # it ahead of the commit keep it, and nobody redoes it
                self.advance(failing=True)
            if failed:
                reason = self.judge(failed)
                if reason is None and self.recover(failed):
                    continue
                if reason is not None:
                    self.failures.append(FailureRecord(ranks=sorted(failed), step=self.next_step, reason=reason,
                                                       phase=self._phase_of(failed, self.next_step),
                                                       error=self._error_of(failed), ended=self.exits.endings_of(failed)))
                self.give_up(reason or self.stop_reason or "recovery failed")
                self.write_report(ok=False)
                return 1
            if self._drop_when_due():
                continue  # (its ranks' failure is met next pass)
            self.advance()
            self._poll_joins()
            if self.pending_action is not None:
                action, self.pending_action = self.pending_action, None
                if not self._act(action):
                    self.give_up(self.stop_reason or "the re-plan failed")
                    self.write_report(ok=False)
                    return 1
                continue
            # (a rank killed lingering after it finished is done too: its machine may never report the exit, cut off)
            if all(self.procs[i].exitcode is not None or i in self.exits.killed_after_done for i in self.members()):
                self._drop_not_taken(f"every rank finished the job after step {self.next_step - 1}")
                break
            time.sleep(0.005)
        for p in self.joiners.values():  # replacements never admitted (held as standbys to the end) leave with the job
            if p.poll() is None:
                p.kill()
        bad = [i for i in self.members() if self.procs[i].exitcode != 0 and i not in self.exits.killed_after_done]
        for ident in bad:
            if ident not in self.errors:  # (a local error was printed when it happened)
                self.log_error(f"rank {ident} exited {self.procs[ident].exitcode}:\n" + self._tail(ident))
        if bad:
            self.stop_line(f"rank(s) {bad} failed after the last step was committed")
        judged = judged_summary(self.steps.records())
        if judged:
            self.log(judged)
        self.write_report(ok=not bad)
        return 1 if bad else 0

    def detect(self, supervising: bool = False) -> set[int]:
        """Members that died, hung or stalled since the last look (hung and stalled ones are fenced here).
        After the last step is committed the ranks still log and save (a Megatron job's final checkpoint):
        a failure there is recovered from too, as long as some survivor is still running. ``supervising``: no
        recovery is under way, so ranks waiting for a plan gave up on a peer nothing else caught (see
        :meth:`_left_waiting`)."""
        now, out = time.time(), set()
        done = self.next_step >= self.cfg.steps
        if done and all(self.procs[i].exitcode == 0 for i in self.members() if i not in self.dead):
            return out  # everyone has left cleanly: exits are only reported at the end
        # (a rank that left with an error is a failure even then: a recovery waiting for it would wait forever)
        self._read_beats(now)
        for ident in self.members():
            if ident in self.dead or ident in self.exits.killed_after_done:  # (finished, then killed lingering: done)
                continue
            code = self.procs[ident].exitcode
            if code is not None and code != 0 and self.exits.left_on_purpose(ident, code):
                continue
            if code is not None and code != 0:
                self.procs[ident].kill()  # leftovers (a launched rank's data-loader workers hold its sockets)
                out.add(ident)
            elif code is None and self._stale(ident, now):
                if self.exits.finishing(ident, now):
                    continue
                if self.exits.left_on_purpose(ident, None) or self._being_stopped():
                    continue  # (stopped by a signal: the launcher's --termination-grace ends one that stays)
                heard = self._heard_at(ident)
                fence, state = (True, "") if heard is None else self.silence.fence(ident, self.procs[ident],
                                                                                   now - heard)
                if not fence:
                    continue  # its process runs: a starved heartbeat, given a grace (said on the terminal)
                graced = ident in self.silence.graced
                why = f"missed heartbeats for {self.cfg.heartbeat_timeout_s * (2 if graced else 1):.1f} s"
                if heard is not None:
                    self.silent_since[ident] = heard
                self.slow_nodes.hang(self.next_step, [ident], "hang", f"rank {ident} {why}: its process "
                                     + (f"did not beat though not stopped ({state})" if graced else
                                        f"stopped ({state})" if state else "stopped"))
                if state:
                    self.log(f"rank {ident}'s process: {state}")
                self._fence(ident, why)
                out.add(ident)
            elif code is None and (heard := self._heard_at(ident)) is not None:
                self.silence.look(ident, self.procs[ident], now - heard)
        stall = None if done or self._being_stopped() else self._stalled(now)
        if stall is not None and stall.together and stall.rank not in out:  # (a guess: who reaches whom, first)
            cut = self._partitioned(f"ranks {sorted([stall.rank, *stall.waiting])} stopped inside a collective "
                                    f"together, waiting in communication")
            if cut:
                return out | cut
        if stall is not None and stall.rank not in out:
            beat = self.beats[stall.rank]
            # C4D: a communication hang when peers wait in a communication it never joined (or it stopped inside
            # one itself); a hang when it stopped in its own work with nobody waiting on it yet
            kind = "comm-hang" if beat.state == COMM or stall.waiting else "hang"
            self.slow_nodes.hang(beat.step, [stall.rank], kind, f"rank {stall.rank} {stall.why} ({beat.state})"
                                 + (f"; ranks {stall.waiting} wait on it in communication" if stall.waiting else ""))
            self.silent_since[stall.rank] = stall.since
            self._fence(stall.rank, f"{stall.why} ({stall.bound})", stacks=True)
            out.add(stall.rank)
        if not out and not done:
            out |= self._not_joining(now)
        if supervising and not out and not done:
            out |= self._left_waiting(now)
        return out

    def _not_joining(self, now: float) -> set[int]:
        """Members that have not joined a new generation that every other member has joined, and that have made no
        progress for ``--hard-timeout`` since (named with their stacks at the soft one): fenced, and the job recovers
        without them. The others wait for them alone; the judge of steps does not see a rank inside a recovery, and
        the generation's first step is judged only after ``--first-step-timeout``, long after each waiting rank
        would have given up on the generation's start and failed as if on an error of its own (seen on
        core_r0.14.0: a rank that said "recovering" and never joined, with overlapped gradient reduction)."""
        if self.started_gen or self.gen == 0 or self.store is None:
            self.joining_late = None
            return set()
        if now - self.joining_looked < self.cfg.heartbeat_interval_s / 2:  # (a store check per member: not every loop)
            return set()
        self.joining_looked = now
        live = [i for i in self.members() if i not in self.dead]
        missing = tuple(i for i in live if not self.store.check([f"{self.key('join')}/{i}"]))
        if not missing or len(missing) == len(live):
            self.joining_late = None
            return set()
        if self.joining_late is None or self.joining_late[:2] != (self.gen, missing):
            self.joining_late = (self.gen, missing, now)
        since = self.joining_late[2]
        out = set()
        for ident in missing:
            beat = self.beats.get(ident)
            stopped = now - (since if beat is None else max(beat.since, since))
            at = f" (last operation: {beat.phase or '-'} of step {beat.step}, {beat.state})" if beat else ""
            why = (f"has not joined generation {self.gen}, which every other member has joined, and has made no "
                   f"progress for {stopped:.1f} s{at}")
            if stopped >= self.cfg.soft_timeout_s and (self.gen, ident) not in self.joining_named:
                self.joining_named.add((self.gen, ident))
                self.log(f"rank {ident} {why}; its stacks are dumped to its log; fenced after --hard-timeout "
                         f"{self.cfg.hard_timeout_s:g} s")
                self._dump_stacks(ident)
            if stopped >= self.cfg.hard_timeout_s:
                self.slow_nodes.hang(self.next_step, [ident], "hang", f"rank {ident} {why}")
                self._fence(ident, f"{why} (--hard-timeout {self.cfg.hard_timeout_s:g} s)", stacks=True)
                out.add(ident)
        return out

    def _left_waiting(self, now: float) -> set[int]:
        """Members that ranks waiting for a recovery nobody called gave up on: a collective of theirs ran out its
        timeout (Megatron's ``--distributed-timeout-minutes``), they took it for a peer's failure and wait for a
        plan, while no failure is known (a rank stuck where progress cannot tell, as in an NCCL collective that
        returned before its peers arrived). A failure they saw would be found within the heartbeat timeout; after
        it, the members not waiting are the ones the others waited for in that collective (any other member would
        have seen the waiting ranks abort their groups and be waiting too): fenced, and the job recovers. When
        every member waits (a collective that timed out with all of them in it) there is nobody to fence: the job
        stops at once, saying so (``unexplained``), instead of each rank waiting out its own wait for a plan and the
        job ending as if on a deterministic error."""
        live = [i for i in self.members() if i not in self.dead]
        waiting = [i for i in live if i in self.beats and self.beats[i].state == WAITING
                   and self.beats[i].phase == "recovery"
                   and now - self.beats[i].since >= self.cfg.heartbeat_timeout_s]
        # (a rank still entering this generation waits in "recovery" too: only ranks that left *this* one count)
        if self.store is not None:
            waiting = [i for i in waiting if self.store.check([f"{self.key('recover')}/{i}"])]
        if not waiting:
            return set()
        # a rank that cannot reach another any more took its silence for a failure, and so may the other (asked once
        # for each set of waiting ranks)
        if (self.gen, tuple(waiting)) not in self.reach_asked:
            self.reach_asked.add((self.gen, tuple(waiting)))
            cut = self._partitioned(f"ranks {waiting} wait for a recovery that no failure called for")
            if cut:
                return cut
        # (nor one waiting on this agent: it is in no collective)
        left = [i for i in live if i not in waiting and not (i in self.beats and self.beats[i].state == WAITING)]
        if not left:
            if len(waiting) == len(live):
                self.unexplained = (f"every rank left generation {self.gen} at step {self.next_step} for a recovery "
                                    f"that no failure called for (a collective timed out with all of them in it): "
                                    f"nobody to fence; restart from the last checkpoint")
            return set()
        for ident in left:
            beat = self.beats.get(ident)
            at = f" (at {beat.phase or '-'} of step {beat.step}, {beat.state})" if beat else ""
            why = (f"was what ranks {waiting} waited for{at}: a collective of theirs timed out while nothing else "
                   f"found a failure")
            self.slow_nodes.hang(self.next_step, [ident], "comm-hang", f"rank {ident} {why}")
            self._fence(ident, why, stacks=False)
        return set(left)

    def _partitioned(self, seen: str) -> set[int]:
        """Where ranks stopped together (``seen``), ask which machines each live rank's machine reaches
        (``runtime.reachability``); if some no longer reach each other, fence every rank outside the largest set of
        machines that all do, and return them (empty: every machine reaches every other, or too few answered)."""
        members, reach = self._reach_round([i for i in self.members() if i not in self.dead])
        if len(reach) < 2 or reachability.complete(reach):
            return set()
        kept_machines = reachability.kept(reach, members)
        keep = sorted(r for m in kept_machines for r in members[m])
        cut = sorted(r for m in reach if m not in kept_machines for r in members[m])
        self.log(f"{seen}; asked who reaches whom: ranks {keep} all reach each other, and {cut} do not reach all of "
                 f"them (a network partition that is not transitive): keeping the {len(keep)}")
        for machine in (m for m in sorted(reach) if m not in kept_machines):
            unreached = sorted(r for k in kept_machines if k not in reach[machine] or machine not in reach[k]
                               for r in members[k])
            for ident in members[machine]:
                why = f"is cut off from ranks {unreached} (no connection both ways), which all reach each other: a " \
                      f"network partition"
                self.slow_nodes.hang(self.next_step, [ident], "comm-hang", f"rank {ident} {why}")
                self._fence(ident, why)
        return set(cut)

    def _reach_round(self, ranks: list[int], target: str | None = None) -> tuple[dict[int, list[int]],
                                                                                 dict[int, set[int]]]:
        """One round of ``reachability``: the machines of ``ranks`` (a machine's first rank -> its ranks) and each
        machine's reached machines, from those that answered in time. One rank per machine is asked, its first
        whose heartbeat is fresh (that thread answers, whatever the main thread is stuck in), and it is probed first
        (the machine's other ranks' listeners where it refuses). A machine whose rank asked did not answer is asked
        once more, through its next rank, alone (the others' answers stand). Only ranks that said where they listen
        count. ``target`` ("ip:port"): each machine probes that address instead, and reached it where its answer
        holds ``reachability.TARGET``."""
        said = reachability.said_addresses(self.store, ranks)
        members = reachability.machines(said)
        if len(members) < 2 and target is None:
            return members, {}
        now = time.time()
        speakers = {m: sorted(group, key=lambda i: self._stale(i, now)) for m, group in members.items()}
        reach: dict[int, set[int]] = {}
        for attempt in range(REACH_ASKS):
            voice = {speakers[m][attempt]: m for m in members if m not in reach and attempt < len(speakers[m])}
            if not voice:
                break
            self.reach_round += 1
            round_id = f"{os.getpid()}-{self.reach_round}"  # (a standby's rounds are not a lost agent's)
            first = {m: i for i, m in voice.items()}
            listeners = [[m, [said[r] for r in sorted(group, key=lambda r: r != first.get(m))]]
                         for m, group in sorted(members.items())] if target is None else \
                [[reachability.TARGET, [target]]]
            self.store.set(reachability.ASK_KEY, json.dumps({"round": round_id, "ranks": sorted(voice),
                                                             "machines": listeners}))
            keys = {i: reachability.ANSWER_KEY.format(round_id, i) for i in voice}
            rounds = 1 + len(members) // reachability.PROBE_THREADS
            deadline = time.time() + rounds * reachability.PROBE_TIMEOUT_S + 3 * self.cfg.heartbeat_interval_s + 2.0
            while time.time() < deadline and not self.store.check(list(keys.values())):
                time.sleep(0.05)
            reach.update({voice[i]: {m for m in json.loads(self.store.get(k)) if m in members or
                                     (target is not None and m == reachability.TARGET)}
                          for i, k in keys.items() if self.store.check([k])})
        return members, reach

    def _check_names(self, lookup: Callable[[str], Any] | None = None, wait: bool = False) -> None:
        """Says on the terminal, once, where naming a rank's machine by its address is slow
        (``control_plane.say_slow_names``): this store names every new connection's peer so, at start-up, and again at
        each reconnection and takeover. ``lookup``, ``wait``: for tests."""
        from .control_plane import say_slow_names

        members = self.members()
        thread = say_slow_names(list(reachability.said_addresses(self.store, members).values()), self.log_error,
                                len(members), lookup)
        if wait:
            thread.join()

    def _stamp_diagnoses(self) -> None:
        """When each new diagnosis was made, on the report's clock."""
        for rec in self.slow_nodes.records:
            if rec.wall_s is None:
                rec.wall_s = time.time() - self.started

    def _fence(self, ident: int, why: str, stacks: bool = False) -> None:
        """SIGKILL the rank; ``stacks``: its stacks were dumped to its log when it was named, and the launcher
        holding that log shows where its main thread had stopped (here, or a remote machine's ``node_agent``)."""
        self._stamp_diagnoses()
        self.log(f"rank {ident} {why}: fencing it (SIGKILL)")
        if stacks:
            self.store.set(STACKS_ASKED_KEY.format(ident), why)
        self.procs[ident].kill()
        key = getattr(self.procs[ident], "fence_key", None)  # (a rank on another machine: its node agent kills it)
        if key is not None:  # said to the standby too: a machine that reaches only it learns there that it was dropped
            self._to_standby(lambda replica: replica.fence(key, f"was fenced: {why}"))
        self.procs[ident].join(5)
        self.fenced.add(ident)
        self.silence.forget(ident)  # (whatever way it was fenced: its silence is over)
        self.exits.fenced(ident, why)
        stack = rank_log_stack(self.workdir, ident) if stacks else None
        if stack:
            self.log_error(f"rank {ident} had stopped here (from the stacks it dumped to its log):\n" + indented(stack))

    def _read_beats(self, now: float) -> None:
        """Every member's last heartbeat in one store round trip, at most every half heartbeat interval
        (not per rank every loop: the agent's polling stays flat in the number of ranks)."""
        if now - self.beats_read < self.cfg.heartbeat_interval_s / 2:
            return
        self.beats_read = now
        members = [i for i in self.members() if i not in self.dead]
        known = [i for i in members if i in self.beats or self.store.check([f"odyssey/hb/{i}"])]
        if not known:
            return
        for ident, value in zip(known, self.store.multi_get([f"odyssey/hb/{i}" for i in known])):
            beat = Beat.parse(value)
            if beat.t >= self.admitted_at.get(ident, 0.0):  # (older: its earlier life's, not yet overwritten)
                self.beats[ident] = beat

    def _stalled(self, now: float) -> Stall | None:
        """The live member at fault for a stop in progress (``ProgressJudge.stalled``)."""
        live = [i for i in self.members() if i not in self.dead]
        return self.progress.stalled(live, self.beats, now, self.warm, self.step_started, self.exits.finishing)

    def _dump_stacks(self, ident: int) -> None:
        """Ask the rank for its stacks (into its log): by signal (ranks register faulthandler on it) when it runs
        here, else through its launcher."""
        pid = getattr(self.procs[ident], "pid", None)
        if pid:
            try:
                os.kill(pid, self.cfg.stack_dump_signal)
            except OSError:
                pass
        elif self.store is not None:
            self.store.set(DUMP_STACKS_KEY.format(ident), f"{int(self.cfg.stack_dump_signal)} {time.time()!r}")

    def judge(self, failed: set[int]) -> str | None:
        """Print the local errors the failed ranks left; returns why the job must stop instead of
        recovering (a rank failed during start-up, or an error recurred on another rank), else None."""
        stop = None
        for ident in sorted(failed):
            record = read_error(self.store, ident)
            started = self._started(ident)
            if record is not None and record.failure:  # (its process, not the code: never stops the job)
                self.log_error(f"rank {ident} failed ({record.where}): {record.headline()}\n" + indented(record.traceback))
                if started:
                    self.log_error(f"recovering without rank {ident}")
            elif record is not None:
                self.errors[ident] = record
                self.log_error(f"rank {ident} failed with its own error ({record.where}): {record.headline()}\n"
                               + indented(record.traceback))
                first = next((r for i, r in self.errors.items() if i != ident and r.signature == record.signature), None)
                if first is not None and stop is None:
                    stop = (f"the same error ({record.type} at {record.place}) recurred on rank {ident} after rank "
                            f"{first.rank}: it looks deterministic, not a hardware failure")
                elif started:
                    self.log_error(f"recovering without rank {ident} (an error on one rank is treated as that "
                                   f"rank's failure; the job stops if it recurs on another)")
            elif started and ident not in self.fenced:
                self.exits.say_how_it_ended(ident)
            if not started and stop is None:
                what = record.headline() if record else f"exit code {self.procs[ident].exitcode}"
                stop = f"rank {ident} failed during start-up ({what})"
                if record is None:
                    self.log_error(f"rank {ident} exited {self.procs[ident].exitcode} during start-up; its last "
                                   f"error:\n" + indented(self._last_traceback(ident)))
        return stop

    def _being_stopped(self) -> bool:
        """The launcher passed a termination signal to the ranks: a silent or stalled rank is saving or leaving on
        it (core_r0.16.0: every heartbeat stopped during the 25 s save on SIGTERM, and the agent fenced a rank that
        had meanwhile saved and exited 0, ending the job 143), not hung; the launcher kills those still running
        after its grace."""
        return bool(getattr(self.termination, "signum", None))

    def _stopped_by_signal(self, failed: set[int]) -> int:
        """The launcher passed a SIGTERM to the ranks: ranks ending now are the job being stopped, not failures."""
        reason = self.termination.reason
        ended = {i: describe_exit(self.procs[i].exitcode) for i in sorted(failed) if self.procs[i].exitcode is not None}
        self.failures.append(FailureRecord(ranks=sorted(failed), step=self.next_step, reason=reason, ended=ended))
        self.give_up(reason)
        self.write_report(ok=False)
        return 128 + self.termination.signum

    def _ended_by_the_script(self) -> int:
        """The script ended the job with a code of its own: nothing to recover. The other ranks are leaving the
        same way (after the same checkpoint save, which a stop now could cut short): wait for them, at most the
        hard timeout, then stop the rest; the job leaves with the script's code, as under torchrun or srun, so
        that a wrapper that relaunches on it (Megatron-LM's 16: resume to disambiguate) does."""
        first = next(iter(self.exits.leaving.values()))
        code, why = int(first["code"]), str(first.get("why") or "")
        self._drop_not_taken(f"the training script ended the job with exit code {code} after step {self.next_step - 1}")
        self.log(f"rank(s) {sorted(self.exits.leaving)} left with exit code {code}: {why}; not a failure, nothing to "
                 f"recover; waiting for the other ranks to leave")
        deadline = time.time() + self.cfg.hard_timeout_s
        live = [i for i in self.members() if i not in self.dead]
        while time.time() < deadline and any(self.procs[i].exitcode is None for i in live):
            time.sleep(0.05)
        for ident in live:  # (one still running may be tearing down after saying so: the same end)
            self.exits.left_on_purpose(ident, self.procs[ident].exitcode)
        others = {i: describe_exit(self.procs[i].exitcode) if self.procs[i].exitcode is not None else "still running"
                  for i in live if i not in self.exits.leaving}
        reason = f"the training script ended the job with exit code {code} at step {self.next_step}: {why}"
        if others:
            reason += f" (rank(s) otherwise: {others})"
        self.ended_by = {"code": code, "why": why, "step": self.next_step, "ranks": sorted(self.exits.leaving),
                         "others": {str(i): e for i, e in others.items()}}
        self.give_up(reason)
        self.write_report(ok=False)
        return code

    def _started(self, ident: int) -> bool:
        """A rank reached its first training step (a failure before that ends the job)."""
        return self.gen > 0 or self.store.check([STARTED_KEY.format(ident)])

    def _error_of(self, ranks: set[int]) -> dict[str, Any] | None:
        record = next((self.errors[i] for i in sorted(ranks) if i in self.errors), None)
        return vars(record).copy() if record else None

    def give_up(self, reason: str) -> None:
        """Stop the job: every rank learns it from the store at once (its waiting loops exit on the
        give-up key, or on the generation's abort), and the ranks are stopped."""
        self.stop_line(reason)
        try:
            self.store.set(GIVEUP_KEY, reason)
            if not self.store.check([self.key("abort")]):
                self.store.set(self.key("abort"), f"the job stopped: {reason}")
            self._wake_waiters(giveup=reason)
        except Exception:  # a store we host does not fail; a remote one may be gone already
            pass
        self.stop_all()

    def _wake_waiters(self, giveup: str | None = None) -> None:
        """Answer every key a rank of this generation may be blocked on (``generation.wait_key``): the
        commit of the step in flight and the generation's start with ``ABORTED``, and, when the job stops,
        the next generation's plan with the reason. Set only where still unset (a real answer stays)."""
        for key in (f"{self.key('commit')}/{self.next_step}", self.key("go")):
            self.store.compare_set(key, "", ABORTED)
        if giveup is not None:
            self.store.compare_set(f"odyssey/gen{self.gen + 1}/plan", "", json.dumps({"giveup": giveup}))

    def _heard_at(self, ident: int) -> float | None:
        """When the rank last showed it lives: its last beat, else its admission (a joined rank beats from its
        request on, and a beat the store holds from before the admission is its earlier life's: on a loaded
        machine the new process's first beat may come after an admission decided within a beat of its request);
        None for a rank never heard from."""
        beat = self.beats.get(ident)
        return beat.t if beat is not None else self.admitted_at.get(ident)

    def _stale(self, ident: int, now: float) -> bool:
        beat = self.beats.get(ident)
        if beat is None and self.takeover_at:  # its heartbeat thread moves to this agent within seconds
            return now - self.takeover_at > self.cfg.heartbeat_timeout_s + TAKEOVER_RECONNECT_S
        if beat is None and ident in self.admitted_at:  # it beats already: no start-up to wait for
            return now - self.admitted_at[ident] > self.cfg.heartbeat_timeout_s
        if beat is None:
            return now - self.started > max(60.0, 10 * self.cfg.heartbeat_timeout_s)  # never came up
        return now - beat.t > self.cfg.heartbeat_timeout_s

    def advance(self, failing: bool = False) -> None:
        """Start a new generation once every member joined; commit the next step once every member has
        synchronised; track checkpoints. A drop waiting for the ranks inside that step is carried out instead of
        the commit (its work is done everywhere), unless a failure is being recovered from (``failing``: the step is
        committed first)."""
        if not self.started_gen:
            if self.store.check([f"{self.key('join')}/{i}" for i in self.members()]):
                self.store.set(self.key("go"), "1")
                self.started_gen = True
                if self.gen == 0:
                    self._check_names()
                for rec in self.failures:
                    if rec.generation == self.gen and not rec.joined_at:
                        rec.joined_at = time.time()
            return
        t = self.next_step
        if t >= self.cfg.steps:
            return
        members = self.members()
        count = f"{self.key('ready')}/{t}/count"  # each rank adds 1 after appending its share: one counter to poll
        if self.store.add(count, 0) < len(members) or self._awaiting_rejoiner():
            return
        if not failing and self.pending_drop is not None and t >= self.pending_drop.step and \
                self._drop_when_due(every_rank_ready=True):
            return
        shares_key = f"{self.key('ready')}/{t}/shares"
        shares = ready_shares(self.store.get(shares_key))
        if len(shares) != len(members) or set(shares) != set(members):  # (never: a safety check)
            if (self.gen, t) not in self.named_mismatch:
                self.named_mismatch.add((self.gen, t))
                self.log_error(f"step {t}: ready from ranks {sorted(shares)}, but the members are {members}")
            return
        # in rank order, as before: the same float sum
        loss = committed_loss([shares[i] for i in members], self.cfg.dp,
                              bool(self.cfg.extra.get("loss_reduced_per_micro_batch")))
        # the ranks' operation records of step t: read before the commit (a rank overwrites its record with
        # step t + 1's once it has it), judged after
        summaries = SlowNodes.read(self.store, self.key("ops"), members, t) if self.warm and self.slow_nodes.on else {}
        self.store.delete_key(count)
        self.store.delete_key(shares_key)
        now = time.time()
        first_of_generation = not self.warm
        if first_of_generation:
            self._close_failure_records(now)
        redone = self.steps.was_trained(t)  # trained before, lost to a restart from an older checkpoint
        record = {"step": t, "loss": loss, "time_s": now - self.step_started, "plan_id": self.plan.plan_id,
                  "alive": len(members), "policy": self.plan.policy, "generation": self.gen,
                  "wall_s": now - self.started, "t": now, "redone": redone, "agent_rss_mb": resident_mb()}
        new_layout = self.state_plan is not self.plan
        self.state_plan = self.plan  # once committed, survivors hold their state in this generation's layout
        self.state_gen = self.gen
        # judged before the commit: a drop decided here waits for the ranks inside step t + 1, which the commit
        # tells them (drop_gate), and the standby knows of it first
        self._diagnose(t, summaries)
        armed = self._arm_drop(t + 1)
        if armed:
            self._drop_to_standby()
        if self.replica is not None:  # ahead of the commit: whatever a rank sees, the standby knows
            if first_of_generation:
                self._replicate_state()
            # (the standby's copy of the record has no store_keys: they are counted after the commit)
            step_state = {"generation": self.gen, "committed": t, "loss": loss, "next_step": t + 1,
                          "latest_checkpoint": self._latest_checkpoint_if_any()}
            self._to_standby(lambda replica: replica.step(step_state, record))
        self.store.set(f"{self.key('commit')}/{t}", commit_value(loss, t + 1 if armed else None))  # (with its loss)
        # every rank has applied step t - 1 (it published ready/t): nobody waits on that commit any more
        self.store.delete_key(f"{self.key('commit')}/{t - 1}")
        record["store_keys"] = self.store.num_keys()  # after the commit: a round trip the ranks need not wait for
        if new_layout:
            self._refresh_cache()
        if self.profile_iters and not self.measured:
            self._adopt_measured_profile()
        if "device" not in self.cfg.extra and self.store.check([DEVICE_KEY]):
            self._adopt_device(json.loads(self.store.get(DEVICE_KEY)))
        if not self.warm:
            self.warm, self.progress.judged_from = True, now
        self._consider_joins(t)
        diagnoser = self.slow_nodes.diagnoser
        judged = {n: f for n, f in diagnoser.last_factors.items() if n not in diagnoser.last_idled} if summaries else {}
        if judged:  # the diagnosis' view of this step: the node furthest behind its peers
            node = max(judged, key=judged.get)
            record["slowest"] = {"node": node, "factor": round(judged[node], 3)}
        if summaries and diagnoser.last_idled:  # not judged: they waited on others (Diagnoser.idled)
            record["idled"] = sorted(diagnoser.last_idled)
        self.steps.append(record)
        print(f"step {t:4d}  loss {loss:.6f}  time {now - self.step_started:.3f}s  devices {len(members)}  "
              f"plan {self.plan.plan_id} ({self.plan.policy})", flush=True)
        self.step_started = now
        self.next_step = t + 1
        if checkpoint_due(t, self.cfg.checkpoint_interval, self.published):
            self.checkpoints[t] = set(members)
            self._forget_old_checkpoints()
        if first_of_generation and self.failures and self.failures[-1].generation == self.gen:
            self.write_report(ok=True, final=False)  # the report grows as the job goes, not only at its end

    def _last_step(self, step: int) -> bool:
        """No step comes after ``step``: it is --train-iters' last, or, in a Megatron-LM job, the one after which
        its --exit-interval ends the job (``checkpoint_and_decide_exit``: Megatron's iteration ``step + 1``). A
        re-plan decided there would wait for the ranks to redo a step they never run."""
        return ends_after(step, self.cfg.steps, self.cfg.extra.get("exit_interval"))

    def _diagnose(self, step: int, summaries: dict[int, dict[str, Any]]) -> None:
        """Judge the committed step's operation records (``slow_nodes``); an action is taken by the main loop."""
        def slowed_at(ranks: list[int]) -> float | None:
            keys = [f"odyssey/slowed/{i}" for i in ranks if self.store.check([f"odyssey/slowed/{i}"])]
            return min(float(self.store.get(k).split()[0]) for k in keys) if keys else None

        action = self.slow_nodes.after_commit(step, summaries, self.plan, self.planner, self.profile, slowed_at)
        if action is not None and self._last_step(step):  # the ranks are finishing the job: nothing to redo
            self._not_taken(action, f"step {step} was the job's last")
            action = None
        self._stamp_diagnoses()
        for rec in self.slow_nodes.records[self.said_diagnoses:]:
            if rec.kind in ("slow", "comm-slow"):  # (hangs are said where they are fenced)
                self.log(f"diagnosis at step {step}: {rec.kind} ranks {rec.ranks}: {rec.evidence}; action "
                         f"{rec.action}" + (f" ({rec.reason})" if rec.reason else ""))
        self.said_diagnoses = len(self.slow_nodes.records)
        if action is not None:
            self.pending_action = action

    # -- ranks joining the running job (runtime.joining) ------------------------------------------------------
    def _poll_joins(self, every_s: float | None = None) -> None:
        """Read new join requests (at most every half heartbeat interval, or ``every_s`` while a commit waits on
        one); refuse ranks that are alive here."""
        now = time.time()
        if now - self.join_polled < (self.cfg.heartbeat_interval_s / 2 if every_s is None else every_s):
            return
        self.join_polled = now
        for ident, pid in self.join_requests.poll(self.store).items():
            if ident in self.procs and ident not in self.dead and self.procs[ident].exitcode is None:
                self.join_requests.pending.pop(ident, None)
                self.store.set(ADMIT_KEY.format(ident), f"refused: rank {ident} is alive in the job")
                self.log_error(f"rank {ident} (pid {pid}) asked to join, but rank {ident} is alive: refused")
            else:
                if ident in self.join_requests.launched:  # supervised by its machine's launcher (odyssey-launch --join)
                    from ..launch import exits_reported

                    self.exits_at[ident] = exits_reported(self.store)
                self.log(f"rank {ident} (pid {pid}) asks to join; the planner decides after the next commit")

    def _consider_joins(self, step: int) -> None:
        """After a commit: start the --rejoin ranks due, and let the planner decide on the joining nodes whose
        every tensor-parallel rank has asked (Eq. 8: standby, fill dead places, reconfigure)."""
        from ..planning.join import decide_join

        for spec in self.rejoin:
            if not spec.get("due") and step >= int(spec["after_step"]) and int(spec["rank"]) in self.dead:
                spec["due"], spec["due_at"] = True, time.time()
                self.log(f"rank {spec['rank']}'s machine is back (--rejoin {spec['rank']}@{spec['after_step']})")
                self.store.set(REJOIN_KEY.format(spec["rank"]), "1")
        if self.pending_action is not None or self._last_step(step):
            return
        pending = self.join_requests.pending
        tp = self.cfg.tp
        nodes = [n for n in self._whole_nodes(set(pending)) if n * tp not in self.held]
        if not nodes:
            return
        ranks = node_ranks(nodes, tp)
        try:
            decision = decide_join(self.planner, self.state_plan, nodes)
        except PlanningError as exc:
            for ident in ranks:
                pending.pop(ident, None)
                self.store.set(ADMIT_KEY.format(ident), f"refused: {exc}")
            self.log_error(f"cannot admit rank(s) {ranks}: {exc}")
            return
        record = JoinRecord(ranks, step, decision.action, decision.chosen.candidate.reason,
                            [o.summary() for o in decision.options], wall_s=time.time() - self.started)
        self.joins.append(record)
        for o in decision.options:
            c = o.candidate
            self.log(f"  join option {o.action:<11} step {c.step_time_s:.4g}s transition "
                     f"{c.transition.total_s if c.feasible else float('nan'):.4g}s score {c.score:.4g}  {c.reason}")
        if decision.action == "standby":
            self.held |= set(ranks)
            self.log(f"rank(s) {ranks}: {record.reason}")
            return
        transfers = [(t.unit, t.src, t.dst) for t in decision.chosen.candidate.transfers.transfers]
        self.pending_action = Action("join", record, ranks=ranks, plan=decision.plan, transfers=transfers)

    def _start_joiner(self, ident: int) -> None:
        """--rejoin: the replacement for rank ``ident`` (a repaired machine), started as any joining rank is, a
        fresh process given only the job's address; it sets itself up now and asks to join when told
        (``REJOIN_KEY``, once its step is committed and the rank is dead)."""
        import subprocess

        log = open(self.workdir / f"rank{ident}.join.log", "w")
        self.joiners[ident] = subprocess.Popen(
            [sys.executable, "-m", "megatron_odyssey.runtime.joining", "--address", f"127.0.0.1:{self.port}",
             "--rank", str(ident), "--when", REJOIN_KEY.format(ident)], stdout=log, stderr=log,
            start_new_session=True)

    def _awaiting_rejoiner(self) -> bool:
        """--rejoin R@S means the machine is back after step S: the next commit waits until its replacement
        has asked to join (set up while the job ran, it normally has), so where it joins does not depend on how
        fast a loaded machine imports torch. Bounded: a replacement that exited, or has not asked within the
        store timeout, is reported and no longer waited for."""
        for spec in self.rejoin:
            if not spec.get("due") or spec.get("settled"):
                continue
            ident = int(spec["rank"])
            self._poll_joins(every_s=0.05)
            proc = self.joiners.get(ident)  # (none under odyssey-launch: started by the machine that comes back)
            exited = proc is not None and proc.poll() is not None
            waited = time.time() - spec["due_at"]
            if ident in self.join_requests.pending or ident in self.members():
                spec["settled"] = True
            elif exited or waited > self.cfg.timeout_s:
                spec["settled"] = True
                why = f"exited with {proc.returncode}" if exited else f"silent for {waited:.0f} s"
                where = f"log: {self.workdir / f'rank{ident}.join.log'}" if proc is not None else "see its launcher"
                self.log_error(f"rank {ident}'s replacement (--rejoin) {why} before asking to join; carrying on "
                               f"without it ({where})")
            else:
                if not spec.get("said_wait"):
                    spec["said_wait"] = True
                    self.log(f"step {self.next_step}'s commit waits for rank {ident}'s replacement to ask to join")
                return True
        return False

    def _joiner(self, ident: int) -> Any:
        """A rank that asked to join, as a process to supervise: through its launcher's exit reports
        (``odyssey-launch --join``, only those after its request count), or by pid (``odyssey join``, on this
        machine; the agent did not fork it)."""
        pid = self.join_requests.pending[ident]
        if ident in self.join_requests.launched:
            from ..launch import RemoteExits, RemoteRank

            return RemoteRank(self.store, ident, RemoteExits(self.store, after=self.exits_at.get(ident, 0)),
                              joined_pid=pid)
        from .control_plane import PidRank

        return PidRank(pid, self.store, ident)

    def _admit(self, action: Action) -> None:
        """The joining ranks become members (see :meth:`_joiner`)."""
        for ident in action.ranks:
            self.procs[ident] = self._joiner(ident)
            self.join_requests.pending.pop(ident)
            self.dead.discard(ident)
            self.fenced.discard(ident)
            self.beats.pop(ident, None)
            self.silence.forget(ident)  # (a grace its earlier life got is not the new process's)
            self.admitted_at[ident] = time.time()
            self.exits.replaced(ident)
        self.held -= set(action.ranks)

    def _batch_ramp(self) -> Any:
        """The job's batch-size ramp (``megatron_lm.batch_ramp.BatchRamp``), or None for a constant batch."""
        from ..megatron_lm.batch_ramp import BatchRamp

        return BatchRamp.from_list(self.cfg.extra.get("batch_ramp"))

    def _inside_ramp(self, step: int) -> str | None:
        """Why ``step`` cannot run on a plan: it is inside Megatron's batch-size ramp, while every plan splits one
        fixed global batch (``megatron_lm.batch_ramp``); None past the ramp."""
        ramp = self._batch_ramp()
        if ramp is None or step >= ramp.ramp_end:
            return None
        return (f"iteration {step + 1} is inside the batch-size ramp (--rampup-batch-size, or "
                f"--step-batch-size-schedule), which reaches the global batch of {ramp.global_batch} at iteration "
                f"{ramp.ramp_end + 1}, and every plan splits one fixed global batch")

    def _relaunch_hint(self) -> str:
        save = self.cfg.extra.get("save_dir")
        ckpt = megatron_checkpoint_iteration(save) if save else None
        where = (f"Megatron loads the checkpoint of iteration {ckpt} ({save}) and ramps on" if ckpt is not None else
                 "nothing was saved yet (--save, --save-interval), so it starts over")
        return (f"relaunch the job's own command line{f' with --load {save}' if save else ''}: {where}; failures "
                f"from iteration {self._batch_ramp().ramp_end + 1} on are recovered in-process")

    def _act(self, action: Action) -> bool:
        """Re-plan (a rebalance, a join): abort the generation after the step just committed and start the new plan.
        Not inside a batch-size ramp (a plan cannot run it; a failure there stops the job anyway). (A drop is armed
        at the commit that decided it instead: :meth:`_arm_drop`.)"""
        if self._held_by_a_ramp(action, self.next_step):
            return True
        if action.what == "join" and any(self.procs[i].exitcode is not None for i in self.members()):
            return True  # a member left meanwhile: that failure is recovered first; the join is decided again
        return self.recover(set(), replan=action)

    def _held_by_a_ramp(self, action: Action, step: int) -> bool:
        """``step`` is inside a batch-size ramp: the action is not taken (said once per action)."""
        ramp = self._inside_ramp(step)
        if ramp is not None and (action.what, tuple(action.ranks)) not in self.ramp_skipped:
            self.ramp_skipped.add((action.what, tuple(action.ranks)))
            self.log(f"not acting on {action.what} of rank(s) {list(action.ranks)}: {ramp}")
        return ramp is not None

    def _arm_drop(self, step: int) -> bool:
        """A drop the diagnosis just decided waits for every other rank inside ``step`` (``drop_gate``); whether it
        was armed (the commit then tells the ranks, after the standby knows of it)."""
        action = self.pending_action
        if action is None or action.what != "drop":
            return False
        self.pending_action = None
        if self._held_by_a_ramp(action, step):
            return False
        if self.pending_drop is not None:  # (decided at a commit a failure forced)
            self._not_taken(action, f"the drop of rank(s) {self.pending_drop.action.ranks} waits to be carried out "
                                    f"(one at a time)")
            return False
        self.pending_drop = PendingDrop(action, self.gen, step, time.time(), self.cfg.hard_timeout_s)
        self.log(f"rank(s) {action.ranks} will be dropped once every other rank is inside step {step} (at most "
                 f"{self.cfg.hard_timeout_s:g} s from now)")
        return True

    def _drop_when_due(self, every_rank_ready: bool = False) -> bool:
        """Carry out the pending drop if it is due (``PendingDrop.due``; ``every_rank_ready``: every member is ready
        for a step at or after the one waited for: its work is done everywhere). Returns whether its ranks were
        fenced. Not taken when its ranks failed meanwhile, or when the job is ending: a rank left it with 0."""
        drop = self.pending_drop
        if drop is None:
            return False
        finished = [i for i in self.members() if self.procs[i].exitcode == 0 and i not in self.dead]
        if finished:  # (the slow ranks' own among them: they leave with the others)
            self._drop_not_taken(f"rank(s) {finished} finished the job after step {self.next_step - 1} (the "
                                 f"training script's own exit decision) before every other rank was inside step "
                                 f"{drop.step}")
            return False
        live = [i for i in self.members() if i not in self.dead and self.procs[i].exitcode is None]
        ranks = [i for i in drop.action.ranks if i in live]
        if not ranks:  # they failed meanwhile: recovered from as any failure
            self._drop_not_taken(f"rank(s) {drop.action.ranks} failed before every other rank was inside step "
                                 f"{drop.step}")
            return False
        now = time.time()
        why = (f"every rank is ready for step {self.next_step}" if every_rank_ready else
               drop.due(self.store, [i for i in live if i not in ranks], now))
        if why is None:
            return False
        record = drop.action.record
        record.fenced, record.drop_wait_s = drop.when(why, now), round(now - drop.decided, 3)
        self._drop_to_standby(fencing=True)  # a standby taking over from here fences them too
        self.pending_drop = None
        what = ("its compute is {:g}x slower" if record.kind == "slow" else
                "its messages arrive {:g}x later than others'").format(record.factor)
        self.log(f"dropping rank(s) {ranks}, {record.fenced}")
        for ident in ranks:
            self.dropping[ident] = record
            self._fence(ident, f"is slow ({what}); the planner drops it")
        return True

    def _drop_not_taken(self, why: str) -> None:
        """The job ends, or the slow ranks fail, before the pending drop was carried out: the report says so."""
        if self.pending_drop is None:
            return
        action, self.pending_drop = self.pending_drop.action, None
        self._not_taken(action, why)
        self._drop_to_standby()
        self.log(f"the drop of rank(s) {action.ranks} is not taken: {why}")

    def _ended_before(self, replan: Action | None, failed: set[int]) -> bool:
        """The ranks still in the job all finished it (left with 0) before this recovery could start: the training
        script ended the job after the step just committed, by a decision this agent cannot know ahead (Megatron's
        --exit-duration-in-mins, or a signal caught by --exit-signal-handler; --exit-interval is known:
        ``_last_step``). A re-plan is not taken, and the job ends as the ranks did. A failure leaves nobody to
        recover it with: the job stops, saying so (not "every node has failed"). Unless the only ranks that died
        are slow ones this agent dropped (fenced) after that step: the others' exit passed world collectives the
        dropped ranks took part in (the exit check's, a final save's barriers), so the kill came after their work
        was done, and the job is complete (:meth:`_dropped_after_the_end`)."""
        step = self.next_step - 1
        if failed and failed <= set(self.dropping):
            self._dropped_after_the_end(failed, step)
            return True
        if failed:
            self.stop_reason = (f"rank(s) {sorted(failed)} failed while every other rank finished the job after step "
                                f"{step} (the training script's own exit decision): nobody is left to recover with")
            self.failures.append(FailureRecord(ranks=sorted(failed), step=self.next_step, reason=self.stop_reason,
                                               error=self._error_of(failed), ended=self.exits.endings_of(failed)))
            return False
        if replan is not None:
            self._not_taken(replan, f"every rank finished the job after step {step}")
        self.log(f"every rank finished the job after step {step} (the training script's own exit decision) before "
                 + ("this agent took over" if replan is None else
                    f"the {'join' if replan.what == 'join' else 're-plan'} could start: not taken"))
        return True

    def _dropped_after_the_end(self, dropped: set[int], step: int) -> None:
        """The kill of slow ranks dropped after ``step`` landed once every other rank had finished the job there:
        they count as ranks killed after their work was done (not a failure), and their diagnosis says the drop
        came too late to cost the job anything."""
        self.exits.killed_after_done |= dropped
        for rec in {id(self.dropping[i]): self.dropping[i] for i in dropped}.values():  # (one record per drop)
            self._amend(rec, f"drop taken after the job had ended: every other rank finished the job after step {step}")
        self.log(f"rank(s) {sorted(dropped)} were dropped as slow once every other rank had finished the job after "
                 f"step {step} (the training script's own exit decision): the job is complete")

    @staticmethod
    def _amend(record: Any, what_happened: str) -> None:
        """A decision's report entry (a diagnosis or a join) where what happened differs from what the planner chose:
        that first, then the planner's choice."""
        record.reason = what_happened + (f" (the planner's choice: {record.reason})" if record.reason else "")

    @classmethod
    def _not_taken(cls, action: Action, why: str) -> None:
        """The report's entry of an action decided but not taken: why, then the planner's choice it had been."""
        cls._amend(action.record, f"{action.record.action} not taken: {why}")
        if action.what != "join":  # (a join's record keeps the planner's policy; its ranks leave with the job)
            action.record.action = "none"

    def _close_superseded(self, now: float) -> None:
        """Recoveries into this generation that a new one overtakes before its first commit (a failure, a drop, a
        takeover meanwhile) end now, not never (their recovery_s stayed 0 s): the next record goes on from here."""
        for rec in self.failures + self.replans:
            if self.gen > 0 and rec.generation == self.gen and rec.recovery_s == 0.0 and rec.started:
                rec.recovery_s, rec.superseded_by = now - rec.started, self.gen + 1

    def _close_failure_records(self, now: float) -> None:
        """The recoveries into this generation end with its first commit: their times are known now."""
        for rec in self.failures + self.replans:
            if rec.generation == self.gen and rec.recovery_s == 0.0:
                rec.recovery_s = now - rec.started
                rec.transfer_s = max((float(v) for v in self._read_all("transfer_s")), default=0.0)
                parts = [json.loads(v) for v in self._read_all("rebuild")]
                rec.rebuild = {name: max(p[name] for p in parts) for name in ("world_s", "groups_s", "model_s")
                               } if parts else {}
                rec.optimizer_shares = {int(p["rank"]): p["optimizer_share"] for p in parts if "optimizer_share" in p}
                rec.phases = {"sealed_s": rec.sealed_at - rec.started, "published_s": rec.published_at - rec.started,
                              "joined_s": rec.joined_at - rec.started if rec.joined_at else None,
                              "first_step_s": rec.recovery_s}

    def _read_all(self, name: str) -> list[bytes]:
        """Every member's ``name`` key of this generation that exists: one round trip when all do."""
        keys = [f"{self.key(name)}/{i}" for i in self.members()]
        if self.store.check(keys):
            return self.store.multi_get(keys)
        return [self.store.get(k) for k in keys if self.store.check([k])]

    def _forget_old_checkpoints(self) -> None:
        """Only the newest complete checkpoint (and newer ones still being written) can be restored from:
        drop older records and their store keys, so both stay bounded however long the job runs."""
        newest = self.latest_checkpoint()
        for step in [s for s in self.checkpoints if newest is not None and s < newest]:
            for ident in self.checkpoints.pop(step):
                for g in range(self.gen + 1):
                    self.store.delete_key(f"odyssey/gen{g}/ckpt/{step}/{ident}")

    def latest_checkpoint(self) -> int | None:
        """Newest checkpoint every member of its time finished writing."""
        done = []
        gens = range(self.gen + 1)
        for step, writers in self.checkpoints.items():
            if any(self.store.check([f"odyssey/gen{g}/ckpt/{step}/{i}" for i in writers]) for g in gens) or \
                    all(any(self.store.check([f"odyssey/gen{g}/ckpt/{step}/{i}"]) for g in gens) for i in writers):
                done.append(step)
        return max(done) if done else None

    def _latest_checkpoint_if_any(self) -> int | None:
        return self.latest_checkpoint() if self.checkpoints else None

    # -- recovery -------------------------------------------------------------------------------------
    def recover(self, failed: set[int], takeover: dict[str, Any] | None = None, replan: Action | None = None) -> bool:
        """Abort the generation, seal the survivors, decide and publish the next generation. ``takeover``:
        this agent took over from a lost one (no rank needs to have failed; the ranks of a lost machine are
        found here, by their missing heartbeats). ``replan``: no rank failed; the diagnosis asks for another
        plan on the same nodes (a rebalance), started once every rank has left the step in flight."""
        detected = time.time()
        gen_failed = set(failed)
        why = (takeover["reason"] if takeover else f"re-plan: {replan.record.action} ({replan.record.reason})"
               if replan else failure_abort(failed))
        self.store.set(self.key("abort"), why)
        self._wake_waiters()
        self.progress.aborted(time.time())
        injected = [float(self.store.get(f"odyssey/injected/{i}")) for i in failed
                    if self.store.check([f"odyssey/injected/{i}"])]
        # not injected by Odyssey: a hang began after the rank's last heartbeat, a death just before its detection
        started = min(injected or [self.silent_since[i] for i in failed if i in self.silent_since], default=detected)
        if takeover:
            started = detected - takeover["lost_agent_s"]
        self.dead |= failed
        if replan:
            self.log(f"generation {self.gen}: {why}; the ranks finish step {self.next_step} and redo it on the new "
                     f"plan")
        elif not takeover:
            self.log(f"generation {self.gen}: rank(s) {sorted(failed)} failed at step {self.next_step}; aborting "
                     f"the step")
        sealed = self._seal(gen_failed)
        if sealed is None:
            return False
        sealed_at, finished_all = sealed
        survivors = [i for i in self.members() if i not in self.dead]
        if takeover:  # (a partition may have left the agent running: silent, or behind a firewall that rejects)
            standby_check(survivors, frozenset(self.members()), self.witness, takeover.get("lost_as", GONE))
        if not survivors and finished_all:
            return self._ended_before(replan, gen_failed)
        held = [int(v) for v in self.store.multi_get([f"{self.key('recover')}/{i}" for i in survivors])]
        # a survivor of a staggered plan may hold a step updated before its commit that never came: it rolls
        # back to the last step this agent committed (runtime.generation: the plan's resume step tells it)
        committed = {min(h, self.next_step - 1) for h in held}
        self.redo_between = self._survivors_all_between(survivors)
        if len(committed) > 1:
            self.log(f"survivors disagree on the last committed step {sorted(committed)}: taking the smallest")
        last = min(committed) if committed else self.next_step - 1
        rolled_back = sorted(i for i, h in zip(survivors, held) if h > last)
        if rolled_back:
            self.log(f"rank(s) {rolled_back} updated step {last + 1} ahead of its commit (staggered optimizer); the "
                     "step was not committed, so they roll it back")
        # plan from the layout that holds the state: a generation that failed before its first commit
        # never moved any (its ranks still hold the previous layout's state)
        base = self.state_plan
        dead_nodes = {i // self.cfg.tp for i in self.dead} & set(base.live_nodes())
        rec = FailureRecord(ranks=sorted(gen_failed), phase=self._phase_of(gen_failed, last + 1),
                            detection_s=max(0.0, detected - started), step=last + 1, started=started,
                            sealed_at=sealed_at, error=self._error_of(gen_failed),
                            ended=self.exits.endings_of(gen_failed), takeover=takeover,
                            dropped="; ".join(sorted({f"slow ({r.factor:g}x): {r.reason}" for r in
                                                      (self.dropping[i] for i in gen_failed if i in self.dropping)})),
                            rolled_back=rolled_back)
        if rec.dropped:
            rec.phase = "(slow)"  # taken out by the agent between operations, not hit in a phase
        self.slow_nodes.left(dead_nodes)
        ramp = self._inside_ramp(last + 1)
        if ramp is not None:
            self.stop_reason = f"cannot continue in-process: {ramp}; {self._relaunch_hint()}"
            rec.reason = ramp
            self.failures.append(rec)
            return False
        if not dead_nodes and replan is not None:
            rec.policy, rec.reason = replan.record.action, replan.record.reason
            replan.record.replan = rec
            self.log(f"{replan.record.action}: {replan.record.reason}; resuming at step {last + 1}")
            if replan.what == "join":
                self._admit(replan)
            admitted = replan.ranks if replan.what == "join" else []
            self._publish(rec, replan.plan, {"plan": replan.plan.to_dict(), "policy": "reconfigure",
                                             "transfers": [list(t) for t in replan.transfers],
                                             "resume_step": last + 1, "checkpoint_step": None,
                                             "admitted": admitted}, failure=False)
            self._tell_admitted(admitted)
            return True
        if not dead_nodes:  # a takeover that lost no rank: the same layout, new groups on this agent's store
            rec.policy, rec.reason = "resume", "no rank was lost: the same layout on new groups"
            self.log(f"no rank was lost; resuming the same layout at step {last + 1}")
            self._publish(rec, base, {"plan": base.to_dict(), "policy": "resume", "transfers": [],
                                      "resume_step": last + 1, "checkpoint_step": None})
            return True
        t0 = time.perf_counter()
        cache = self.cache
        lost = self._lost_shards(dead_nodes)
        standbys = self._standby_nodes()  # joined ranks held as standbys: this recovery may use them
        try:
            decision = (cache.lookup(dead_nodes) if cache is not None and cache.current is base and not lost
                        and not standbys else None)
            rec.cached = decision is not None
            if decision is None:
                decision = self.planner.decide(base, dead_nodes, lost_units=lost, standbys=standbys)
        except PlanningError as exc:
            self.stop_reason = f"cannot continue: {exc}"
            rec.reason = str(exc)
            self.failures.append(rec)
            return False
        rec.decision_s = time.perf_counter() - t0
        rec.time_to_next_failure_s, rec.mtbf_hours = decision.time_to_next_failure_s, self.options.mtbf_hours
        chosen = self._apply_policy(decision)
        rec.policy, rec.kind, rec.reason = chosen.policy, chosen.kind, chosen.reason
        rec.fill, rec.stagger = chosen.fill, chosen.stagger
        if self.cfg.overlap_grad_reduce and chosen.plan is not None:
            rec.overlapped = node_ranks(sorted(overlapped_nodes(chosen.plan)), self.cfg.tp)
        rec.candidates = [c.summary() for c in decision.candidates]
        point = self._resume_point(chosen, last, lost, rec)
        if point is None:
            return False
        resume, ckpt = point
        rec.lost_steps = max(0, last + 1 - resume)
        for c in decision.candidates:
            self.log(f"  candidate {c.kind:<11} step {c.step_time_s:.4g}s transition "
                     f"{c.transition.total_s if c.feasible else float('nan'):.4g}s score {c.score:.4g}  {c.reason}")
        self.log(f"decision: {chosen.kind} ({rec.decision_s * 1e3:.1f} ms); resuming at step {resume}")
        transfers = [[t.unit, t.src, t.dst] for t in chosen.transfers.transfers] if chosen.transfers else []
        used = node_ranks([n for n in standbys if n in chosen.plan.live_nodes()], self.cfg.tp)
        if used:  # standbys put to work: they become members of the next generation
            self.joins.append(JoinRecord(used, last + 1, chosen.kind.split("-")[-1],
                                         f"standby put to work in the recovery from the failure of rank(s) "
                                         f"{rec.ranks}: {chosen.reason}", wall_s=time.time() - self.started, replan=rec))
            self._admit(Action("join", self.joins[-1], ranks=used))
        self._publish(rec, chosen.plan, {"plan": chosen.plan.to_dict(), "policy": chosen.policy,
                                         "transfers": transfers, "resume_step": resume, "checkpoint_step": ckpt,
                                         "admitted": used})
        self._tell_admitted(used)
        return True

    def _seal(self, gen_failed: set[int]) -> tuple[float, set[int]] | None:
        """Seal the membership: wait until every other member has registered for the recovery or is dead or fenced.
        Ranks that fail meanwhile join ``gen_failed``; ranks that finished the job leave it (not failures). Returns
        when it was sealed and who had finished, or None where a failure meanwhile stops the job (``stop_reason``)."""
        scanned, finished_all = 0.0, set()
        while True:
            more = self.detect() - self.dead
            if more:
                self.dead |= more
                gen_failed |= more
                self.log(f"rank(s) {sorted(more)} failed during recovery")
                stop = self.judge(more)
                if stop is not None:
                    self.stop_reason = stop
                    self.failures.append(FailureRecord(ranks=sorted(gen_failed), step=self.next_step, reason=stop,
                                                       error=self._error_of(more), ended=self.exits.endings_of(more)))
                    return None
            finished = {i for i in self.members() if i not in self.dead and self.procs[i].exitcode == 0}
            if finished:  # left the job after its last step: not a failure, but not in the next generation
                self.dead |= finished
                finished_all |= finished
            live = [i for i in self.members() if i not in self.dead]
            if finished and live:
                self.log(f"rank(s) {sorted(finished)} had finished the job; the survivors go on without them")
            if self.store.check([f"{self.key('recover')}/{i}" for i in live]):  # one round trip for all
                break
            # who is still missing (progress judging spares the others): one round trip per rank, so only once a
            # rank could be judged (judging counts from this recovery's start) and not at every pass
            if time.time() - self.progress.judged_from > self.cfg.soft_timeout_s / 2 and time.time() - scanned > 0.1:
                scanned = time.time()
                self.progress.recovering = {i for i in live if self.store.check([f"{self.key('recover')}/{i}"])}
            time.sleep(0.005)
        self.progress.recovering = set()
        return time.time(), finished_all

    def _resume_point(self, chosen: Candidate, last: int, lost: frozenset[int], rec: FailureRecord
                      ) -> tuple[int, int | None] | None:
        """The step the next generation resumes at, and the checkpoint it restores (None: none, the survivors go on
        from their live state). A restart restores the newest checkpoint: a Megatron job's own (``--save``), else
        Odyssey's. None where no checkpoint can be restored in-process (``stop_reason`` says why and how to
        relaunch)."""
        resume, ckpt = last + 1, None
        if chosen.policy == "restart" and self.cfg.extra.get("megatron"):  # a Megatron job: its own checkpoint
            ckpt = megatron_checkpoint_iteration(self.cfg.extra.get("save_dir"))
            if ckpt is not None and lost:
                from ..megatron_lm.checkpoint import LAYOUT_FREE_OPTIMIZER_FORMATS, optimizer_format

                # (as the checkpoint records it, or, where its release does not, as the job said it saves)
                kind = optimizer_format(self.cfg.extra["save_dir"], ckpt) or self.cfg.extra.get("optimizer_format")
                if kind not in LAYOUT_FREE_OPTIMIZER_FORMATS:
                    self.stop_reason = (
                        f"cannot continue in-process: {chosen.reason}; the checkpoint of iteration {ckpt} holds the "
                        f"distributed optimizer's state as {kind or 'an unknown format'}, bound to the layout that "
                        f"wrote it, which a re-arranged job cannot load: relaunch with --load "
                        f"{self.cfg.extra.get('save_dir')} on the surviving machines (checkpoints saved with "
                        f"--dist-ckpt-optim-fully-reshardable, and every checkpoint saved after a failure, are "
                        f"loaded in-process instead)")
                    self.failures.append(rec)
                    return None
            if ckpt is None:
                self.stop_reason = (f"cannot continue: {chosen.reason}, and there is no Megatron checkpoint to "
                                    f"restore (no --save, or nothing saved yet); relaunch from the start")
                self.failures.append(rec)
                return None
            resume = ckpt  # Megatron's iteration N is N steps done: step N is the next
            ramp = self._inside_ramp(resume)
            if ramp is not None:  # the redo would train steps of the ramp on a plan
                self.stop_reason = (f"cannot continue in-process: {chosen.reason}, and the checkpoint of iteration "
                                    f"{ckpt} is inside the batch-size ramp ({ramp}); {self._relaunch_hint()}")
                self.failures.append(rec)
                return None
            self.log(f"restart: {chosen.reason}; the survivors load Megatron's checkpoint of iteration {ckpt} "
                     f"in-process, resuming at step {resume}")
        elif chosen.policy == "restart":
            ckpt = self.latest_checkpoint()
            resume = (ckpt + 1) if ckpt is not None else 0
            where = f"checkpoint of step {ckpt}" if ckpt is not None else "the initial weights (no checkpoint yet)"
            self.log(f"restart: {chosen.reason}; restoring {where}, resuming at step {resume}")
        return resume, ckpt

    def _tell_admitted(self, ranks: list[int]) -> None:
        """Joining ranks waiting for admission (``joining.wait_for_admission``): the generation just published."""
        for ident in ranks:
            self.store.set(ADMIT_KEY.format(ident), str(self.gen))

    def _standby_nodes(self) -> tuple[int, ...]:
        """Nodes all of whose ranks joined and are held as standbys (still alive)."""
        pending = self.join_requests.pending
        held = {i for i in self.held if i in pending and self._joiner(i).exitcode is None}
        return tuple(self._whole_nodes(held))

    def _whole_nodes(self, ranks: set[int]) -> list[int]:
        """The nodes every tensor-parallel rank of which is in ``ranks`` (a node joins whole)."""
        tp = self.cfg.tp
        return sorted({i // tp for i in ranks if all(i // tp * tp + t in ranks for t in range(tp))})

    def _lost_shards(self, dead_nodes: set[int]) -> frozenset[int]:
        """Units part of whose sharded optimizer state died with every rank keeping it: generation 0's
        distributed optimizer (each shard on its N instances), or, once a later generation has committed, the
        replicated shards over each unit's holders (``planning.sharding``)."""
        if not self.sharded_state:
            return frozenset()
        from ..megatron_lm.distributed_optimizer import shards_lost

        base = self.state_plan
        if self.state_gen > 0:  # (megatron-core < 0.15: the plain optimizer, whose state is whole on every holder)
            copies = self.profile.optimizer_shard_copies
            tied = self.cfg.layers if self.profile.tied_embeddings else None
            return frozenset(lost_units(base.holders(), dead_nodes, copies, tied)) if copies else frozenset()
        stages = shards_lost(self.cfg.pp, self.cfg.dp, int(self.cfg.extra["distopt_instances"]), set(dead_nodes))
        return frozenset(u for s in stages for u in base.stage_units(0, s))

    def _publish(self, rec: FailureRecord, plan: ExecutionPlan, msg: dict[str, Any], failure: bool = True) -> None:
        """Start the next generation: its state goes to the standby first, then its plan to the ranks."""
        self._close_superseded(time.time())
        self.gen += 1
        rec.generation = self.gen
        (self.failures if failure else self.replans).append(rec)
        self.plan = plan
        self.next_step = int(msg["resume_step"])
        self.step_started = time.time()
        self.started_gen = False
        self.warm = False
        self.progress.new_generation(time.time())
        self.held = set()  # standbys are considered again on the new plan
        msg.setdefault("redo_between", self.redo_between)
        if self.pending_drop is not None:  # its ranks say when they are inside the resume step (drop_gate)
            msg["say_inside"] = int(msg["resume_step"])
            self.pending_drop.rearm(self.gen, msg["say_inside"], time.time())
        msg.setdefault("save_on_entry", self._fragile(plan) and msg.get("policy") != "restart")
        rec.checkpoint_on_entry = bool(msg["save_on_entry"])
        self.published = msg
        if self.replica is not None:
            self._replicate_state()
            if self.pending_drop is None and self.drop_on_standby:  # the drop's recovery: it is carried out
                self._drop_to_standby()
        if self.quorum is not None:  # (the standby was lost silently: it may run the job with the others)
            self.quorum.check(self.members())
        self.store.set(self.key("plan"), encode_plan_message(msg))
        rec.published_at = time.time()
        self.write_report(ok=True, final=False)

    def _survivors_all_between(self, survivors: list[int]) -> bool:
        """Survivors hit between two iterations (Megatron-LM's training_log or a save: collectives outside the step)
        run that call again only if every survivor goes through it: hit in it too, or hit inside the step just
        committed, whose between-iterations code it runs next (``finishing``); else the call would wait for
        peers that had left it. (One round trip when all were between; else one or two per survivor until the
        first that is neither, which in the common case, a failure inside a step, is the first.)"""
        rk = self.key("recover")
        if not survivors:
            return False
        if self.store.check([f"{rk}/{i}/between" for i in survivors]):
            return True
        return all(self.store.check([f"{rk}/{i}/between"]) or self.store.check([f"{rk}/{i}/finishing"])
                   for i in survivors)

    def _fragile(self, plan: ExecutionPlan) -> bool:
        """``estimator.fragile`` in a job that checkpoints (Oobleck saves and stops below (f+1) n0 nodes for the
        same reason; Odyssey goes on training)."""
        return bool(self.cfg.checkpoint_interval) and fragile(plan, self.options.failure_bursts,
                                                              self.profile.optimizer_shard_copies,
                                                              self.profile.tied_embeddings)

    # -- the standby (control_plane) ------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """What a standby needs to go on from this agent's last decision (JSON)."""
        return {"gen": self.gen, "plan": self.plan.to_dict(), "state_plan": self.state_plan.to_dict(),
                "state_gen": self.state_gen,
                "published": self.published, "next_step": self.next_step,
                "dead": sorted(self.dead), "fenced": sorted(self.fenced), "started": self.started,
                "failures": [vars(f) for f in self.failures], "errors": {i: vars(r) for i, r in self.errors.items()},
                "checkpoints": {s: sorted(w) for s, w in self.checkpoints.items()},
                "latest_checkpoint": self._latest_checkpoint_if_any(),
                "pids": {i: getattr(p, "pid", None) for i, p in self.procs.items()},
                # ranks that joined through their machine's launcher: who fences them and whom an ask names
                "joined": {i: p.joined_pid for i, p in self.procs.items() if getattr(p, "joined_pid", None)},
                "agent_pid": os.getpid(), "started_any": self.gen > 0 or self.warm,
                "rejoin": self.rejoin,  # (--rejoin: which machines are back already, and which of them asked)
                # the report's records so far (a standby's report goes on from them; a standby agent cannot
                # admit the ranks waiting to join here: they leave with this agent's store)
                **self._diagnoses_and_joins()}

    def _diagnoses_and_joins(self) -> dict[str, list[dict[str, Any]]]:
        """The report's ``"diagnoses"`` and ``"joins"``: a lost agent's (restored) first, then this agent's."""
        return {"diagnoses": [r if isinstance(r, dict) else r.to_json() for r in self._diagnosis_entries()],
                "joins": self.restored_records["joins"] + [j.to_json() for j in self.joins]}

    def _diagnosis_entries(self) -> list[Any]:
        """A lost agent's diagnoses (report entries, and the record of a drop it left waiting: restored), then this
        agent's records."""
        return self.restored_records["diagnoses"] + self.slow_nodes.records

    def _pending_drop_json(self, fencing: bool = False) -> dict[str, Any] | None:
        """The drop waiting for the ranks (``drop_gate``), for the standby: the wait, its ranks, its report entry, and
        that entry's place among the diagnoses (the standby's copy of the generation's state may not hold the entry
        yet: the diagnosis came after it was written); ``fencing``: its ranks are being fenced now."""
        drop = self.pending_drop
        if drop is None:
            return None
        index = next(i for i, r in enumerate(self._diagnosis_entries()) if r is drop.action.record)
        return {**drop.to_json(), "ranks": list(drop.action.ranks), "record": drop.action.record.to_json(),
                "record_index": index, "fencing": fencing}

    def _drop_to_standby(self, fencing: bool = False) -> None:
        """Write the pending drop (or that there is none) ahead into the standby's store (``control_plane.DROP_KEY``)."""
        if self.replica is not None:
            spec = self._pending_drop_json(fencing)
            if self._to_standby(lambda replica: replica.drop(spec)):
                self.drop_on_standby = spec is not None

    def _replicate_state(self) -> None:
        snapshot, members = self.snapshot(), frozenset(self.members())
        if self._to_standby(lambda replica: replica.state(snapshot), members):
            self.replicated = members

    def _to_standby(self, write: Callable[[Replica], None], members: frozenset[int] | None = None) -> bool:
        """A write ahead into the standby's store (``Replica.write_ahead``); whether the standby acknowledged it. A
        standby that keeps failing costs the failover (said on the terminal), not the job; where its machine went
        silent rather than refused the connection it may be this machine that is cut off, and from then on a new
        generation needs a majority (``runtime.quorum``: of the generation the standby last acknowledged, and of
        ``members``, the one this write may or may not have reached). Deposed goes through."""
        if self.replica is None:
            return False
        try:
            self.replica.write_ahead(write)
            return True
        except ReplicaLost as lost:
            references = tuple(r for r in {self.replicated, members} if r)
            tie = " (or half, and the witness)" if self.witness is not None else ""
            alive = self._standby_may_live(references) if lost.answer == "refused" else None
            if lost.answer == "refused" and alive is None:  # its process is gone: it can never take over
                self.log_error(f"the standby agent's store stopped answering ({lost}): its process is gone; going "
                               f"on without a standby (losing this machine now ends the job)")
            elif lost.answer == "refused":
                self.quorum = Quorum(references, self.witness, GONE)
                self.log_error(f"the standby agent's store stopped answering ({lost}): its machine refuses the "
                               f"connection, but {alive}: a firewall between this machine and the standby's may "
                               f"reject the connections while it runs on; going on without a standby, and only with "
                               f"more than half of the job's {len(self.replicated)} ranks{tie}")
            else:
                # (a standby that received no state cannot take over: Standby.watch)
                self.quorum = Quorum(references, self.witness)
                self.log_error(f"the standby agent's store stopped answering ({lost}) and its machine is silent: it "
                               f"lost power or stands still, or this machine is cut off from the job; going on without "
                               f"a standby, and only with more than half of the job's "
                               f"{len(self.replicated)} ranks{tie}")
            self.replica = None
            if self.store is not None:  # a standby that comes back reads here that its copy of the state ends there
                when = f"step {self.next_step - 1} committed" if self.next_step > 0 else "before the first commit"
                self.store.set(DISMISSED_KEY, f"its store stopped answering at generation {self.gen}, {when}: {lost}")
            return False

    def _standby_may_live(self, references: tuple[frozenset[int], ...]) -> str | None:
        """Where the standby's machine refused its store's connection, why it may still run on (None: it cannot
        take the job). A refusal is its process gone, or a firewall that rejects between the two machines
        (``runtime.quorum``); a standby that lives takes over, but goes on only with at least half of a reference
        (``quorum.standby_check``), and the ranks that come to it are those that lost this agent. So the other
        machines' ranks are asked whether they reach the standby's store (``runtime.reachability``, one round):
        its side can hold only the ranks of machines that reach it or do not answer (their heartbeats stale, or
        no answer in the round; this machine's ranks never). Under half of every reference: gone. In a job of two
        machines without a witness, the other machine's ranks, lost with the standby, are half by themselves:
        there the refusal is taken for the loss it almost always is (the price: a rejecting firewall between the
        two is taken for it too, and both sides go on, ``quorum``'s docstring)."""
        now = time.time()
        live = [i for i in self.members() if i not in self.dead and i not in self.fenced]
        remote = [i for i in live if getattr(self.procs.get(i), "fence_key", None) is not None]
        if not remote:  # (only this machine's ranks: the standby cannot hold one)
            return None
        fresh = [i for i in live if not self._stale(i, now)]
        host, port = self.replica.address
        machines, reach = self._reach_round(fresh, target=f"{host}:{port}")
        answered = {r for m, group in machines.items() if m in reach and reachability.TARGET not in reach[m]
                    for r in group}
        side = sorted(i for i in remote if i not in answered)
        if not any(2 * len(reference & set(side)) >= len(reference) for reference in references):
            return None
        reached = sorted(r for m, group in machines.items() if reachability.TARGET in reach.get(m, ()) for r in group)
        said = f"ranks {reached} reach the standby's store" if reached else \
            f"ranks {side}, half of the job's or more, did not say whether they reach it"
        addresses = reachability.said_addresses(self.store, remote)  # (the other machines: one, in a job of two)
        two = len(addresses) == len(remote) and len(reachability.machines(addresses)) == 1
        if self.witness is None and not reached and two:
            self.log_error(f"the standby's machine refuses the connection and {said}: with two machines and no "
                           f"--witness-dir, taking it for its processes' loss (a firewall that rejects between the "
                           f"two would look the same)")
            return None
        return said

    def restore(self, state: dict[str, Any]) -> None:
        """Become the agent whose ``snapshot`` (with its newest commit merged in) this is."""
        self.gen, self.started = int(state["gen"]), float(state["started"])
        self.plan = ExecutionPlan.from_dict(state["plan"])
        committed_here = state.get("generation") == self.gen and "committed" in state
        self.state_plan = self.plan if committed_here else ExecutionPlan.from_dict(state["state_plan"])
        self.state_gen = self.gen if committed_here else int(state.get("state_gen", 0))
        self.next_step = int(state.get("next_step", self.next_step))
        self.dead, self.fenced = set(state["dead"]), set(state["fenced"])
        self.failures = [FailureRecord(**f) for f in state["failures"]]
        self.errors = {int(i): ErrorRecord(**r) for i, r in state["errors"].items()}
        self.checkpoints = {int(s): set(w) for s, w in state["checkpoints"].items()}
        self.published = state.get("published")
        self.warm = committed_here
        self.restored_records = {what: list(state.get(what, [])) for what in ("diagnoses", "joins")}
        self.pending_drop = self._restored_drop(state.get("pending_drop"))
        self.rejoin = [dict(spec) for spec in state.get("rejoin", self.rejoin)]

    def _restored_drop(self, spec: dict[str, Any] | None) -> PendingDrop | None:
        """The drop the lost agent left waiting: its report entry becomes a live record again (in its place among the
        restored diagnoses, or after them), which its fence or its fate amends. The takeover's generation tells the
        ranks the step to say (``_publish``). One the lost agent was fencing is not waited for again: its ranks are
        fenced, and lost, in the takeover's own recovery (:meth:`take_over`)."""
        if spec is None:
            return None
        record = DiagnosisRecord.from_json(spec["record"])
        entries, index = self.restored_records["diagnoses"], int(spec["record_index"])
        if index < len(entries):
            entries[index] = record
        else:
            entries.append(record)
        action = Action("drop", record, ranks=[int(i) for i in spec["ranks"]])
        if spec.get("fencing"):  # the others were inside the step already: its ranks are fenced at the takeover
            self.fence_on_takeover = list(action.ranks)
            for ident in action.ranks:
                self.dropping[ident] = record
            return None
        return PendingDrop.from_json(spec, action, time.time())

    def _fence_dropped_on_takeover(self) -> set[int]:
        """The ranks of a drop the lost agent was fencing (:meth:`_restored_drop`): fenced here if it had not killed
        them yet; lost in the takeover's recovery, which names the drop (``dropped``)."""
        dropped = {i for i in self.fence_on_takeover if i not in self.dead}  # (not: lost in a generation it started)
        for ident in sorted(dropped):
            proc = self.procs.get(ident)
            if proc is not None and proc.exitcode is None:
                self._fence(ident, "was being dropped as slow by the lost agent")
        return dropped

    def take_over(self, state: dict[str, Any], reason: str) -> int:
        """Go on from a lost agent's replicated ``state``: end every wait its ranks may be in (their commit,
        the generation's start, its plan), say so (``TAKEOVER_KEY``), then recover as after a failure."""
        from .errors import STARTED_KEY

        self.restore(state)
        self.takeover_at = time.time()
        g = self.key
        if self.gen > 0 and self.published is not None:
            self.store.set(g("plan"), encode_plan_message(self.published))
        if state.get("generation") == self.gen and "committed" in state:
            self.store.set(f"{g('commit')}/{state['committed']}", commit_value(float(state["loss"])))
        if state.get("started_any") or "committed" in state:  # every member had reached its first step
            for ident in self.members():
                self.store.set(STARTED_KEY.format(ident), "1")
        for spec in self.rejoin:  # a replacement told to ask to join is told again here (it may not have asked yet)
            if spec.get("due"):
                self.store.set(REJOIN_KEY.format(spec["rank"]), "1")
        latest = state.get("latest_checkpoint")
        if latest is not None:  # the restart fallback finds it complete here too
            for ident in self.checkpoints.get(int(latest), ()):
                self.store.set(f"{g('ckpt')}/{latest}/{ident}", "1")
        self.store.set(g("abort"), reason)
        self.store.set(TAKEOVER_KEY, json.dumps({"generation": self.gen, "committed": self.next_step - 1,
                                                 "reason": reason}))
        self.log(f"taking over at generation {self.gen}, step {self.next_step}: {reason}")
        lost_as = state.get("lost_as", GONE)  # (the report is the standby's once it knows it holds the job)
        info = {"reason": reason, "lost_agent_s": float(state.get("lost_agent_s", 0.0)), "lost_as": lost_as}
        dropped = self._fence_dropped_on_takeover()
        try:
            ok = self.recover(dropped, takeover=info)
        except NoQuorum as exc:
            self.step_down(str(exc))
        except Exception as exc:  # noqa: BLE001 - say why, and stop the ranks rather than leave them waiting
            ok, self.stop_reason = False, f"the takeover failed: {type(exc).__name__}: {exc}"
        if not ok:
            self.give_up(self.stop_reason or "the takeover failed")
            self.write_report(ok=False)
            return 1
        return self.supervise()

    # -- planning inputs ------------------------------------------------------------------------------
    def _refresh_cache(self) -> None:
        """Precompute decisions for every failure of up to ``cache_depth`` nodes of the current layout
        (Odyssey revision IV-A) in a background thread, with its own planner (no shared memo state);
        until it is filled, a failure is planned on demand."""
        self.cache = None
        if self.cache_depth == 0:
            return
        base = self.state_plan
        planner = Planner(self.profile, self.cfg.global_batch, self.cfg.micro_batch, self.options)
        cache = PlanCache(planner, base, self.cache_depth)

        def fill() -> None:
            try:
                cache.precompute()
            except PlanningError:
                return
            if self.state_plan is base:
                self.cache = cache

        threading.Thread(target=fill, name="odyssey-plan-cache", daemon=True).start()

    def _adopt_device(self, device: dict[str, Any]) -> None:
        """``odyssey train``: plan from the device rank 0 measured (this process never touches it: the
        ranks are spawned, and a device context here would only cost memory)."""
        from .device_profile import job_profile

        if device.get("kind", "cpu") == "cpu":
            self.cfg.extra["device"] = device
            return
        if self.cfg.shared_device:  # the ranks take turns on one device: each gets a share of it
            device = {**device, "flops": device["flops"] / self.cfg.nproc,
                      "memory_bytes": device["memory_bytes"] // self.cfg.nproc}
        self.cfg.extra["device"] = device
        self._plan_from(job_profile(self.cfg, **self.cfg.extra.get("profile_overrides", {})))
        self.log(f"planning from the device: {device.get('name')}, {device.get('flops', 0) / 1e12:.1f} TFLOP/s "
                 f"measured, {device.get('memory_bytes', 0) / 2**30:.0f} GiB")

    def _adopt_measured_profile(self) -> None:
        """Once every rank has published Megatron's measured forward-backward (``--odyssey-profile-iters``),
        plan from the analytic profile rescaled so the generation-0 plan's estimated step matches it. The
        slowest rank's time is the step's (the first stage finishes last in 1F1B)."""
        from .device_profile import calibrated_profile

        keys = [f"odyssey/profile/{i}" for i in self.members()]
        if not self.store.check(keys):
            return
        measured = [json.loads(self.store.get(k)) for k in keys]
        step_s = max(m["forward_backward_s"] for m in measured)
        cal = calibrated_profile(self.cfg, step_s, base=self.profile)
        self._plan_from(cal.profile)
        self.measured = True
        layers = [u.forward_s + u.backward_s for u in self.profile.layers]
        self.log(f"planning from the measured profile (forward-backward {step_s:.4g} s over "
                 f"{min(m['iterations'] for m in measured)} iterations, analytic compute x{cal.factor:.3g}; "
                 f"a layer takes {1e3 * statistics.median(layers):.3g} ms forward+backward per micro-batch)")

    def _plan_from(self, profile) -> None:
        """Plan every later failure from ``profile``: a new planner, and the plan cache refilled."""
        self.profile = profile
        self.planner = Planner(profile, self.cfg.global_batch, self.cfg.micro_batch, self.options)
        self._refresh_cache()

    def _apply_policy(self, decision: Decision) -> Candidate:
        """The planner's choice, or the forced policy when it is feasible (else say why not)."""
        if self.cfg.policy == "auto":
            return decision.chosen
        family = {"fill": "reroute", "stagger": "reroute", "normalise": "reconfigure"}.get(self.cfg.policy,
                                                                                         self.cfg.policy)
        # of that kind, the feasible one Eq. 8 scores best (a normalised reroute comes plain, filled and staggered)
        of_kind = sorted((c for c in decision.candidates if c.kind == self.cfg.policy),
                         key=lambda c: (c.feasible, c.score), reverse=True)
        forced = of_kind[0] if of_kind else next(c for c in decision.candidates if c.policy == family)
        if forced.feasible and forced.kind == self.cfg.policy:
            return forced
        self.log(f"--policy {self.cfg.policy} is not possible here ({forced.reason}); using {decision.policy}")
        return decision.chosen

    def _phase_of(self, ranks: set[int], step: int) -> str:
        """The phase a fault was injected in; else, for a failure nobody injected (every one on a real cluster), the
        one the rank's last heartbeat named, within a heartbeat interval of where it stopped."""
        for r in ranks:
            for (rank, s), phase in self.phases.items():
                if rank == r and s <= step:
                    return phase
        heard = [self.beats[r] for r in sorted(ranks) if r in self.beats and self.beats[r].phase]
        return f"{heard[0].phase} (its last heartbeat)" if heard else "unknown"

    # -- end ------------------------------------------------------------------------------------------
    def step_down(self, why: str) -> None:
        """The smaller side of a partition (``runtime.quorum``): stop this side's ranks and leave, writing no report
        (the other side's agent writes the job's) and withdrawing a takeover (so the agent, once the network mends,
        is not deposed by a standby that did not take the job)."""
        self.log_error(f"stepping down: {why}")  # (not the job's stop: the other side goes on with it)
        if self.takeover_at:
            try:
                self.store.delete_key(TAKEOVER_KEY)
            except Exception:  # noqa: BLE001 - (our own store)
                pass
        self.stop_all()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(STEPPED_DOWN_EXIT)  # no atexit: it would wait for ranks it cannot reach

    def stop_all(self) -> None:
        for p in self.procs.values():
            if p.exitcode is None:
                p.kill()
        for p in self.joiners.values():
            if p.poll() is None:
                p.kill()

    def _last_traceback(self, ident: int) -> str:
        return rank_log_traceback(self.workdir, ident) + f"\n(log: {self.workdir / f'rank{ident}.log'})"

    def _tail(self, ident: int) -> str:
        path = self.workdir / f"rank{ident}.log"
        return "  " + "\n  ".join(path.read_text().strip().splitlines()[-12:]) if path.exists() else ""

    def write_report(self, ok: bool, final: bool = True) -> None:
        """The JSON report: at the end, and (``final=False``, ``"running": true``) after every failure and
        takeover, so a lost machine does not take the job's record with it."""
        if not self.cfg.report:
            return
        devices = {i: self.store.get(f"odyssey/device/{i}").decode() for i in sorted(self.procs)
                   if self.store is not None and self.store.check([f"odyssey/device/{i}"])}
        report = {"ok": ok, "running": not final, "steps": self.steps.records(),
                  "failures": failure_entries(self.failures, self.started),
                  "takeovers": takeover_entries(self.failures), **self._diagnoses_and_joins(),
                  **({"ended_by_script": self.ended_by} if self.ended_by else {}),
                  "profile": self.profile.name, "devices": devices, "host": host_summary(),
                  "final_plan": self.plan.to_dict(), "config": {k: v for k, v in vars(self.cfg).items()}}
        write_report_file(Path(self.cfg.report), report)


def megatron_checkpoint_iteration(save_dir: str | None) -> int | None:
    """The iteration of the newest complete checkpoint in a Megatron ``--save`` folder (Megatron writes its
    tracker file only once every rank has finished writing), or None."""
    if not save_dir:
        return None
    tracker = Path(save_dir) / "latest_checkpointed_iteration.txt"
    try:
        text = tracker.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def run_agent(cfg_path: Path, workdir: Path, echo_rank0: bool = True) -> int:
    from .control_plane import parse_address

    cfg = TrainConfig.load(cfg_path)
    standby = cfg.extra.get("control", {}).get("standby")
    if standby:  # before the slow start-up: the standby must not take a starting agent for a lost one
        from .control_plane import AGENT_PID_KEY, client

        said = client(parse_address(standby), 60.0)
        said.set(AGENT_PID_KEY, str(os.getpid()))
        said.check([AGENT_PID_KEY])
        del said  # (closed before the ranks are forked: see Agent.run)
    agent = Agent(cfg, cfg_path, workdir, echo_rank0)
    return agent.run(parse_address(standby) if standby else None)


def run_standby(cfg_path: Path, workdir: Path) -> int:
    """``odyssey train --standby-agent``: a second agent process on this machine, with its own store, that
    takes over the job (and the ranks the first one forked) when the first one's process is lost."""
    from .control_plane import PidRank, Standby, parse_address

    cfg = TrainConfig.load(cfg_path)
    control = cfg.extra["control"]
    host, port = parse_address(control["standby"])
    store = serve(host, port, cfg.timeout_s)
    report = Path(cfg.report) if cfg.report else workdir / "report.json"
    watcher = Standby(store, parse_address(control["primary"]), report.with_suffix(".standby.steps.jsonl"),
                      takeover_after_s=float(control.get("takeover_after_s", 2.0)), same_machine=True)
    result = watcher.watch()
    if isinstance(result, int):
        return result
    procs = {int(i): PidRank(int(pid), store, int(i)) for i, pid in result["pids"].items() if pid}
    return take_over(Agent(cfg, cfg_path, workdir, echo_rank0=False, procs=procs, store=store), result, watcher,
                     f"the agent's process was lost; the standby agent (pid {os.getpid()}) took over")


def take_over(agent: Agent, state: dict[str, Any], watcher: Any, reason: str) -> int:
    """Hand the job to ``agent`` (a standby's): its step log continues the one the standby copied."""
    for record in StepLog.read(watcher.steps_path):
        agent.steps.append(record)
    return agent.take_over(state, reason)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="odyssey agent: hosts the store, runs the ranks, coordinates recovery")
    parser.add_argument("--config", required=True, type=Path)
    parser.add_argument("--workdir", required=True, type=Path)
    parser.add_argument("--quiet", action="store_true", help="do not echo rank 0's output")
    parser.add_argument("--standby", action="store_true", help="be the standby agent (takes over a lost agent)")
    args = parser.parse_args(argv)
    if args.standby:
        sys.exit(run_standby(args.config, args.workdir))
    sys.exit(run_agent(args.config, args.workdir, echo_rank0=not args.quiet))


if __name__ == "__main__":
    main()
