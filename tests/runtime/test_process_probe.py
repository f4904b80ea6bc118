"""A silent heartbeat: a stopped process, or one whose heartbeat thread got no time? What /proc says decides."""
from __future__ import annotations

import contextlib
import gc
import os
import signal
import subprocess
import sys
import time
from typing import Iterator

from megatron_odyssey.runtime.process_probe import (PROBE_ASK_KEY, PROBE_KEY, RANK_PID_KEY, ProcessSample,
                                                    RemoteProcess, SilenceJudge, children_of, dead_children, is_zombie,
                                                    sample)


def _python(code: str) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", f"print('up', flush=True)\n{code}"], stdout=subprocess.PIPE,
                            start_new_session=True)
    assert proc.stdout.readline() == b"up\n"
    return proc


def _four_ranks() -> dict:
    """Rank 0 spins (its heartbeat thread would be starved), 1 sleeps without CPU, 2 is stopped (SIGSTOP), 3 sleeps
    (it beats)."""
    from megatron_odyssey.launch import LocalRank

    ranks = {0: LocalRank(_python("while True: pass")),
             **{i: LocalRank(_python("import time; time.sleep(120)")) for i in (1, 2, 3)}}
    os.kill(ranks[2].pid, signal.SIGSTOP)
    return ranks


def _silent_for(agent, seconds: dict[int, float]) -> set[int]:
    """The agent's look (``detect``) with each live rank's last beat ``seconds[rank]`` (default 0) ago; the ranks it
    failed count as dead from then on."""
    from megatron_odyssey.runtime.liveness import Beat

    now = time.time()
    agent.beats = {i: Beat(now - seconds.get(i, 0.0)) for i in agent.procs if i not in agent.dead}
    agent.beats_read = now + 600  # (the beats above stand: no store round trip replaces them)
    failed = agent.detect()
    agent.dead |= failed
    return failed


