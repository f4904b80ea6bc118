"""``odyssey-launch``: start a Megatron-LM script on one or more machines with Odyssey's agent beside it.

Takes torchrun's arguments (``--nnodes --node-rank --nproc-per-node --master-addr --master-port``)
and gives every rank torchrun's environment (``RANK LOCAL_RANK WORLD_SIZE LOCAL_WORLD_SIZE
MASTER_ADDR MASTER_PORT``), so ``pretrain_gpt.py`` needs no change beyond the adaptor import. What it
does *not* take from torchrun is the supervision: torchrun's elastic agent stops every worker of a
machine as soon as one fails (then restarts them all), which is the relaunch Odyssey exists to avoid.
Here each machine runs a node agent that starts its ranks and only reports their exits; machine 0
also runs the coordinator (:class:`~megatron_odyssey.runtime.agent.Agent`), which hosts the control
store on ``--odyssey-port`` (default ``--master-port`` + 1), detects failures from exits and
heartbeats, fences hung ranks through their node agent, and coordinates recovery. With more than one
machine, machine 1 also runs the standby agent (:mod:`~megatron_odyssey.runtime.control_plane`) on
``--standby-port`` (default ``--odyssey-port`` + 1): the coordinator writes its state into it ahead of
every commit, and when machine 0 (or only its launcher) is lost the standby takes the job over; the
ranks and the other machines' node agents follow it. ``--witness-dir`` (a directory both machines 0 and 1 share)
takes the tie of a partition that cuts the job in two halves, a two-machine job's included (``runtime.quorum``).

    odyssey-launch --nproc-per-node 8 [--nnodes 2 --node-rank 0 --master-addr HOST] pretrain_gpt.py ARGS

A machine that comes back (repaired, or spot capacity returning) joins the running job with the same command
line and ``--join HOST:PORT`` (the agent's store, written to ``agent.address`` in machine 0's workdir): its
ranks, numbered as at launch, set Megatron up in a private world and ask the agent to join
(:mod:`megatron_odyssey.megatron_lm.joining`); this launcher supervises them like a node agent.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from .runtime.control_plane import (LEAVING_KEY, STANDBY_KEY, free_port,  # (no torch: the launcher starts fast)
                                    judged_lost_after, rank_fence_key)
from .runtime.errors import (DUMP_STACKS_KEY, GIVEUP_KEY, LOCAL_ERROR_EXIT, STACKS_ASKED_KEY, STOPPED_EXIT,
                             describe_exit, rank_log_stack, rank_log_traceback)
from .runtime.joining import CONFIG_KEY, PublishedConfig, read_job_config  # (rank 0 publishes it at train()
from .runtime.pause_clock import StandStillFences
from .runtime.process_probe import RANK_PID_KEY, ProbeRequests, RemoteProcess
from .runtime.quorum import Witness, WitnessNotShared
from .runtime.sockets import MIN_UNACKED_S, SILENCE_ENV, UNACKED_S
from .runtime.stuck_restart import MAX_RESTARTS, StuckRestarts, record_times

FINISHED_KEY = "odyssey/finished"  # the agent ran the job to its end (its exit code): node agents stop
AWAITING_END_KEY = "odyssey/awaiting-end"  # machines whose ranks ended before the job ("node;" each) wait for it
SAW_END_KEY = "odyssey/saw-end/{}"  # ... and say here that they read its exit code
FINISH_WAIT_S = 5.0  # how long the agent's launcher keeps its store up for those machines to read the job's end

EXIT_KEY = "odyssey/exit/{}"  # node agents report a rank's exit code here
EXITS_KEY = "odyssey/exits"  # ... and append "rank:code;" here: the coordinator reads every exit in one get
WITNESS_ENV = "ODYSSEY_WITNESS_DIR"  # odyssey-launch --witness-dir, for scripts/odyssey_launch.sh
WITNESS_KEY = "odyssey/witness"  # machine 0: the job's witness directory ("" for none)
WITNESS_SEEN_KEY = "odyssey/witness-seen"  # machine 1: "" where the standby sees it, else why not
STARTUP_GRACE_S = 3.0  # after a rank fails at start-up, how long the others get to fail too (and say why)


class LocalRank:
    """A rank process on this machine, with the interface the agent expects of a process."""

    def __init__(self, popen: subprocess.Popen):
        self.popen = popen

    @property
    def pid(self) -> int:
        return self.popen.pid

    @property
    def exitcode(self) -> int | None:
        return self.popen.poll()

    def kill(self) -> None:
        """SIGKILL the rank's whole process group: its data-loader workers inherit its sockets, and
        while one lives the peers see no connection reset (they would wait ~5 s for the workers to
        notice their parent's death)."""
        try:
            os.killpg(self.popen.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def join(self, timeout: float | None = None) -> None:
        try:
            self.popen.wait(timeout)
        except subprocess.TimeoutExpired:
            pass

    def send(self, signum: int) -> None:
        """``signum`` to the rank's process group, as torchrun's ``close`` does (its data-loader workers too)."""
        try:
            os.killpg(self.popen.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


class Termination:
    """SIGTERM to ``odyssey-launch`` (a scheduler ending or preempting the job, a deleted pod): passed on to this
    machine's ranks as torchrun does, so that Megatron's ``--exit-signal-handler`` can save and exit; a rank still
    running ``grace_s`` later is SIGKILLed (torchrun: 30 s). The agent, once told (``signum``), ends the job when
    ranks end instead of recovering from them: every machine of the job is being stopped, not one lost."""

    def __init__(self, local: dict[int, LocalRank], grace_s: float = 30.0):
        self.local, self.grace_s = local, grace_s
        self.signum: int | None = None

    def install(self) -> None:
        if threading.current_thread() is threading.main_thread():  # (Python runs signal handlers there only)
            signal.signal(signal.SIGTERM, self._received)

    def _received(self, signum: int, frame: Any) -> None:
        if self.signum is not None:
            return
        self.signum = signum
        print(f"[odyssey launch] received {signal.Signals(signum).name}: passing it to the ranks (those still running "
              f"after {self.grace_s:g} s are killed)", file=sys.stderr, flush=True)
        for rank in self.local.values():
            rank.send(signum)
        timer = threading.Timer(self.grace_s, self._kill_the_rest)
        timer.daemon = True  # the launcher leaves as soon as its ranks have
        timer.start()

    def _kill_the_rest(self) -> None:
        running = [ident for ident, rank in sorted(self.local.items()) if rank.exitcode is None]
        if running:  # (on the terminal: the agent then sees SIGKILLs, which say nothing of why)
            print(f"[odyssey launch] rank(s) {running} still running {self.grace_s:g} s after "
                  f"{signal.Signals(self.signum).name}: killing them (a save on "
                  f"--exit-signal-handler that needs longer: raise --termination-grace)", file=sys.stderr, flush=True)
        for ident in running:
            self.local[ident].kill()

    @property
    def reason(self) -> str:
        name = signal.Signals(self.signum).name if self.signum else "a signal"
        return f"odyssey-launch received {name} and passed it to the ranks: the job is being stopped, not recovered"


def exits_reported(store: Any) -> int:
    """How much of the exit log exists now (see ``RemoteExits(after=)``)."""
    return len(store.get(EXITS_KEY)) if store.check([EXITS_KEY]) else 0


def report_exit(store: Any, ident: int, code: int) -> None:
    """A node agent's report of one of its ranks' exit."""
    store.set(EXIT_KEY.format(ident), str(code))
    store.append(EXITS_KEY, f"{ident}:{code};")


class RemoteExits:
    """Exit codes of the ranks on other machines, for the coordinator: one store round trip per look, and at
    most one look every few milliseconds, however many ranks there are (the agent asks for every rank's exit
    code in every pass of its loop; one store lookup per rank would grow with the job). ``after``: only exits
    reported after that many bytes of the key (a rank that joined again: its earlier life's exit is history)."""

    def __init__(self, store: Any, every_s: float = 0.004, after: int = 0):
        self.store, self.every_s, self.read_at, self.codes, self.after = store, every_s, 0.0, {}, after

    def code(self, ident: int) -> int | None:
        now = time.monotonic()
        if now - self.read_at >= self.every_s:
            self.read_at = now
            if self.store.check([EXITS_KEY]):
                for item in self.store.get(EXITS_KEY).decode()[self.after:].split(";"):
                    if item:
                        rank, code = item.split(":")
                        self.codes[int(rank)] = int(code)
        return self.codes.get(ident)


class RemoteRank:
    """A rank on another machine, seen through the store its node agent reports to. ``joined_pid``: the process of
    a rank that joined the running job (``odyssey-launch --join``), whose node agent obeys only that process's own
    fence key and answers only asks that name it; an agent that takes the job over is given it again (the lost
    agent's replicated ``"joined"``), or could neither fence that rank nor ask about it."""

    def __init__(self, store: Any, ident: int, exits: RemoteExits | None = None, joined_pid: int | None = None):
        self.store, self.ident, self.exits = store, ident, exits or RemoteExits(store, every_s=0.0)
        self.joined_pid = joined_pid
        self.fence_key = rank_fence_key(ident, joined_pid)
        self.process_probe = RemoteProcess(store, ident, pid=joined_pid)  # its process, as its node agent samples it

    @property
    def exitcode(self) -> int | None:
        return self.exits.code(self.ident)

    def kill(self) -> None:
        self.store.set(self.fence_key, "1")

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="odyssey-launch", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nnodes", type=int, default=1, help="machines in the job (default 1)")
    p.add_argument("--node-rank", "--node_rank", type=int, default=0, help="this machine's index, 0..nnodes-1")
    p.add_argument("--nproc-per-node", "--nproc_per_node", type=int, default=1, help="ranks on this machine")
    p.add_argument("--master-addr", "--master_addr", default="127.0.0.1", help="machine 0's address")
    p.add_argument("--master-port", "--master_port", type=int, default=29500, help="torch.distributed's store port")
    p.add_argument("--odyssey-port", type=int, default=None, help="the agent's control store (default master port + 1)")
    p.add_argument("--standby-port", type=int, default=None,
                   help="machine 1's standby agent's store (default odyssey port + 1)")
    p.add_argument("--standby-addr", default=None,
                   help="machine 1's address as the others reach it (default: found from the route to --master-addr)")
    p.add_argument("--no-standby", action="store_true",
                   help="no standby agent on machine 1: losing machine 0 (or its launcher) then ends the job")
    p.add_argument("--witness-dir", default=None, metavar="DIR",
                   help=f"a directory on storage machines 0 and 1 share (e.g. the checkpoints' network file system): "
                        f"where a partition cuts the job into two halves (two machines: one each), the side that "
                        f"claims it first trains on; without one the standby's side does, a two-machine job whose "
                        f"machine 1 goes silent stops, and one whose two machines a firewall that rejects cuts apart "
                        f"trains on both sides (default ${WITNESS_ENV}; machine 0's is the job's: another one given on "
                        f"machine 1 is refused)")
    p.add_argument("--workdir", type=Path, default=Path("odyssey-run"), help="per-rank logs (default odyssey-run)")
    p.add_argument("--no-python", action="store_true", help="run the script as an executable (like torchrun)")
    p.add_argument("--join", default=None, metavar="HOST:PORT",
                   help="this machine comes back to a running job: its ranks (numbered as at launch, --node-rank x "
                        "--nproc-per-node) join it at an iteration boundary when the planner admits them; HOST:PORT "
                        "is the job's agent (agent.address in machine 0's --workdir)")
    p.add_argument("--termination-grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM to this launcher, the ranks get SIGTERM (Megatron's --exit-signal-handler saves "
                        "and exits) and are killed if still running S seconds later (default 30, as torchrun)")
    p.add_argument("--stuck-restarts", type=int, default=MAX_RESTARTS, metavar="N",
                   help=f"a node whose rank left the job stuck in a collective (gloo never wakes a send queued on a "
                        f"connection that closed; the rank says so on the terminal), or was fenced for its silence "
                        f"while this machine stood still whole (a VM paused by its host, then resumed), is healthy: "
                        f"its ranks are started again to join the running job, at most N times per node (default "
                        f"{MAX_RESTARTS}; 0: never)")
    p.add_argument("--silence-timeout", type=float, default=None, metavar="S",
                   help=f"a machine whose kernel acknowledges nothing for S seconds (lost power or network) is taken "
                        f"as lost: every connection to it, the ranks' included, is aborted (default ${SILENCE_ENV}, "
                        f"else {UNACKED_S:g}); raise it on a network whose blips last longer, or each blip costs a "
                        f"recovery")
    p.add_argument("script", help="the training script, e.g. Megatron-LM's pretrain_gpt.py")
    p.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments (with --odyssey to enable recovery)")
    args = p.parse_args(argv)
    for name in ("nnodes", "nproc_per_node"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not 0 <= args.node_rank < args.nnodes:
        p.error(f"--node-rank {args.node_rank} is outside 0..{args.nnodes - 1}")
    if args.stuck_restarts < 0:
        p.error(f"--stuck-restarts must be 0 (never) or more, got {args.stuck_restarts}")
    if not args.termination_grace > 0:
        p.error(f"--termination-grace must be a positive number of seconds, got {args.termination_grace}")
    if args.silence_timeout is None:
        said = os.environ.get(SILENCE_ENV, str(UNACKED_S))
        try:
            args.silence_timeout = float(said)
        except ValueError:
            p.error(f"{SILENCE_ENV}={said!r} (--silence-timeout) is not a number of seconds")
    if not args.silence_timeout >= MIN_UNACKED_S:  # (NaN too)
        p.error(f"--silence-timeout must be at least {MIN_UNACKED_S:g} seconds (one unanswered keepalive probe), "
                f"got {args.silence_timeout}")
    for name in ("master_port", "odyssey_port", "standby_port"):
        port = getattr(args, name)
        if port is not None and not 1 <= port <= 65534:
            p.error(f"--{name.replace('_', '-')} must be a TCP port in 1..65534, got {port}")
    if not args.no_python and not Path(args.script).is_file():
        p.error(f"the script {args.script} does not exist")
    if args.odyssey_port is None:
        args.odyssey_port = args.master_port + 1
    if args.standby_port is None:
        args.standby_port = args.odyssey_port + 1
    args.standby = args.nnodes > 1 and not args.no_standby
    given, args.witness = args.witness_dir is not None, None
    if not given:
        args.witness_dir = os.environ.get(WITNESS_ENV) or None
    if args.witness_dir is not None and not args.standby:
        if given:
            p.error("--witness-dir takes the tie between the agent and its standby: it needs --nnodes 2 or more, "
                    "without --no-standby")
        args.witness_dir = None  # (the script's environment, for any job)
    args.witness_said = "--witness-dir" if given else f"{WITNESS_ENV} (--witness-dir)"  # (for what names it)
    if args.witness_dir is not None and args.node_rank == 0 and not Path(args.witness_dir).is_dir():
        p.error(f"{args.witness_said} {args.witness_dir} is not a directory")
    return args


def start_ranks(args: argparse.Namespace, joining: dict[str, Any] | None = None,
                only: list[int] | None = None) -> dict[int, LocalRank]:
    """This machine's ranks, each with torchrun's environment plus the agent's store address. ``joining``
    (``--join``): each node (``tp`` ranks) gets torchrun's variables for a private world of its own, and the
    global rank it joins as (``ODYSSEY_JOIN_RANK``). ``only``: these ranks of the machine (a node started again,
    ``runtime.stuck_restart``), whose logs go on after their earlier life's."""
    world = args.nnodes * args.nproc_per_node
    args.workdir.mkdir(parents=True, exist_ok=True)
    procs = {}
    private_ports: dict[int, int] = {}
    for local in range(args.nproc_per_node):
        rank = args.node_rank * args.nproc_per_node + local
        if only is not None and rank not in only:
            continue
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(local), WORLD_SIZE=str(world),
                   LOCAL_WORLD_SIZE=str(args.nproc_per_node), GROUP_RANK=str(args.node_rank),
                   MASTER_ADDR=args.master_addr, MASTER_PORT=str(args.master_port),
                   ODYSSEY_STORE=f"{args.master_addr}:{args.odyssey_port}", ODYSSEY_WORKDIR=str(args.workdir),
                   ODYSSEY_STANDBY="expected" if args.standby else "none",
                   TORCH_SHOW_CPP_STACKTRACES=os.environ.get("TORCH_SHOW_CPP_STACKTRACES", "0"))
        if joining is not None:
            tp = joining["tp"]
            port = private_ports.setdefault(local // tp, free_port())
            env.update(RANK=str(local % tp), WORLD_SIZE=str(tp), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       ODYSSEY_STORE=joining["address"], ODYSSEY_JOIN_RANK=str(rank),
                       ODYSSEY_STANDBY="expected" if joining["standby"] else "none")
        cmd = ([args.script] if args.no_python else [sys.executable, "-u", args.script]) + args.script_args
        log = open(args.workdir / f"rank{rank}.log", "w" if only is None else "a")
        if only is not None:
            log.write(f"\n[odyssey launch] rank {rank} started again (joins the running job)\n")
            log.flush()
        echo = rank == world - 1  # Megatron logs training progress on the last rank
        procs[rank] = LocalRank(subprocess.Popen(cmd, env=env, stdout=None if echo else log, stderr=log,
                                                 start_new_session=True))  # own process group (see kill)
    return procs


def coordinate(args: argparse.Namespace, local: dict[int, LocalRank], termination: Termination | None = None) -> int:
    """Machine 0: host the store, wait for the job's description from rank 0, supervise."""
    from .runtime.agent import Agent
    from .runtime.control_plane import every_interface, serve

    store = serve(every_interface(args.master_addr), args.odyssey_port, 300)
    if args.standby:
        store.set(WITNESS_KEY, str(args.witness.directory) if args.witness else "")
    world = args.nnodes * args.nproc_per_node
    exits = RemoteExits(store)
    procs: dict[int, Any] = {i: local.get(i) or RemoteRank(store, i, exits) for i in range(world)}
    while not store.check([CONFIG_KEY]):  # rank 0 publishes it when Megatron's train() starts
        if _witness_refused(args, store, local):
            return 1
        codes = {i: p.exitcode for i, p in procs.items()}
        if all(c == 0 for c in codes.values()):
            return 0  # a job without --odyssey: odyssey-launch was just its launcher
        dead = {i: c for i, c in codes.items() if c not in (None, 0)}
        if dead and termination is not None and termination.signum:
            print(f"[odyssey launch] {termination.reason} (before training started)", file=sys.stderr)
            return 128 + termination.signum
        if dead:
            grace = time.monotonic() + STARTUP_GRACE_S  # ranks failing with it show their errors too
            while time.monotonic() < grace and any(p.exitcode is None for p in procs.values()):
                time.sleep(0.05)
            dead = {i: c for i, p in procs.items() if (c := p.exitcode) not in (None, 0)}
            for p in procs.values():
                p.kill()
            print(f"[odyssey launch] rank(s) {sorted(dead)} exited {sorted(set(dead.values()))} before training "
                  f"started:\n{startup_errors(args.workdir, sorted(dead))}\n[odyssey launch] logs: "
                  f"{args.workdir.resolve()}/rank*.log", file=sys.stderr)
            return 1
        time.sleep(0.05)
    cfg = read_job_config(store)
    agent = Agent(cfg, None, args.workdir, procs=procs, store=store)
    agent.termination = termination
    agent.witness = args.witness
    from .runtime.joining import ADDRESS_FILE

    (args.workdir / ADDRESS_FILE).write_text(f"{args.master_addr}:{args.odyssey_port}\n")  # for --join
    if args.standby:
        from .runtime.control_plane import parse_address
        from .runtime.generation import wait_key

        # machine 1's launcher registers it at its start (the ranks wait for it too)
        agent.attach_replica(parse_address(wait_key(store, STANDBY_KEY, "the standby agent's address",
                                                    cfg.timeout_s).decode()))
        if _witness_refused(args, store, local):  # (said before the address: read now)
            return 1
    restarts, watch = restart_stuck_on_machine_0(args, local)
    try:
        code = agent.supervise()
    finally:
        restarts.set()
        if watch is not None:  # (a thread left inside a store call when the interpreter exits aborts the process)
            watch.join(10)
    finish_job(store, code)
    return code


def _witness_refused(args: argparse.Namespace, store: Any, local: dict[int, LocalRank]) -> bool:
    """Machine 0: the standby's machine does not see the witness directory (``--witness-dir`` is not shared), or was
    given another (:func:`standbys_witness`); the job stops before it trains, saying so, rather than run with a
    witness only one side can claim, or one the user did not mean."""
    if not args.standby or not store.check([WITNESS_SEEN_KEY]):
        return False
    why = store.get(WITNESS_SEEN_KEY).decode()
    if not why:
        return False
    print(f"[odyssey launch] {why}; the job stops before it trains", file=sys.stderr, flush=True)
    for p in local.values():
        p.kill()
    finish_job(store, 1)
    return True


def finish_job(store: Any, code: int, wait_s: float = FINISH_WAIT_S) -> None:
    """Say the job's end (its exit code) to every machine; the store goes away with this process, so the launchers
    waiting for that end (their ranks ended before it: :func:`await_the_jobs_end`) get up to ``wait_s`` to read it."""
    store.set(FINISHED_KEY, str(code))
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        waiting = store.get(AWAITING_END_KEY).decode() if store.check([AWAITING_END_KEY]) else ""
        if all(store.check([SAW_END_KEY.format(node)]) for node in set(waiting.split(";")) - {""}):
            return
        time.sleep(0.02)


def startup_errors(workdir: Path, ranks: list[int]) -> str:
    """The last traceback in each failed rank's log, each distinct one once (with the ranks it hit)."""
    seen: dict[str, list[int]] = {}
    for rank in ranks:
        seen.setdefault(rank_log_traceback(workdir, rank), []).append(rank)
    return "\n".join(f"--- rank(s) {who}:\n{text}" for text, who in seen.items())


def serve_node(args: argparse.Namespace, local: dict[int, LocalRank], termination: Termination | None = None) -> int:
    """Machines 1..: report rank exits to the coordinator and fence ranks it asks to fence; machine 1 also
    runs the standby agent (see :func:`standby_node`)."""
    from .runtime.control_plane import ControlPlane, client, parse_address
    from .runtime.generation import wait_key

    store = client((args.master_addr, args.odyssey_port), 300)
    if args.standby and args.node_rank == 1:
        return standby_node(args, local, store, termination)
    standby = None
    if args.standby:
        standby = parse_address(wait_key(store, STANDBY_KEY, "the standby agent's address", 300).decode())
    # (standby or not: a broken connection to the agent is made again)
    control = ControlPlane((args.master_addr, args.odyssey_port), standby, -1, wait_s=120)
    return node_agent(args, local, store, control, termination=termination)


class StackRequests:
    """The agent's requests for the stacks of this machine's ranks (``DUMP_STACKS_KEY``): each new one is passed on
    as the signal it names (the rank's faulthandler writes its stacks to its log). Polled every half second."""

    def __init__(self, local: dict[int, "LocalRank"]):
        self.local, self.seen, self.polled = local, {}, 0.0

    def poll(self, store: Any, reported: set[int]) -> None:
        if time.monotonic() - self.polled < 0.5:
            return
        self.polled = time.monotonic()
        for ident, p in self.local.items():
            key = DUMP_STACKS_KEY.format(ident)
            if ident in reported or not store.check([key]):
                continue
            value = store.get(key).decode()
            if self.seen.get(ident) != value:
                self.seen[ident] = value
                try:
                    os.kill(p.pid, int(value.split()[0]))
                except OSError:
                    pass


def learn_when_lost(control: Any, cfg: Any) -> None:
    """Once training started (``cfg``: the job's config, once rank 0 published it): when the job will have dropped
    this machine's ranks, which bounds a wait for agents this machine cannot reach (``ControlPlane.lost_after_s``)."""
    if control is not None and control.lost_after_s is None and cfg is not None:
        control.lost_after_s = judged_lost_after(cfg.heartbeat_timeout_s)


def node_agent(args: argparse.Namespace, local: dict[int, LocalRank], store: Any, control: Any = None,
               stop: Any = None, termination: Termination | None = None, direct: Iterable[int] = ()) -> int:
    """Report this machine's rank exits and fence the ranks the agent asks to fence, until every rank has
    exited or the agent finished the job; follows the standby when it takes over (``control``); starts a node whose
    rank left stuck in a collective again, to join the job (``runtime.stuck_restart``). Exits with the job's code
    where it learns it (see :func:`await_the_jobs_end`). ``direct``: ranks the agent supervises itself (machine 0's:
    :func:`restart_stuck_on_machine_0` runs this to start them again); their exits are neither reported nor said,
    and only a life started here again is supervised as any machine's ranks are. ``local`` is updated in place with
    the lives started again (the launcher stops them at its end, as the first ones)."""
    direct = set(direct)
    on_agents_machine = bool(direct)
    joined = set(local) if getattr(args, "join", None) else set()  # ranks whose life here joined the running job
    reported: set[int] = set()
    fence = {ident: rank_fence_key(ident, p.pid if ident in joined else None) for ident, p in local.items()}
    stacks = StackRequests(local)
    restarts: StuckRestarts | None = None  # (made once training started: a node is the job's --tp ranks)
    # this machine standing still whole (runtime.pause_clock): the agent fences its ranks for their silence meanwhile,
    # though nothing of theirs broke; such a node is started again as a stuck one is (machine 0 stands still with
    # its agent: nothing is fenced meanwhile)
    still = StandStillFences() if args.stuck_restarts and not on_agents_machine else None
    # a joining machine's ranks may find their earlier lives' error records in the store: not theirs to judge
    earlier = record_times(store, joined)
    job = PublishedConfig()  # (training started once it is there)
    if control is not None:  # (cut off from the agent's machine only: the standby's store says when they are fenced)
        control.fences = dict(fence)
        control.ready()

    def say_pids(to: Any) -> None:
        """The pids of the ranks launched with the job, for the agent's asks about them (a joining rank said its pid
        in its join request: its rank's key stays its earlier life's)."""
        for ident, p in local.items():
            if ident not in joined and ident not in direct:
                to.set(RANK_PID_KEY.format(ident), str(p.pid))

    def heartbeat_timeout_s() -> float | None:
        return cfg.heartbeat_timeout_s if (cfg := job.get(store)) is not None else None

    def start_stuck_nodes_again() -> None:
        """(Asks the store nothing until a rank here left with a local error's exit code, which a stuck one uses, or
        was fenced while this machine stood still.)"""
        nonlocal restarts
        paused = still.fenced if still is not None else {}
        if not args.stuck_restarts or (not paused and all(p.exitcode != LOCAL_ERROR_EXIT for p in local.values())):
            return
        if restarts is None:
            if (cfg := job.get(store)) is None:
                return
            restarts = StuckRestarts(cfg.tp, args.stuck_restarts, before=earlier)
        due, said = restarts.due(store, {ident: p.exitcode for ident, p in local.items()}, paused)
        for line in said:
            print(f"[odyssey launch node {args.node_rank}] {line}", file=sys.stderr, flush=True)
        if due and store.check([GIVEUP_KEY]):  # (the agent stopped the job: nothing to join)
            return
        for node in due:
            print(f"[odyssey launch node {args.node_rank}] {node.describe()}", file=sys.stderr, flush=True)
            host, port = control.current if control is not None else (args.master_addr, args.odyssey_port)
            lives = start_ranks(args, joining={"tp": restarts.tp, "address": f"{host}:{port}",
                                               "standby": store.check([STANDBY_KEY])}, only=node.ranks)
            restarts.lives_started(store, node.ranks)
            for ident, p in lives.items():
                local[ident], fence[ident] = p, rank_fence_key(ident, p.pid)
                joined.add(ident)
                direct.discard(ident)
                reported.discard(ident)
                if still is not None:
                    still.life_started(ident)
                if control is not None:
                    control.fences[ident] = fence[ident]

    # a joining rank answers only asks that name its process: the agent's asks about the new life do (its join
    # request gave the pid); one that names none is about the rank's earlier life (a --rejoin replacement starts
    # early), and its answer would give a dead process the grace of a running one
    probes = ProbeRequests(lambda: {ident: p.pid for ident, p in local.items()
                                    if ident not in reported and ident not in direct},
                           named_only=lambda ident: ident in joined)
    say_pids(store)
    waits = False  # said it waits for the job's end (await_the_jobs_end), to the store it reports to
    while len(reported) < len(local):
        try:
            if still is not None:
                still.new_pass()
            if store.check([FINISHED_KEY]) or (stop is not None and stop.is_set()):
                break
            stacks.poll(store, reported | direct)
            probes.poll(store)
            learn_when_lost(control, job.get(store))
            for ident, p in local.items():
                if ident in direct:  # (the agent sees it exit, fences it and says how it ended)
                    if ident not in reported and p.exitcode is not None:
                        reported.add(ident)
                    continue
                if ident not in reported and store.check([fence[ident]]):
                    if still is not None:
                        still.fence_seen(ident, heartbeat_timeout_s)
                    p.kill()
                if ident not in reported and p.exitcode is not None:
                    if p.exitcode != 0 and not waits and not on_agents_machine and job.get(store) is not None:
                        # (training had started) said before the exit is: the agent, which ends the job only once it
                        # knows of this exit, then keeps its store up until this machine has read the end (finish_job)
                        store.append(AWAITING_END_KEY, f"{args.node_rank};")
                        waits = True
                    report_exit(store, ident, p.exitcode)
                    reported.add(ident)
                    fenced = store.check([fence[ident]])
                    chosen = store.check([LEAVING_KEY.format(ident)])  # the script's own exit code: not a failure
                    if p.exitcode not in (0, STOPPED_EXIT) and not fenced and not chosen:  # say how it ended
                        print(f"[odyssey launch node {args.node_rank}] rank {ident} {describe_exit(p.exitcode)}:\n"
                              f"{startup_errors(args.workdir, [ident])}", file=sys.stderr, flush=True)
                    elif fenced and store.check([STACKS_ASKED_KEY.format(ident)]):  # fenced for making no progress
                        stack = rank_log_stack(args.workdir, ident)
                        print(f"[odyssey launch node {args.node_rank}] rank {ident} was fenced; it had stopped here "
                              f"(from the stacks it dumped to its log):\n"
                              + "\n".join("    " + line for line in (stack or "(no stacks in its log)").splitlines()),
                              file=sys.stderr, flush=True)
            start_stuck_nodes_again()
        except Exception:  # noqa: BLE001 - the agent's store is gone: follow the standby, if it took over
            moved = control.follow(store) if control is not None else None
            if moved is None:
                raise
            store = moved.store  # (or the same agent's on a new connection: the last one broke)
            if moved.took_over:  # the new agent has not seen any exit: report them again
                reported, waits = set(), False
                say_pids(store)
            continue
        time.sleep(0.01)
    if still is not None:
        still.stop()
    own = max((p.exitcode or 0 for p in local.values()), key=abs, default=0)
    if not waits:
        return own
    if (stop is not None and stop.is_set()) or (termination is not None and termination.signum):
        try:  # (the job is being stopped: the agent need not keep its store up for this machine)
            store.set(SAW_END_KEY.format(args.node_rank), "1")
        except Exception:  # noqa: BLE001
            pass
        return own
    return await_the_jobs_end(args, local, store, control, own, stop)


def restart_stuck_on_machine_0(args: argparse.Namespace,
                               local: dict[int, LocalRank]) -> tuple[threading.Event, threading.Thread | None]:
    """Machine 0: the agent supervises the ranks launched here itself, so a thread of this launcher only starts
    again a node of them that left stuck (``runtime.stuck_restart``), and supervises the lives started again as a
    joined machine's node agent does (exits reported in the store, fences by their own keys). Set the returned event
    to stop the thread (None with ``--stuck-restarts 0``); it stops by itself when the job ends."""
    from .runtime.control_plane import client

    stop = threading.Event()

    def run() -> None:
        try:
            node_agent(args, local, client((args.master_addr, args.odyssey_port), 60), stop=stop, direct=set(local))
        except Exception as exc:  # noqa: BLE001 - the agent's store went away with the job
            if not stop.is_set():
                print(f"[odyssey launch] the watch for ranks stuck in a collective stopped: {type(exc).__name__}: "
                      f"{exc}", file=sys.stderr, flush=True)

    if not args.stuck_restarts:
        return stop, None
    thread = threading.Thread(target=run, name="odyssey-stuck-restarts", daemon=True)
    thread.start()
    return stop, thread


def await_the_jobs_end(args: argparse.Namespace, local: dict[int, LocalRank], store: Any, control: Any, own: int,
                       stop: Any = None) -> int:
    """Every rank of this machine has ended, one at least with an error or a signal, after training started, and the
    job goes on without them (the agent recovers, or ends the job): wait for the job's end and exit with its code,
    as the other machines' launchers do (this machine said it waits: ``AWAITING_END_KEY``). A launcher that exited
    with its rank's code would fail a job that recovered, for a scheduler that stops a job when one of its tasks
    fails (``srun --kill-on-bad-exit``). Where the job's end cannot be learned (its agent is lost and no standby
    took over), this machine's own code: ``own``."""
    node = args.node_rank
    if own:  # (else its ranks ended well, lives started again after one failed: the job ends now, without them)
        print(f"[odyssey launch node {node}] this machine's ranks have ended (one {describe_exit(own)}); the job goes "
              f"on without them: waiting for its end, to exit with the job's code", file=sys.stderr, flush=True)
    try:
        while stop is None or not stop.is_set():
            try:
                if store.check([FINISHED_KEY]):
                    code = int(store.get(FINISHED_KEY))
                    store.set(SAW_END_KEY.format(node), "1")
                    return code
            except Exception:  # noqa: BLE001 - the agent's store is gone: follow the standby, if it took over
                if control is None:
                    raise  # (no control plane: the end is unknown)
                moved = control.follow(store)  # (raises when the agent stays lost and no standby took over)
                if moved is None:
                    continue  # (a hiccup: the store answers again)
                store = moved.store  # (or the same agent's on a new connection: the last one broke)
                if moved.took_over:  # the new agent has seen none of this machine's exits: said once it knows it waits
                    store.append(AWAITING_END_KEY, f"{node};")
                    for ident, p in local.items():
                        report_exit(store, ident, p.exitcode)
            time.sleep(0.1)
    except Exception as exc:  # noqa: BLE001 - the end is unknown: say why, and leave with this machine's code
        print(f"[odyssey launch node {node}] the job's end cannot be learned ({type(exc).__name__}: {exc}); leaving "
              f"with this machine's ranks' code", file=sys.stderr, flush=True)
    return own


def standbys_witness(args: argparse.Namespace, where: str, holder: str) -> Witness | None:
    """Machine 1's side of the witness: the directory machine 0 made for the job (``where``, "" for none), which
    this machine must see. Machine 0's --witness-dir is the job's; one given here too (or in the environment) must
    name the same directory: a different one would leave the user believing the tie is claimed where it is not.
    WitnessNotShared says which flag or variable is at odds, and machine 0 stops the job with it."""
    mine = args.witness_dir
    if mine is not None and not where:
        raise WitnessNotShared(f"{args.witness_said} {mine} is given on machine 1 but not on machine 0, whose is the "
                               f"job's: give the same directory to every machine")
    if not where:
        return None
    witness = Witness.join(where, holder)
    if mine is not None and os.path.realpath(Path(where).parent) != os.path.realpath(mine):
        raise WitnessNotShared(f"{args.witness_said} {mine} on machine 1 is not machine 0's "
                               f"({Path(where).parent}): give the same directory to every machine")
    return witness


def standby_node(args: argparse.Namespace, local: dict[int, LocalRank], agent_store: Any,
                 termination: Termination | None = None) -> int:
    """Machine 1: this machine's node agent (a thread), and the standby agent, which hosts its own store,
    registers it with the agent, keeps the agent's replicated state, and takes the job over when machine 0
    is lost (the ranks of machine 0 are then seen only by their heartbeats: ``OrphanRank``)."""
    from .runtime.agent import Agent, take_over
    from .runtime.config import TrainConfig
    from .runtime.control_plane import ControlPlane, Dismissed, Standby, every_interface, serve
    from .runtime.generation import wait_key

    from .runtime.sockets import route_address

    host = args.standby_addr or route_address(args.master_addr, args.odyssey_port)
    where = wait_key(agent_store, WITNESS_KEY, "the job's witness directory", 300).decode()
    try:
        witness = standbys_witness(args, where, f"standby on machine 1 ({host})")
        if where:
            agent_store.set(WITNESS_SEEN_KEY, "")
    except WitnessNotShared as why:
        agent_store.set(WITNESS_SEEN_KEY, str(why))
        print(f"[odyssey standby, node 1] {why}", file=sys.stderr, flush=True)
        return 1
    store = serve(every_interface(host), args.standby_port, 300)
    agent_store.set(STANDBY_KEY, f"{host}:{args.standby_port}")
    control = ControlPlane((args.master_addr, args.odyssey_port), (host, args.standby_port), -1, wait_s=120)
    codes: list[int] = []
    stop = threading.Event()

    def run_node_agent() -> None:
        try:
            codes.append(node_agent(args, local, agent_store, control, stop, termination))
        except ConnectionError as lost:  # (neither the agent nor a standby that can take over answers)
            codes.append(_cut_off(args, lost))

    node = threading.Thread(target=run_node_agent, name="odyssey-node-agent", daemon=True)
    node.start()
    watcher = Standby(store, (args.master_addr, args.odyssey_port), args.workdir / "standby.steps.jsonl",
                      log=lambda msg: print(f"[odyssey standby, node 1] {msg}", file=sys.stderr, flush=True),
                      ranks=args.nnodes * args.nproc_per_node)
    cfg_text = None
    while cfg_text is None:  # the job's config, while the agent is there to give it
        try:
            if agent_store.check([CONFIG_KEY]):
                cfg_text = agent_store.get(CONFIG_KEY)
            elif all(p.exitcode is not None for p in local.values()):
                node.join()
                return codes[0] if codes else 1
        except Exception:  # noqa: BLE001 - lost before the job started: nothing to take over
            print("[odyssey standby, node 1] the agent was lost before the job started", file=sys.stderr)
            return 1
        time.sleep(0.05)
    result = watcher.watch()
    if isinstance(result, int):  # the agent ran the job to its end
        node.join()
        return codes[0] if codes else result
    if isinstance(result, Dismissed):  # (said by the watch) a machine of the job's as any other from now on
        node.join()
        return codes[0] if codes else 1
    cfg = TrainConfig(**json.loads(cfg_text))
    store.set(CONFIG_KEY, cfg_text)  # the job trains: what the lost agent's store said to machines (node_agent)
    procs = ranks_taken_over(store, args.nnodes * args.nproc_per_node, args.nproc_per_node, local, result)
    agent = Agent(cfg, None, args.workdir, procs=procs, store=store)
    agent.witness = witness
    code = take_over(agent, result, watcher, f"the agent on {args.master_addr} was lost; the standby on {host} "
                                             f"took over")
    finish_job(store, code)
    if witness is not None:
        witness.remove()
    stop.set()
    node.join(10)
    return code


def ranks_taken_over(store: Any, world: int, nproc_per_node: int, local: dict[int, Any],
                     state: dict[str, Any]) -> dict[int, Any]:
    """Every rank of the job as the standby's agent supervises it after taking over from the lost agent (whose
    replicated ``state`` this is): its own machine's ranks; machine 0's, lost with the agent's machine or orphaned by
    its launcher (``OrphanRank``: seen only by their heartbeats); every other machine's through its node agent, a rank
    that joined the running job as the process that joined."""
    from .runtime.control_plane import OrphanRank

    exits = RemoteExits(store)
    joined = {int(i): int(pid) for i, pid in state.get("joined", {}).items()}
    return {i: local.get(i) or (OrphanRank(store, i, joined_pid=joined.get(i)) if i < nproc_per_node else
                                RemoteRank(store, i, exits, joined_pid=joined.get(i)))
            for i in range(world)}


def join_running_job(args: argparse.Namespace) -> int:
    """``--join``: this machine's ranks join the running job (see the module docstring); this launcher then
    reports their exits and fences them for the agent, like any machine's node agent."""
    from .runtime.control_plane import ControlPlane, client, listening, parse_address

    try:
        address = parse_address(args.join)
        if not listening(address, timeout_s=5):
            raise ConnectionRefusedError("nothing listens there")
        store = client(address, 60)
        if not store.check([CONFIG_KEY]):
            raise RuntimeError("that job has not started training (or is not an --odyssey job)")
        cfg = read_job_config(store)
    except Exception as exc:  # noqa: BLE001 - the reason on the terminal, not a traceback
        print(f"odyssey-launch --join {args.join}: cannot reach the job: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    first, count = args.node_rank * args.nproc_per_node, args.nproc_per_node
    if first % cfg.tp or count % cfg.tp:
        print(f"odyssey-launch --join: a node (its {cfg.tp} tensor-parallel ranks) joins whole, but this machine's "
              f"ranks {first}..{first + count - 1} split one; use the job's --nproc-per-node", file=sys.stderr)
        return 2
    if first + count > cfg.nproc:
        print(f"odyssey-launch --join: ranks {first}..{first + count - 1} are not ranks of the job (0..{cfg.nproc - 1}); "
              f"number this machine as at launch (--nnodes, --node-rank, --nproc-per-node)", file=sys.stderr)
        return 2
    standby = parse_address(store.get(STANDBY_KEY).decode()) if store.check([STANDBY_KEY]) else None
    local = start_ranks(args, joining={"tp": cfg.tp, "address": f"{address[0]}:{address[1]}",
                                       "standby": standby is not None})
    termination = Termination(local, args.termination_grace)
    termination.install()  # a joined machine is stopped like any other
    control = ControlPlane(address, standby, -1, wait_s=120, lost_after_s=judged_lost_after(cfg.heartbeat_timeout_s))
    try:
        return node_agent(args, local, store, control, termination=termination)
    finally:  # (ranks held as standbys to the end of the job leave with it)
        for p in local.values():
            p.kill()


def _cut_off(args: argparse.Namespace, lost: ConnectionError) -> int:
    """Neither the job's agent nor its standby answers this machine (it is cut off, or both are lost): it says so
    and leaves, its ranks stopped (a traceback would hide the reason among the store's retries)."""
    print(f"[odyssey launch node {args.node_rank}] {lost}: this machine leaves the job and stops its ranks",
          file=sys.stderr, flush=True)
    return 1


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ[SILENCE_ENV] = f"{args.silence_timeout:g}"  # (this launcher's store clients and its ranks')
    # this launcher's own store errors (a machine gone silent) on its terminal without C++ frames, as its ranks'
    os.environ.setdefault("TORCH_SHOW_CPP_STACKTRACES", "0")
    if args.join:
        try:
            code = join_running_job(args)
        except KeyboardInterrupt:
            code = 130
        except ConnectionError as lost:  # (ControlPlane.follow: neither the agent nor a standby answers)
            code = _cut_off(args, lost)
        sys.exit(code)
    if args.node_rank == 0 and args.witness_dir is not None:  # (before any rank starts)
        import socket

        try:
            args.witness = Witness.create(args.witness_dir, f"agent on machine 0 ({socket.gethostname()})")
        except OSError as exc:
            print(f"[odyssey launch] {args.witness_said} {args.witness_dir}: cannot make the job's directory there "
                  f"({exc})", file=sys.stderr)
            sys.exit(1)
    if args.node_rank == 0 or (args.standby and args.node_rank == 1):  # (this machine serves a control store)
        from .runtime.control_plane import TooFewFiles, check_open_files

        try:
            check_open_files(args.nnodes * args.nproc_per_node, args.nnodes, args.nproc_per_node,
                             "the agent's" if args.node_rank == 0 else "the standby agent's")
        except TooFewFiles as exc:
            print(f"[odyssey launch node {args.node_rank}] {exc}", file=sys.stderr)
            sys.exit(1)
    local = start_ranks(args)
    termination = Termination(local, args.termination_grace)
    termination.install()
    try:
        code = coordinate(args, local, termination) if args.node_rank == 0 else serve_node(args, local, termination)
    except KeyboardInterrupt:
        code = 130
    except ConnectionError as lost:
        code = _cut_off(args, lost)
    finally:
        for p in local.values():
            p.kill()
        if args.witness is not None:  # (machine 0's: an empty one goes, a claim stays)
            args.witness.remove()
    sys.exit(code)


if __name__ == "__main__":
    main()
