"""The control plane is not a single point of failure (issue 12, item 5): a standby agent takes over
when the agent's process is killed, alone or with ranks of its machine, at any moment of a step or of
a recovery, and training ends with exactly the parameters of a fault-free run. Real processes, real
SIGKILLs, real stores."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_odyssey.runtime.agent import DEPOSED_EXIT, free_port
from megatron_odyssey.runtime.control_plane import (FINISHED_KEY, STATE_KEY, TAKEOVER_KEY, Deposed, Replica,
                                                    Standby)
from megatron_odyssey.runtime.step_log import StepLog
from megatron_odyssey.standalone.launcher import TrainingFailed, job_exit_code
from megatron_odyssey.testing.processes import refusing_address

from recovery_job import assert_exact, failure_story, reference_run, run

STANDBY = {"control": {}}


@pytest.fixture
def reference(fault_free_reference):
    return reference_run(fault_free_reference)


def _only_takeover(report: dict) -> dict:
    assert report["ok"] and not report["running"]
    (takeover,) = report["takeovers"]
    return takeover


@pytest.mark.parametrize("phase", ["backward", "optimizer", "between"])
def test_the_agent_killed_alone_the_standby_resumes_the_same_layout(reference, tmp_path, phase):
    """``optimizer``: the agent dies after committing step 1 (the killer saw the commit): the standby knew of
    it before any rank did (write-ahead), so nobody trains step 1 twice or skips it."""
    params, report = run(tmp_path, [f"step=1,rank=2,phase={phase},kind=kill-agent"], extra=STANDBY)
    assert_exact(reference, params, report)  # every step's loss too: the standby copied the agent's records
    takeover = _only_takeover(report)
    assert takeover["ranks_lost"] == [] and takeover["policy"] == "resume"
    assert takeover["step"] == (2 if phase in ("optimizer", "between") else 1)
    assert report["failures"] == []
    assert takeover["recovery_s"] < 30, takeover  # nobody waited out a timeout
    assert report["steps"][-1]["alive"] == 6


def test_the_agents_machine_is_lost_with_a_rank(reference, tmp_path):
    """The agent and global rank 0 die together (one machine held both): the standby takes over, finds rank 0
    dead, and the planner recovers without it."""
    params, report = run(tmp_path, ["step=2,rank=0,phase=forward,kind=kill-with-agent"], extra=STANDBY)
    assert_exact(reference, params, report)
    takeover = _only_takeover(report)
    assert takeover["ranks_lost"] == [0] and takeover["policy"] in ("reroute", "reconfigure")
    (failure,) = report["failures"]
    assert failure["ranks"] == [0] and failure["step"] == 2
    assert report["steps"][-1]["alive"] == 5


def _taking(monkeypatch, taken: int, calls: set[int]) -> None:
    """``free_port`` hands out ``taken`` (bound here, never listening: as another job's connection holds a port) at
    the given calls, and free ports otherwise (a standby job's launcher asks for two per try: agent, standby)."""
    from megatron_odyssey.runtime import control_plane

    count, real = [0], control_plane.free_port

    def free_port() -> int:
        count[0] += 1
        return taken if count[0] in calls else real()

    monkeypatch.setattr(control_plane, "free_port", free_port)


def test_a_standby_port_taken_before_it_could_listen_is_chosen_again(tmp_path, monkeypatch):
    """The standby's port is taken between the launcher choosing it and the standby binding it: the standby exits on
    EADDRINUSE, the launcher says so and starts it on another port, and the job runs to its end backed by it. Before,
    the agent gave the standby's store 60 s and failed."""
    import socket

    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.standalone.launcher import launch

    from recovery_job import MODEL

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        _taking(monkeypatch, held.getsockname()[1], {2})
        cfg = TrainConfig(nproc=2, tp=1, pp=2, fail=[], report=str(tmp_path / "report.json"),
                          extra={"control": {}}, **{**MODEL, "steps": 2})
        said = launch(cfg, tmp_path / "run", quiet=True)
    assert said.count("was taken before it could listen: trying another") == 1 and "EADDRINUSE" in said
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] and [s["step"] for s in report["steps"]] == [0, 1] and report["takeovers"] == []
    copied = (tmp_path / "report.standby.steps.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in copied]
    assert steps == [0, 1]  # the second standby backed the job: it holds every committed step


def test_a_standby_that_cannot_listen_stops_the_job_at_once_with_its_reason(tmp_path, monkeypatch):
    """Every try's port is taken: the job stops when the last standby exits, with its own error, instead of the agent
    waiting 60 s for a store that will never listen."""
    import socket

    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.standalone import launcher

    from recovery_job import MODEL

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        monkeypatch.setattr(launcher, "STANDBY_TRIES", 2)
        _taking(monkeypatch, port, {2, 4})
        cfg = TrainConfig(nproc=2, tp=1, pp=2, fail=[], report=str(tmp_path / "report.json"),
                          extra={"control": {}}, **MODEL)
        with pytest.raises(TrainingFailed) as failed:
            launcher.launch(cfg, tmp_path / "run", quiet=True)
    message = str(failed.value)
    assert f"the standby agent exited 1 before its store listened on 127.0.0.1:{port}" in message
    assert "EADDRINUSE" in message and failed.value.code == 1
    assert failed.value.stderr.count("was taken before it could listen: trying another") == 1
    assert not (tmp_path / "report.json").exists()  # no agent was started (it is what waited 60 s before)


def test_the_agent_killed_during_a_recovery(reference, tmp_path):
    """Rank 4 dies; while the agent recovers from it, the agent dies too: the standby finishes the recovery."""
    params, report = run(tmp_path, ["step=1,rank=4,phase=backward,kind=kill",
                                    "step=1,rank=1,phase=recovery,kind=kill-agent"], extra=STANDBY)
    assert_exact(reference, params, report)
    assert [f["ranks"] for f in report["failures"]] == [[4]]
    assert len(report["takeovers"]) == 1
    assert report["steps"][-1]["alive"] == 5


def test_the_agent_killed_while_a_drop_waits_the_standby_carries_it_out(fault_free_reference, tmp_path):
    """Forced drop of rank 3, slow from the start, named at step 3 or a little later. Rank 0 lags 2 s between steps
    (as Megatron-LM's logging rank does), so the drop waits for it inside the next step (``drop_gate``). Meanwhile
    the agent is killed: by rank 1, the moment it has said it is inside that step (``phase=inside``: it fires only
    while a drop waits, so only one of these specs does). The standby knew of the drop before any rank did (the
    commit's write-ahead): its generation tells the ranks the step again, and it fences rank 3 once every other rank
    is inside it. Before, the takeover forgot the drop, and the slow rank stayed until it was judged again. Training
    stays exact, and the drop's report entry is the one the lost agent made, saying when it was carried out."""
    steps = 8
    params, report = run(tmp_path, ["step=0,rank=3,kind=slow,factor=4",
                                    *(f"step={s},rank=0,phase=between,kind=slow" for s in (3, 4, 5, 6)),
                                    *(f"step={s},rank=1,phase=inside,kind=kill-agent" for s in (4, 5, 6, 7))],
                         steps=steps, slow_action="drop", extra=STANDBY)
    assert_exact(reference_run(fault_free_reference, steps=steps), params, report)
    (drop,) = [d for d in report["diagnoses"] if d["action"] == "drop"]
    assert drop["ranks"] == [3] and drop["step"] in (3, 4, 5, 6), failure_story(report)
    takeover = _only_takeover(report)
    assert takeover["ranks_lost"] == [] and takeover["step"] == drop["step"] + 1, takeover
    # the drop's recovery began before the takeover's generation committed a step: the takeover's record ends there
    assert takeover["superseded_by"] == takeover["generation"] + 1 and takeover["recovery_s"] > 0, takeover
    assert drop["fenced"].endswith(f"every other rank is inside step {drop['step'] + 1}"), drop["fenced"]
    (failure,) = report["failures"]
    assert failure["ranks"] == [3] and failure["step"] == drop["step"] + 1 and failure["dropped"], failure_story(report)
    assert report["steps"][-1]["alive"] == 5


def test_without_a_standby_losing_the_agent_ends_the_job_and_its_ranks(tmp_path):
    """No standby: the job fails at once with the reason, and no rank is left waiting on a dead store. Timed from
    the last record in the agent's step log, not from the start (a loaded host's start-up took 91 s once). The
    agent dies in step 2: it writes step 0's record before it commits step 1, but a step's record comes after its
    commit, so step 1's may be missing (a loaded host's ranks reached the kill first once; killed in step 1 then,
    the log was empty)."""
    config = tmp_path / "run" / "config.json"
    with pytest.raises(TrainingFailed):
        run(tmp_path, ["step=2,rank=2,phase=backward,kind=kill-agent"])
    deadline = time.monotonic() + 30
    while _processes_with(str(config)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _processes_with(str(config)), "ranks outlived their agent"
    steps = tmp_path / "report.steps.jsonl"  # the agent's step log, written as steps commit
    assert [r["step"] for r in StepLog.read(steps)] in ([0], [0, 1])
    last_commit = steps.stat().st_mtime  # (step 1's commit, or before it)
    store_timeout = json.loads(config.read_text())["timeout_s"]  # what a rank waiting on the dead store would wait
    assert time.time() - last_commit < store_timeout / 2
    logs = " ".join(p.read_text() for p in (tmp_path / "run").glob("rank*.log"))
    assert "the agent's store is gone and this job has no standby agent" in logs


def _processes_with(text: str) -> list[int]:
    """Live processes whose command line contains ``text`` (forked ranks keep their agent's command line)."""
    found = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
                state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
            except OSError:
                continue
            if text in cmdline and state != "Z":
                found.append(int(pid))
    return found


# -- the pieces, over real stores ---------------------------------------------------------------------

def _store_server(port: int) -> subprocess.Popen:
    code = (f"import time, torch.distributed as d; s = d.TCPStore('127.0.0.1', {port}, is_master=True, "
            f"wait_for_workers=False); print('up', flush=True); time.sleep(600)")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "up"
    return proc


@pytest.fixture
def nobody():
    """The address of an agent whose store is gone: it refuses at once (a port let go could be taken by another
    test's store meanwhile; one held by a stopped process kept a probe waiting 9 s)."""
    with refusing_address() as address:
        yield address


def _sockets(state: str) -> Iterator[tuple[str, int, int]]:
    """(table, local port, remote port) of this machine's TCP sockets in ``state`` ("0A": LISTEN, "01":
    ESTABLISHED), from /proc/net/tcp (IPv4) and tcp6 (IPv6)."""
    for table in ("tcp", "tcp6"):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == state:
                yield table, int(fields[1].rsplit(":", 1)[1], 16), int(fields[2].rsplit(":", 1)[1], 16)


def _listening_families(port: int) -> set[str]:
    """The socket tables (tcp for IPv4, tcp6 for IPv6) holding a listener on ``port``."""
    return {table for table, local, _ in _sockets("0A") if local == port}


def test_a_control_store_listens_on_ipv4_so_its_server_names_peers_without_dns():
    """c10d's own listener is a dual-stack IPv6 socket: each peer arrives as ::ffff:a.b.c.d, which /etc/hosts never
    names, so the store's one server thread asked DNS for every new connection and froze every client for the
    resolver's 5 s when a packet was dropped (the takeover flake). ``serve`` listens on IPv4: a peer on this machine
    is 127.0.0.1, which /etc/hosts names. The c10d default is checked too, so the test says if a torch release
    changes it."""
    from megatron_odyssey.runtime.control_plane import client, serve

    port = free_port()
    store = serve("127.0.0.1", port, 10)
    assert _listening_families(port) == {"tcp"}
    peer = client(("127.0.0.1", port), 5)
    peer.set("k", "v")
    assert store.get("k") == b"v"
    default_port = free_port()
    default = _master(default_port)
    assert _listening_families(default_port) == {"tcp6"}, "c10d's own listener changed: see control_plane.serve"
    del default


def test_a_control_store_whose_port_is_taken_says_which_and_why():
    import socket

    from megatron_odyssey.runtime.control_plane import serve

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        port = held.getsockname()[1]
        with pytest.raises(OSError, match=f"the store cannot listen on 127.0.0.1:{port}: EADDRINUSE"):
            serve("127.0.0.1", port, 10)


def test_slow_name_times_the_reverse_lookup_c10d_makes():
    """The real lookup of the loopback is quick (/etc/hosts names it); every lookup is slower than no time at all; a
    lookup that fails is timed as well (it took as long to find out)."""
    from megatron_odyssey.runtime.control_plane import slow_name

    assert slow_name(["127.0.0.1"]) is None
    host, took = slow_name(["127.0.0.1"], limit_s=0.0)
    assert host == "127.0.0.1" and 0.0 < took < 1.0

    def failing(host: str) -> None:
        time.sleep(0.2)
        raise OSError("no name")

    assert slow_name(["10.0.0.1", "10.0.0.2"], limit_s=0.1, lookup=failing)[0] == "10.0.0.1"


@pytest.mark.parametrize("said", ["every rank", "one rank never"])
def test_a_standby_on_another_machine_times_naming_the_ranks_machines_there(tmp_path, monkeypatch, said):
    """The standby's store names the ranks' machines on its own machine (its resolver is not the agent's): once the
    ranks said in the agent's store where they listen, the standby times one reverse lookup per machine and says the
    first slow one, once, with the remedy (here: a lookup that takes 1.2 s for 10.0.0.8; the loopback is not looked
    up). Where a rank never says, it names the machines of those that did once ``NAMES_WAIT_S`` passed."""
    from megatron_odyssey.runtime import control_plane
    from megatron_odyssey.runtime.reachability import ADDRESS_KEY

    monkeypatch.setattr(control_plane, "NAMES_WAIT_S", 1.0)
    agent_port = free_port()
    agent_store = _master(agent_port)
    looked_up: list[str] = []
    said_lines: list[str] = []

    def lookup(host: str) -> None:
        looked_up.append(host)
        time.sleep(1.2 if host == "10.0.0.8" else 0.0)

    standby = Standby(_master(free_port()), ("127.0.0.1", agent_port), tmp_path / "steps.jsonl", poll_s=0.01,
                      log=said_lines.append, ranks=4, name_lookup=lookup)
    addresses = ["10.0.0.7:4100", "127.0.0.1:4101", "10.0.0.8:4102", "10.0.0.8:4103"]
    for ident, address in enumerate(addresses if said == "every rank" else addresses[:3]):
        agent_store.set(ADDRESS_KEY.format(ident), address)
    watching = threading.Thread(target=standby.watch, daemon=True)
    watching.start()
    deadline = time.time() + 30
    while not any("naming machine" in line for line in said_lines) and time.time() < deadline:
        time.sleep(0.05)
    time.sleep(1.5)  # (time to look up again, were it to)
    standby.store.set(FINISHED_KEY, "0")
    watching.join(10)
    assert not watching.is_alive()
    assert looked_up == ["10.0.0.7", "10.0.0.8"]
    (line,) = [line for line in said_lines if "naming machine" in line]
    assert line.startswith("naming machine 10.0.0.8 by its address (a reverse DNS lookup) took 1.") and \
        re.search(r"the 12 connections of the job's 4 ranks take about \d+ s to be served", line) and \
        "List the job's machines in /etc/hosts on the agent's and the standby's machines" in line, line


def _master(port: int):
    return dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))


def test_standby_copies_every_committed_step_and_takes_over_with_the_newest_state(tmp_path):
    agent_port, standby_port = free_port(), free_port()
    agent_store = _store_server(agent_port)  # the agent's store, in a process we can kill
    standby_store = _master(standby_port)
    try:
        replica = Replica(("127.0.0.1", standby_port))
        replica.state({"gen": 1, "plan": {}, "next_step": 3})
        for t in range(3, 300):  # more steps than the ring holds: the standby copies as they come
            replica.step({"generation": 1, "committed": t, "loss": float(t), "next_step": t + 1}, {"step": t})
            if t == 200:  # a drop decided at step 200's commit, newer than the generation's state
                replica.drop({"gen": 1, "step": 201, "ranks": [3]})
            if t == 150:
                standby = Standby(standby_store, ("127.0.0.1", agent_port), tmp_path / "steps.jsonl",
                                  takeover_after_s=0.5, poll_s=0.01)
                standby.copy_steps()
        standby.copy_steps()
        agent_store.kill()
        agent_store.wait()
        state = standby.watch()
    finally:
        agent_store.kill()
    assert isinstance(state, dict)
    assert state["gen"] == 1 and state["committed"] == 299 and state["next_step"] == 300 and state["loss"] == 299.0
    steps = [json.loads(line)["step"] for line in (tmp_path / "steps.jsonl").read_text().splitlines()]
    assert steps == list(range(3, 300))  # each once, in order, though the ring holds 256
    assert state["lost_agent_s"] >= 0.5  # it waited the grace before taking over
    assert state["pending_drop"] == {"gen": 1, "step": 201, "ranks": [3]}  # (control_plane.DROP_KEY)


def test_a_standby_the_agent_went_on_without_never_takes_the_job_over(tmp_path):
    """The agent dropped its standby (its machine stood still, or a blip outlasted the write-ahead): the standby's copy
    of the job's state ends there. Back, it reads in the agent's store that it was dismissed (``DISMISSED_KEY``),
    says so, says it in its own store, and watches no more; when the agent is lost later, a rank that asks the
    standby learns at once that nobody takes over (before, the standby took the job over from its old copy, at the
    agent's loss or at the job's end: steps the ranks had applied would be trained again). A standby that took over
    before it could read that is found out by the first rank that follows it (``stale_takeover``)."""
    from megatron_odyssey.runtime.control_plane import (DISMISSED_KEY, ControlPlane, Dismissed, client,
                                                        stale_takeover)

    agent_port, standby_port = free_port(), free_port()
    agent_store = _store_server(agent_port)
    standby_store = _master(standby_port)
    said: list[str] = []
    try:
        Replica(("127.0.0.1", standby_port)).state({"gen": 1, "plan": {}, "next_step": 3})  # its copy: step 2
        lost = client(("127.0.0.1", agent_port), 5)
        lost.set(DISMISSED_KEY, "its store stopped answering at generation 1, step 2 committed: a test's")
        standby = Standby(standby_store, ("127.0.0.1", agent_port), tmp_path / "steps.jsonl", takeover_after_s=0.2,
                          poll_s=0.01, log=said.append)
        results: list = []  # (in a thread: a standby that missed the dismissal would watch for ever)
        watch = threading.Thread(target=lambda: results.append(standby.watch()), daemon=True)
        watch.start()
        watch.join(30)
        (result,) = results
        assert result == Dismissed("its store stopped answering at generation 1, step 2 committed: a test's")
        assert said[-1].startswith("the agent went on without this standby (its store stopped answering at "
                                   "generation 1, step 2 committed: a test's); its copy of the job's state ends "
                                   "there, so it will not take the job over"), said
        assert standby_store.get(DISMISSED_KEY) == lost.get(DISMISSED_KEY)
        agent_store.kill()
        agent_store.wait()
        control = ControlPlane(("127.0.0.1", agent_port), ("127.0.0.1", standby_port), 5, wait_s=60)
        t0 = time.monotonic()
        with pytest.raises(ConnectionError, match=r"the standby at 127\.0\.0\.1:\d+ will not take over: the agent "
                                                  r"had gone on without it \(its store stopped answering"):
            control.follow(lost)
        assert time.monotonic() - t0 < 10  # (not the 60 s a rank waits for a standby that may yet take over)
        assert not standby_store.check([TAKEOVER_KEY])
    finally:
        agent_store.kill()
    # a standby that took over from an older copy than a rank saw
    standby_store.set(TAKEOVER_KEY, json.dumps({"generation": 1, "committed": 2, "reason": "test"}))
    assert stale_takeover(standby_store, 1, 2) is None and stale_takeover(standby_store, 0, 40) is None
    assert stale_takeover(standby_store, 1, 1) is None  # (it knows of commits no rank saw: the ranks apply them)
    assert stale_takeover(standby_store, 1, 5) == (
        "the standby agent took over from a copy of the job's state older than this rank's (generation 1, step 2 "
        "committed, against generation 1, step 5): the agent had gone on without it, so the job cannot go on from it; "
        "the job stops (relaunch it from its last checkpoint)")
    assert stale_takeover(standby_store, 2, 2) is not None


def test_a_standby_whose_process_stands_still_is_dropped_within_the_silence_bound(tmp_path, monkeypatch):
    """The standby's process stops whole (SIGSTOP, as its machine paused by its host): its kernel still accepts and
    acknowledges the agent's write-ahead, so only its answer can tell. Within the silence bound (3 s here) the write
    fails as from a silent machine, and the agent goes on without the standby, a majority needed from then on, and
    says so in its store. Before, the agent waited for the answer for ever (over 400 s measured), and the job with it."""
    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import DISMISSED_KEY, ReplicaLost, serve

    monkeypatch.setenv("ODYSSEY_SILENCE_TIMEOUT_S", "3")
    standby_port = free_port()
    standby_store = _store_server(standby_port)
    try:
        cfg = TrainConfig(nproc=4, tp=1, pp=1, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                          steps=4)
        agent = Agent(cfg, None, tmp_path, procs={}, store=serve("127.0.0.1", free_port(), 10))
        agent.replica = Replica(("127.0.0.1", standby_port), connect_timeout_s=30)
        agent._replicate_state()
        assert agent.replicated == frozenset(range(4)) and agent.quorum is None
        os.kill(standby_store.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        with pytest.raises(ReplicaLost) as lost:
            Replica.write_ahead(agent.replica, lambda r: r.step({"committed": 0}, {"step": 0}))
        assert lost.value.answer == "silent" and "Socket Timeout" in str(lost.value)
        assert 2.5 < time.monotonic() - t0 < 10
        assert not agent._to_standby(lambda r: r.step({"committed": 0}, {"step": 0}))
        assert agent.replica is None and agent.quorum is not None
        assert agent.store.get(DISMISSED_KEY).decode().startswith("its store stopped answering at generation 0")
    finally:
        os.kill(standby_store.pid, signal.SIGCONT)
        standby_store.kill()
        standby_store.wait()


def test_a_control_store_serves_more_clients_than_its_process_could_open_files_at_start():
    """A store served from a process whose soft limit of open files is 64 (its hard limit higher) serves 100 clients:
    ``serve`` raises the soft limit to the hard one (``sockets.open_files_allowed``). Without, the 51st client was
    reset ("Connection reset by peer"), as a rank past the usual 1024 would be at start-up."""
    from megatron_odyssey.runtime.control_plane import client

    port = free_port()
    code = ("import resource, time\n"
            "soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))\n"
            "from megatron_odyssey.runtime.control_plane import serve\n"
            f"store = serve('127.0.0.1', {port}, 30)\n"
            "print('up', resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard, flush=True)\n"
            "time.sleep(120)\n")
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert server.stdout.readline().split() == ["up", "True"]
        clients = [client(("127.0.0.1", port), 10) for _ in range(100)]
        for i, c in enumerate(clients):
            c.set(f"k{i}", str(i))
        assert clients[0].get("k99") == b"99"
    finally:
        server.kill()


def _connections_to(port: int) -> int:
    """Connections this machine holds established to ``port`` (their clients' ends; a store client's socket is an
    IPv6 one)."""
    return sum(remote == port for _, _, remote in _sockets("01"))


def test_a_rank_that_joined_obeys_its_own_fence_not_its_earlier_lifes():
    """After a takeover a rank leaves when its fence key is set in the standby's store (``ControlPlane.fenced``).
    The agent writes every fence there, the one of a rank's earlier life too (its machine was lost, and came back:
    ``odyssey-launch --join``); the process that joined obeys only its own (``rank_fence_key``), as its node
    agent does. Before, it read its rank's key, and left at the takeover (found by
    ``test_a_rank_that_joined_is_still_judged_by_its_process_after_the_standby_takes_over`` on Megatron-LM main)."""
    from megatron_odyssey.runtime.control_plane import FENCE_KEY, ControlPlane, rank_fence_key

    store = _master(free_port())
    joined = ControlPlane(("127.0.0.1", 1), ("127.0.0.1", 2), 3, joined_pid=4242)
    launched = ControlPlane(("127.0.0.1", 1), ("127.0.0.1", 2), 3)
    store.set(FENCE_KEY.format(3), "1")  # the rank's earlier life was fenced
    assert not joined.fenced(store) and not launched.fenced(store)  # (not before a takeover)
    joined.moved = launched.moved = True
    assert launched.fenced(store) and not joined.fenced(store)
    store.set(rank_fence_key(3, 4242), "1")
    assert joined.fenced(store)


def _held_once_arrived(control, within_s: float = 30.0):
    """The calling thread's client of the standby's store, once ``ControlPlane.ready``'s thread made it (or None)."""
    deadline = time.monotonic() + within_s
    while (held := control._held()) is None and time.monotonic() < deadline:
        time.sleep(0.02)
    return held


def test_a_thread_ready_for_a_takeover_follows_it_without_a_new_connection():
    """``ControlPlane.ready``: a thread's client of the standby's store, made at its start, is the store it goes on
    with after the takeover (no connection is opened then: each costs the standby's one store thread a reverse
    lookup, for every thread of every rank at once). One that broke meanwhile is replaced by a new one."""
    import socket

    from megatron_odyssey.runtime.control_plane import ControlPlane, client, serve
    from megatron_odyssey.runtime.sockets import tcp_connections

    agent_port, standby_port = free_port(), free_port()
    agent_store = _store_server(agent_port)
    standby_store = serve("127.0.0.1", standby_port, 10)
    try:
        lost = client(("127.0.0.1", agent_port), 5)
        control = ControlPlane(("127.0.0.1", agent_port), ("127.0.0.1", standby_port), 7, wait_s=10)
        before = _connections_to(standby_port)  # (the server's own client of itself)
        control.ready()
        held = _held_once_arrived(control)
        assert held is not None and _connections_to(standby_port) == before + 1
        agent_store.kill()
        agent_store.wait()
        standby_store.set(TAKEOVER_KEY, json.dumps({"generation": 1, "reason": "test"}))
        moved = control.follow(lost)
        assert moved.took_over and moved.store is held and control.current == ("127.0.0.1", standby_port)
        assert _connections_to(standby_port) == before + 1  # (none opened by the takeover)

        again = ControlPlane(("127.0.0.1", agent_port), ("127.0.0.1", standby_port), 8, wait_s=10)
        again.ready()
        broken = _held_once_arrived(again)
        for sock in tcp_connections():  # every client's connection to the standby's store breaks, as in a blip
            if sock.getpeername()[1] == standby_port:
                sock.shutdown(socket.SHUT_RDWR)
        followed = again.follow(lost)
        assert followed.took_over and followed.store is not broken
        assert followed.store.check([TAKEOVER_KEY])
    finally:
        agent_store.kill()


def test_a_finished_job_is_not_taken_over_and_a_deposed_agent_learns_it(tmp_path, nobody):
    port = free_port()
    store = _master(port)
    replica = Replica(("127.0.0.1", port))
    replica.state({"gen": 0})
    replica.finish(0)
    standby = Standby(store, nobody, tmp_path / "steps.jsonl", takeover_after_s=0.1)
    assert standby.watch() == 0  # the agent ended the job: exit with it, even though its store is gone now
    store.delete_key(FINISHED_KEY)
    store.set(TAKEOVER_KEY, json.dumps({"generation": 0, "reason": "test"}))
    with pytest.raises(Deposed):
        replica.step({"generation": 0, "committed": 0, "loss": 1.0, "next_step": 1}, {"step": 0})
    assert store.check([STATE_KEY])


def test_a_standby_on_the_agents_machine_waits_for_its_agent_to_be_started(tmp_path, nobody):
    """The agent starts once the standby's store listens, and may take seconds to import on a loaded machine: until
    its pid is said there is nothing to lose, so the standby waits (before, it gave up after 2 s, and its job then
    waited 60 s for this store and failed). Once said, a process that is gone is found at once; with nothing said
    for ``announce_s`` the standby leaves, saying why."""
    from megatron_odyssey.runtime.control_plane import AGENT_PID_KEY

    said: list[str] = []
    port = free_port()
    store = _master(port)
    agent = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        standby = Standby(store, nobody, tmp_path / "steps.jsonl", takeover_after_s=0.1,
                          same_machine=True, announce_s=30.0, log=said.append)
        threading.Timer(1.0, lambda: store.set(AGENT_PID_KEY, str(agent.pid))).start()
        threading.Timer(2.0, agent.kill).start()
        t0 = time.monotonic()
        assert standby.watch() == 1
        assert 2.0 <= time.monotonic() - t0 < 10
        assert said[-1] == "the agent was lost before it started the job: nothing to take over"
    finally:
        agent.kill()
        agent.wait()
    store.delete_key(AGENT_PID_KEY)
    standby = Standby(store, nobody, tmp_path / "steps.jsonl", takeover_after_s=0.1,
                      same_machine=True, announce_s=1.0, log=said.append)
    t0 = time.monotonic()
    assert standby.watch() == 1 and time.monotonic() - t0 >= 1.0
    assert said[-1] == "no agent was started within 1 s: nothing to back up"


def test_the_job_exit_code_follows_whoever_ran_the_job_to_its_end():
    assert job_exit_code(0, 0) == 0  # the agent finished; the standby ended with it
    assert job_exit_code(1, 1) == 1  # the agent gave up (the standby ends with its code)
    assert job_exit_code(-9, 0) == 0  # the agent was killed; the standby finished the job
    assert job_exit_code(-9, 1) == 1
    assert job_exit_code(DEPOSED_EXIT, 0) == 0