def test_a_sample_tells_running_sleeping_stopped_and_gone_processes_apart() -> None:
    spinning, sleeping = _python("while True: pass"), _python("import time; time.sleep(120)")
    try:
        first = later = sample(spinning.pid)
        deadline = time.monotonic() + 30
        while later.cpu_s == first.cpu_s and time.monotonic() < deadline:  # (a loaded machine gives it no tick at once)
            time.sleep(0.1)
            later = sample(spinning.pid)
        assert later.state == "R" and later.cpu_s > first.cpu_s
        assert "s of CPU in the last" in later.describe(first)
        assert sample(sleeping.pid).state == "S"
        # the main thread asleep, another one running (as when it holds the GIL): the process runs
        side = _python("import threading, time\nthreading.Thread(target=lambda: [0 for _ in iter(int, 1)], daemon=True)"
                       ".start()\nprint('started', flush=True)\ntime.sleep(120)")
        try:
            # (only once the thread runs: before, the main thread may still be reading modules from disk, state D)
            assert side.stdout.readline() == b"started\n"
            with open(f"/proc/{side.pid}/stat") as f:
                assert f.read().rsplit(")", 1)[1].split()[0] in "SR"  # (its own field: the main thread's)
            assert sample(side.pid).state == "R"
        finally:
            side.kill()
            side.wait()
        os.kill(sleeping.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while sample(sleeping.pid).state != "T" and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sample(sleeping.pid).describe() == "state T, stopped"
        sleeping.kill()
        deadline = time.monotonic() + 10
        while not is_zombie(sleeping.pid) and time.monotonic() < deadline:  # (dead, not yet reaped)
            time.sleep(0.01)
        assert is_zombie(sleeping.pid)
        sleeping.wait()
        assert sample(sleeping.pid) is None and sample(None) is None
    finally:
        for proc in (spinning, sleeping):
            proc.kill()
            proc.wait()


def test_the_agent_gives_a_running_silent_rank_a_grace_and_fences_stopped_ones(tmp_path, capsys) -> None:
    """The agent's own look (``detect``) at four live rank processes whose heartbeats it holds: rank 0 spins (its
    heartbeat thread starved: a loaded machine, the GIL held in native code), rank 1 sleeps without CPU (its
    heartbeat thread gone), rank 2 is stopped (SIGSTOP), rank 3 beats. Past the 5 s timeout ranks 1 and 2 are fenced
    at once, rank 0 is said to be running and left alone; silent again past twice the timeout, it is fenced too."""
    import torch.distributed as dist

    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig
    ranks = _four_ranks()
    try:
        cfg = TrainConfig(nproc=4, tp=1, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                          steps=8, heartbeat_timeout_s=5.0)
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        agent = Agent(cfg, None, tmp_path, procs=ranks, store=store)

        assert _silent_for(agent, {0: 3.0, 1: 3.0, 2: 3.0}) == set()  # half the timeout: each silent process is sampled
        time.sleep(0.5)
        assert _silent_for(agent, {0: 6.0, 1: 6.0, 2: 6.0}) == {1, 2}
        out = capsys.readouterr().out
        assert "rank 0 missed heartbeats for 6.0 s, but its process is not stopped (state R, running; " in out
        assert "rank 1's process: state S, sleeping; 0.00 s of CPU in the last" in out
        assert "rank 2's process: state T, stopped" in out
        assert "rank 1 missed heartbeats for 5.0 s: fencing it" in out and "rank 0" not in out.split("not stopped")[1]
        assert ranks[1].exitcode is not None and ranks[2].exitcode is not None and ranks[0].exitcode is None

        assert _silent_for(agent, {0: 1.0}) == set()
        assert "rank 0 beats again after 6.0 s of silence" in capsys.readouterr().out
        # a new silence, a new grace
        assert _silent_for(agent, {0: 3.0}) == set() and _silent_for(agent, {0: 6.0}) == set()
        assert _silent_for(agent, {0: 10.5}) == {0}
        out = capsys.readouterr().out
        assert "rank 0 missed heartbeats for 10.0 s: fencing it" in out and "rank 0's process: state R" in out
        assert ranks[0].exitcode is not None and ranks[3].exitcode is None
        assert not agent.silence.graced and not agent.silence.first  # (a rank taking its place starts afresh)
        assert [r.kind for r in agent.slow_nodes.records] == ["hang"] * 3
    finally:
        for rank in ranks.values():
            rank.kill()
            rank.join(5)


def test_ranks_on_another_machine_are_sampled_by_their_node_agent(tmp_path, capsys) -> None:
    """The same four ranks on another machine: the agent has no /proc of theirs, so it asks their node agent (the
    launcher's ``node_agent``, here in a thread, over the same store), which samples them and writes the samples
    back while asked. Rank 0 (spinning) gets its grace; ranks 1 (asleep without CPU) and 2 (stopped) are fenced at
    the timeout, through their node agent, with their states on the terminal; asks are withdrawn when a silence
    ends. A node agent that stops answering (no answer 2 s after the ask) leaves the heartbeat alone to decide: rank 0
    is then fenced at the timeout."""
    import argparse
    import threading

    import torch.distributed as dist

    from megatron_odyssey.launch import RemoteExits, RemoteRank, node_agent
    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig

    there = _four_ranks()
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    stop = threading.Event()
    args = argparse.Namespace(node_rank=1, workdir=tmp_path, join=None, stuck_restarts=0)
    node = threading.Thread(target=node_agent, args=(args, there, dist.TCPStore("127.0.0.1", store.port), None, stop))
    node.start()
    try:
        said = time.monotonic() + 10  # (its start's pids: long before any ask in a job, whose asks wait for silence)
        while not store.check([RANK_PID_KEY.format(i) for i in there]) and time.monotonic() < said:
            time.sleep(0.01)
        cfg = TrainConfig(nproc=4, tp=1, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                          steps=8, heartbeat_timeout_s=5.0)
        exits = RemoteExits(store)
        agent = Agent(cfg, None, tmp_path, procs={i: RemoteRank(store, i, exits) for i in there}, store=store)

        def asked(ident: int) -> bool:
            key = PROBE_ASK_KEY.format(ident)
            return store.check([key]) and store.get(key) != b""

        deadline = time.monotonic() + 20
        while len(agent.silence.first) < 3 and time.monotonic() < deadline:  # asked, then answered
            assert _silent_for(agent, {0: 3.0, 1: 3.0, 2: 3.0}) == set()
            time.sleep(0.05)
        assert set(agent.silence.first) == {0, 1, 2} and asked(0)
        assert not asked(3)  # (a rank that beats is not asked about)
        # each ask names the process its node agent said it launched (at its start, before the agent's first ask)
        assert [store.get(PROBE_ASK_KEY.format(i)).decode().partition("@")[2] for i in (0, 1, 2)] == \
            [str(there[i].pid) for i in (0, 1, 2)]
        time.sleep(1.2)  # (the node agent samples again: CPU time accrues between the two samples)
        assert _silent_for(agent, {0: 6.0, 1: 6.0, 2: 6.0}) == {1, 2}
        out = capsys.readouterr().out
        assert "rank 0 missed heartbeats for 6.0 s, but its process is not stopped (state R, running; " in out
        assert "rank 1's process: state S, sleeping; 0.00 s of CPU in the last" in out
        assert "rank 2's process: state T, stopped" in out
        assert there[1].exitcode is not None and there[2].exitcode is not None and there[0].exitcode is None
        assert not asked(1) and not asked(2) and not store.check([PROBE_KEY.format(2)])

        assert _silent_for(agent, {0: 1.0}) == set()
        assert "rank 0 beats again after 6.0 s of silence" in capsys.readouterr().out
        assert not asked(0) and not store.check([PROBE_KEY.format(0)])

        stop.set()  # the node agent no longer answers
        node.join(10)
        asked_until = time.monotonic() + 2.2  # (past the 2 s a node agent has to answer an ask)
        while time.monotonic() < asked_until:
            assert _silent_for(agent, {0: 3.0}) == set()
            time.sleep(0.05)
        assert 0 not in agent.silence.first
        assert _silent_for(agent, {0: 5.5}) == {0}
        assert "rank 0 missed heartbeats for 5.0 s: fencing it" in capsys.readouterr().out
    finally:
        stop.set()
        node.join(10)
        for rank in there.values():
            rank.kill()
            rank.join(5)


def test_a_remote_answer_counts_only_for_its_own_ask_and_while_it_changes() -> None:
    """An answer the node agent wrote late, for an ask already withdrawn, is not taken for the new ask's; an answer
    that stops changing (the node agent or its machine stopped) goes stale: nothing to read."""
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    probe = RemoteProcess(store, 4, stale_s=0.5, every_s=0.0)
    assert probe.sample() is None  # asks
    old = store.get(PROBE_ASK_KEY.format(4)).decode()
    probe.release()
    assert store.get(PROBE_ASK_KEY.format(4)) == b""
    time.sleep(0.01)
    assert probe.sample() is None  # asks again
    new = store.get(PROBE_ASK_KEY.format(4)).decode()
    assert new != old
    store.set(PROBE_KEY.format(4), f"{old} R 9.0 100.0")  # the first ask's answer, late
    assert probe.sample() is None
    store.set(PROBE_KEY.format(4), f"{new} T 9.0 101.0")
    assert probe.sample() == ProcessSample("T", 9.0, 101.0)
    time.sleep(0.6)
    assert probe.sample() is None  # unchanged for longer than stale_s
    store.set(PROBE_KEY.format(4), f"{new} T 9.0 102.0")
    assert probe.sample() == ProcessSample("T", 9.0, 102.0)


def test_an_ask_that_names_a_process_is_answered_by_that_process_only() -> None:
    """The agent asks about a joined rank by its pid: the node agent does not answer it with another process of the
    same rank (a later life started early, or an earlier one not yet reaped), which could give a dead process the grace
    of a running one. An ask that names no process is answered, except on a joining machine (``named_only``): there it
    is about the rank's earlier life."""
    import torch.distributed as dist

    from megatron_odyssey.runtime.process_probe import ProbeRequests

    here = _python("while True: pass")
    other = _python("pass")
    other.wait(10)
    try:
        store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
        for named_only, meant, answered in ((False, other.pid, False), (False, here.pid, True), (False, None, True),
                                            (True, other.pid, False), (True, here.pid, True), (True, None, False)):
            node = ProbeRequests(lambda: {3: here.pid}, every_s=0.0, named_only=named_only)
            probe = RemoteProcess(store, 3, every_s=0.0, pid=meant)
            assert probe.sample() is None  # asks
            ask = store.get(PROBE_ASK_KEY.format(3)).decode()
            assert ask.endswith(f"@{meant}") if meant else "@" not in ask
            node.poll(store)
            got = probe.sample()
            assert (got is not None) == answered, (named_only, meant, got)
            assert got is None or got.state == "R"
            probe.release()
    finally:
        here.kill()
        here.wait(10)


@contextlib.contextmanager
def _machine_that_joined(tmp_path, node_rank: int, joiner, port: int, others: dict) -> Iterator[None]:
    """Machine ``node_rank`` came back (``odyssey-launch --join``): its node agent, in a thread, reports to the store
    at ``port`` and answers only asks that name its rank's process, ``joiner``; afterwards every rank is killed."""
    import argparse
    import threading

    import torch.distributed as dist

    from megatron_odyssey.launch import node_agent

    stop = threading.Event()
    node = threading.Thread(target=node_agent, args=(argparse.Namespace(node_rank=node_rank, workdir=tmp_path,
                                                                        join=node_rank, stuck_restarts=0),
                                                     {node_rank: joiner}, dist.TCPStore("127.0.0.1", port), None, stop))
    node.start()
    try:
        yield
    finally:
        stop.set()
        node.join(10)
        for rank in (*others.values(), joiner):
            rank.kill()
            rank.join(5)


def test_an_admitted_rank_on_another_machine_is_judged_from_its_admission(tmp_path, capsys) -> None:
    """Machine 3 comes back and its rank is admitted while the store still holds its earlier life's last beat, 150 s
    old: the new process asked to join, but its own first beat has not reached the store yet (its heartbeat thread
    starved on a loaded machine). That old beat is not the new process's: its silence counts from the admission, so
    it is not fenced at once (before, it was, for the dead process's silence, with no look at the new one), nor said to
    beat again after a grace its earlier life got. Past half the timeout its node agent is asked about it; past the
    timeout its process, which spins, gets the grace; its first beat ends the silence. Before it asked to join, its
    machine's node agent answers no ask about rank 3 (a --rejoin replacement starts early, while the rank's earlier
    life may still be judged: the replacement's answer would give a dead process a running one's grace)."""
    import torch.distributed as dist

    from megatron_odyssey.launch import LocalRank
    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.joining import JOINING_KEY
    from megatron_odyssey.runtime.slow_nodes import Action

    here = {i: LocalRank(_python("import time; time.sleep(120)")) for i in range(3)}
    joiner = LocalRank(_python("while True: pass"))
    dead = LocalRank(_python("pass"))
    dead.join(10)
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    with _machine_that_joined(tmp_path, 3, joiner, store.port, others=here):
        cfg = TrainConfig(nproc=4, tp=1, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                          steps=8, heartbeat_timeout_s=5.0)
        agent = Agent(cfg, None, tmp_path, procs={**here, 3: dead}, store=store)
        agent.dead.add(3)
        agent.silence.graced[3] = 10.7  # the earlier life starved once (and was then fenced by its peers' wait)
        store.set("odyssey/hb/3", repr(time.time() - 150.0))  # the earlier life's last beat
        # before it asks to join, an ask about rank 3 is about its earlier life: the joining machine does not answer
        store.set(PROBE_ASK_KEY.format(3), "about-the-earlier-life")
        time.sleep(1.2)
        assert not store.check([PROBE_KEY.format(3)])
        assert not store.check([RANK_PID_KEY.format(3)])  # (a joining machine says its pid in its join request)
        store.set(PROBE_ASK_KEY.format(3), "")
        store.append(JOINING_KEY, f"3:{joiner.pid}:launched;")
        agent.join_requests.poll(store)
        agent._admit(Action("join", None, ranks=[3]))
        admitted = time.time()

        def look(at: float) -> set[int]:
            """The agent's look (reading the beats from the store) ``at`` seconds after the admission; ranks 0-2
            beat just before."""
            time.sleep(max(0.0, admitted + at - time.time()))
            for i in here:
                store.set(f"odyssey/hb/{i}", repr(time.time()))
            agent.beats_read = 0.0
            return agent.detect()

        assert look(0.0) == set() and 3 in agent.members() and 3 not in agent.beats
        assert "rank 3" not in capsys.readouterr().out
        deadline = time.monotonic() + 20
        while 3 not in agent.silence.first and time.monotonic() < deadline:  # asked, then answered
            assert look(2.6) == set()
            time.sleep(0.05)
        assert agent.silence.first[3].runnable
        assert store.get(PROBE_ASK_KEY.format(3)).decode().endswith(f"@{joiner.pid}")  # (the process meant)
        assert look(5.2) == set()
        out = capsys.readouterr().out
        assert "rank 3 missed heartbeats for 5.2 s, but its process is not stopped (state R, running" in out, out
        store.set("odyssey/hb/3", repr(time.time()))  # its first beat
        agent.beats_read = 0.0
        assert agent.detect() == set()
        assert "rank 3 beats again after 5.2 s of silence" in capsys.readouterr().out
        assert joiner.exitcode is None


def test_after_a_takeover_a_joined_rank_is_asked_about_and_fenced_as_the_process_that_joined(tmp_path) -> None:
    """Machine 2 came back and its rank was admitted (``odyssey-launch --join``: its node agent obeys only that
    process's own fence key and answers only asks that name it); then machine 0 is lost with the agent, and the
    standby on machine 1 takes over. The standby's agent gets the joined process from the lost agent's replicated
    state: its asks name that process and are answered, and its fence kills it. Before, the standby took rank 2 for a
    rank launched with the job: its asks went unanswered (the heartbeat alone judged, a starved process without its
    grace) and its fence was ignored, so a hung rank whose heartbeat thread had stopped too stayed alive."""
    import json

    import torch.distributed as dist

    from megatron_odyssey.launch import LocalRank, ranks_taken_over
    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import FENCE_KEY, OrphanRank, rank_fence_key
    from megatron_odyssey.runtime.joining import JOINING_KEY
    from megatron_odyssey.runtime.slow_nodes import Action

    cfg = TrainConfig(nproc=4, tp=1, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                      steps=8)
    here = {i: LocalRank(_python("import time; time.sleep(120)")) for i in (0, 1, 3)}
    joiner = LocalRank(_python("while True: pass"))  # (no heartbeat thread of its own to obey a fence: only SIGKILL)
    earlier = LocalRank(_python("pass"))
    earlier.join(10)
    lost_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    standby_store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    # machine 2's node agent, already on the standby's store as after following it (ControlPlane.follow: the
    # takeover tests)
    with _machine_that_joined(tmp_path, 2, joiner, standby_store.port, others=here):
        lost = Agent(cfg, None, tmp_path, procs={**here, 2: earlier}, store=lost_store)
        lost.dead.add(2)
        lost_store.append(JOINING_KEY, f"2:{joiner.pid}:launched;")
        lost.join_requests.poll(lost_store)
        lost._admit(Action("join", None, ranks=[2]))
        state = json.loads(json.dumps(lost.snapshot()))  # as the standby's replica keeps it
        assert state["joined"] == {"2": joiner.pid}
        # the standby's agent, on machine 1 (one rank a machine): machine 0's rank orphaned, machine 1's its own
        procs = ranks_taken_over(standby_store, 4, 1, {1: here[1]}, state)
        assert isinstance(procs[0], OrphanRank) and procs[1] is here[1]
        assert procs[3].joined_pid is None and procs[3].fence_key == FENCE_KEY.format(3)
        assert procs[2].joined_pid == joiner.pid and procs[2].fence_key == rank_fence_key(2, joiner.pid)
        # had it joined on machine 0 (three ranks a machine), orphaned with it, its fence would be its own key too
        orphaned = ranks_taken_over(standby_store, 4, 3, {}, state)
        assert isinstance(orphaned[2], OrphanRank) and orphaned[2].fence_key == rank_fence_key(2, joiner.pid)
        assert orphaned[0].fence_key == FENCE_KEY.format(0)
        rank2 = procs[2]
        deadline = time.monotonic() + 20
        while (found := rank2.process_probe.sample()) is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert found is not None and found.runnable, found  # answered: the ask names the process that joined
        assert standby_store.get(PROBE_ASK_KEY.format(2)).decode().endswith(f"@{joiner.pid}")
        assert rank2.exitcode is None
        rank2.kill()
        rank2.join(20)
        assert rank2.exitcode == -9 and joiner.exitcode == -9  # fenced: its node agent killed it
        assert all(here[i].exitcode is None for i in here)


def test_a_judge_without_a_process_to_read_fences_at_the_timeout() -> None:
    """A rank on another machine (no pid here): its heartbeat alone decides, as before."""
    said: list[str] = []
    judge = SilenceJudge(5.0, said.append)
    judge.look(7, None, 3.0)
    assert judge.fence(7, None, 5.5) == (True, "") and said == []


def test_a_remote_rank_first_asked_about_at_the_timeout_gets_its_answers_time() -> None:
    """Nobody looked at the rank past half the timeout (the agent's own pass came late): the ask goes out at the
    timeout and the node agent is given its time to answer (``stale_s``) before the heartbeat alone decides, and
    never past twice the timeout. An answer that comes decides as any other."""
    from types import SimpleNamespace

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    judge = SilenceJudge(5.0, lambda _: None)
    silent = SimpleNamespace(process_probe=RemoteProcess(store, 7, stale_s=0.5, every_s=0.0))
    assert judge.fence(7, silent, 5.5) == (False, "")  # asked now
    assert silent.process_probe.awaiting() and judge.fence(7, silent, 5.6) == (False, "")
    assert judge.fence(7, silent, 10.0) == (True, "")  # (twice the timeout: no more waiting)
    time.sleep(0.6)
    assert not silent.process_probe.awaiting() and judge.fence(7, silent, 6.2) == (True, "")  # no answer came

    stopped = SimpleNamespace(process_probe=RemoteProcess(store, 8, stale_s=0.5, every_s=0.0))
    assert judge.fence(8, stopped, 5.5) == (False, "")
    store.set(PROBE_KEY.format(8), f"{store.get(PROBE_ASK_KEY.format(8)).decode()} T 9.0 100.0")
    assert judge.fence(8, stopped, 5.6) == (True, "state T, stopped")


def test_a_late_heartbeat_says_so_and_where_the_main_thread_is(capfd) -> None:
    """The main thread holds the GIL for 1.5 s in a native call (ctypes' PyDLL keeps it): the heartbeat thread beats
    late, and says so on the rank's stderr with where the main thread was, for whoever reads why it was fenced."""
    import ctypes
    from datetime import timedelta

    import torch.distributed as dist

    from megatron_odyssey.runtime.liveness import Heartbeat

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    beat = Heartbeat("127.0.0.1", store.port, 5, 0.05)
    beat.start()
    try:
        deadline = time.monotonic() + 10
        while beat.last_beat is None and time.monotonic() < deadline:
            time.sleep(0.01)
        ctypes.PyDLL(None).usleep(1_500_000)  # the GIL held, no Python code runs: no beat either
        time.sleep(0.5)
    finally:
        beat.stop()
    err = capfd.readouterr().err
    assert "[odyssey rank 5] heartbeat: this beat is 1." in err, err
    # (the heartbeat thread gets the GIL back as the call returns: the main thread is still in this test)
    assert f"(the main thread is now at {__file__}:" in err and " in test_a_late_heartbeat_says_so" in err, err


def _forked(then) -> int:
    # the garbage earlier tests left in this worker (agents and their TCPStores, in reference cycles) is collected
    # here, not in the child: filelock's at-fork hook ran a collection in a child, which destroyed a store whose
    # threads the child does not have, and the child died of SIGSEGV before its own code ran (seen once in CI)
    gc.collect()
    pid = os.fork()
    if pid == 0:
        then()
        os._exit(0)
    return pid


def test_dead_children_are_the_failed_ones_not_yet_waited_for_since_a_time() -> None:
    """What SaveWriters reads: children that exited with a failure (an exit code, a signal) and that nobody waited
    for, started at the given time or later; not one that exited 0, one still running, nor one from before."""
    before = _forked(lambda: os._exit(5))
    time.sleep(0.2)
    since = time.time()
    failed = _forked(lambda: os._exit(1))
    killed = _forked(lambda: os.kill(os.getpid(), signal.SIGKILL))
    fine = _forked(lambda: None)
    running = _forked(lambda: time.sleep(30))
    try:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not {failed, killed} <= {d.pid for d in dead_children(os.getpid(), since)}:
            time.sleep(0.05)
        ours = {before, failed, killed, fine, running}  # (the test process may have other children)
        found = {d.pid: d.describe() for d in dead_children(os.getpid(), since) if d.pid in ours}
        assert found == {failed: "exit code 1", killed: "killed by SIGKILL"}
        assert {d.pid: d.describe() for d in dead_children(os.getpid())}[before] == "exit code 5"
        assert {before, failed, killed, fine, running} <= set(children_of(os.getpid()))
    finally:
        os.kill(running, signal.SIGKILL)
        for pid in (before, failed, killed, fine, running):
            os.waitpid(pid, 0)
    assert not {d.pid for d in dead_children(os.getpid())} & ours  # waited for: gone

