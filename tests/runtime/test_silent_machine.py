"""A machine that goes silent (loses power or its network) instead of dying with its connections closed: requests to
its store fail within ``sockets.UNACKED_S``, the standby takes over from a silent agent, and the other machines'
launchers follow it. Before, every request to the silent machine waited on Linux's retransmits (about 15 minutes) and
a wait for a key waited for ever, so the standby never judged the agent lost and the job stood still.

The silent machine is a network namespace whose link is taken down (``testing.network_namespace``): real stores,
real sockets, real dropped packets. Those tests need root; the socket options are checked without."""
from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
import torch.distributed as dist

from megatron_odyssey.launch import LocalRank
from megatron_odyssey.runtime.control_plane import STATE_KEY, TAKEOVER_KEY, ControlPlane, Standby, client, free_port
from megatron_odyssey.runtime.sockets import UNACKED_S, tcp_connections
from megatron_odyssey.testing.network_namespace import (NetworkNamespace, RoutedMachines, Unavailable,
                                                        network_namespace, routed_machines)

SERVE = ("import sys, time, torch.distributed as d; s = d.TCPStore('0.0.0.0', int(sys.argv[1]), is_master=True, "
         "wait_for_workers=False); s.set('odyssey/config', '{}'); print('up', s.port, flush=True); time.sleep(600)")
SLACK_S = 8.0  # beyond UNACKED_S: a keepalive interval, the store's own retries, a loaded machine


@pytest.fixture
def silent() -> NetworkNamespace:
    try:
        with network_namespace() as space:
            yield space
    except Unavailable as why:
        pytest.skip(f"no second machine here: {why}")


def _store_in(space: NetworkNamespace, port: int = 29911) -> tuple[subprocess.Popen, tuple[str, int]]:
    server = space.popen([sys.executable, "-c", SERVE, str(port)], stdout=subprocess.PIPE, start_new_session=True)
    assert server.stdout.readline().split() == [b"up", str(port).encode()], "the store in the namespace did not start"
    return server, (space.ip, port)


def _options(port: int) -> list[tuple[int, int]]:
    found = []
    for sock in tcp_connections():
        if sock.getpeername()[1] == port:
            found.append((sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT),
                          sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE)))
    return found


@pytest.fixture(autouse=True)
def _no_launcher_left_running() -> Iterator[None]:
    """A launcher thread a test leaves behind goes on connecting to a store that is gone, and its retries land in
    the output of the tests after it in the same process (a CI run failed so)."""
    yield
    left = [t.name for t in threading.enumerate() if t.name.endswith("(launcher)")]
    assert not left, f"launcher thread(s) left running: {left}"


def _idle_rank() -> LocalRank:
    """A rank process for a launcher to watch: it only waits (the tests kill it, or their launcher does)."""
    return LocalRank(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True))


def _launcher(tmp: Path, rank, agent: tuple[str, int], control: ControlPlane,
              stop: threading.Event | None = None) -> tuple[threading.Thread, list[BaseException]]:
    """Machine 2's node agent (its rank 5) in a thread, reporting to ``agent``; what it raises lands in the list.
    ``stop`` ends it where the test's agent never ends the job (set before that agent's store goes: a launcher left
    waiting for the end would follow it for 120 s, its connect retries landing in later tests' output)."""
    from megatron_odyssey.launch import node_agent

    failed: list[BaseException] = []

    def launcher() -> None:
        try:
            node_agent(argparse.Namespace(node_rank=2, workdir=tmp, join=None, stuck_restarts=0), {5: rank},
                       client(agent, 300), control, stop)
        except BaseException as exc:  # noqa: BLE001 - the test's verdict
            failed.append(exc)

    node = threading.Thread(target=launcher, daemon=True)
    node.start()
    return node, failed


def test_a_control_store_client_bounds_the_silence_of_every_connection_to_that_store() -> None:
    """(Every connection of this process to the store: a plain client's too, and the server's own client here.)"""
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    plain = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=10))
    before = _options(server.port)
    assert len(before) == 2 and set(before) == {(0, 0)}  # (Linux's defaults: no bound, no keepalive)
    ours = client(("127.0.0.1", server.port), 10)
    assert _options(server.port) == [(int(UNACKED_S * 1000), 1)] * 3
    ours.set("k", "v")
    assert plain.get("k") == b"v"  # the options change nothing while the peer answers


def test_the_bound_is_the_launchers_silence_timeout(monkeypatch: pytest.MonkeyPatch) -> None:
    """``odyssey-launch --silence-timeout 25`` (its processes' environment): a network whose blips last longer than
    10 s keeps its connections."""
    from megatron_odyssey.runtime.sockets import SILENCE_ENV

    monkeypatch.setenv(SILENCE_ENV, "25")
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    client(("127.0.0.1", server.port), 10)
    bounds = _options(server.port)
    assert bounds and set(bounds) == {(25000, 1)}, bounds


def test_requests_to_a_machine_gone_silent_fail_within_the_bound(silent: NetworkNamespace) -> None:
    """A rank waiting for a commit (``get`` of a key not set yet: it sends nothing while it waits) and a node agent's
    poll (``check`` after the cut) both fail within the bound; a plain TCPStore client's ``check`` is still waiting
    then (the cut is silent: nothing told it)."""
    server, address = _store_in(silent)
    waiting, polling = client(address, 600), client(address, 600)
    plain = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; from datetime import "
                              "timedelta; s = d.TCPStore(sys.argv[1], int(sys.argv[2]), is_master=False, "
                              "timeout=timedelta(seconds=600)); print('up', flush=True); sys.stdin.readline(); "
                              "s.check(['odyssey/config']); print('answered', flush=True)", *map(str, address)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert plain.stdout.readline() == b"up\n"
        ended: dict[str, float] = {}

        def failing(op: str, request) -> threading.Thread:  # (a thread: without the bound it would wait for ever)
            def run() -> None:
                try:
                    request()
                except Exception:  # noqa: BLE001 - torch's DistNetworkError, what the callers' recovery catches
                    ended[op] = time.monotonic()

            thread = threading.Thread(target=run, daemon=True)
            thread.start()
            return thread

        waiter = failing("get", lambda: waiting.get("odyssey/commit/never"))
        time.sleep(0.5)
        silent.cut()
        cut = time.monotonic()
        plain.stdin.write(b"ask\n")
        plain.stdin.flush()
        poller = failing("check", lambda: polling.check(["odyssey/config"]))
        for thread in (waiter, poller):
            thread.join(max(0.0, cut + UNACKED_S + SLACK_S - time.monotonic()))
        assert set(ended) == {"get", "check"}, ended
        took = {op: t - cut for op, t in ended.items()}
        assert max(took.values()) < UNACKED_S + SLACK_S, took
        assert plain.poll() is None  # still waiting for its answer: only the bound ended ours
    finally:
        plain.kill()
        server.kill()


def test_without_a_standby_a_launcher_whose_agent_is_gone_says_so_at_once(tmp_path: Path) -> None:
    """``--no-standby``: the agent's process is gone (its machine refuses the connection): the launcher does not wait
    for it to answer again, it stops with the reason."""
    server = subprocess.Popen([sys.executable, "-c", SERVE, "0"], stdout=subprocess.PIPE, start_new_session=True)
    rank = _idle_rank()
    try:
        said = server.stdout.readline().split()
        assert said[0] == b"up"
        agent = ("127.0.0.1", int(said[1]))
        node, failed = _launcher(tmp_path, rank, agent, ControlPlane(agent, None, -1, wait_s=120))
        time.sleep(0.5)
        server.kill()
        t0 = time.monotonic()
        node.join(30)
        assert failed and isinstance(failed[0], ConnectionError), failed
        assert "is gone and this job has no standby agent" in str(failed[0])
        assert time.monotonic() - t0 < 15  # (not the control plane's 120 s)
    finally:
        rank.kill()
        server.kill()


def test_the_standby_takes_over_from_a_silent_agent_and_the_other_machines_follow(silent: NetworkNamespace,
                                                                                     tmp_path: Path) -> None:
    """The agent's machine goes silent: the standby judges the agent lost and returns its state to take over with,
    and another machine's launcher (its node agent, polling the agent's store) moves to the standby's store and
    reports its rank's exit there, each within the bound."""
    from megatron_odyssey.launch import EXIT_KEY, node_agent

    server, agent = _store_in(silent)
    standby_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    standby = (silent.host_ip, standby_store.port)  # as the agent's machine would reach it
    standby_store.set(STATE_KEY, json.dumps({"gen": 1, "agent_pid": 1}))  # (the agent's replicated state)
    watcher = Standby(standby_store, agent, tmp_path / "standby.steps.jsonl", takeover_after_s=2.0,
                      log=lambda msg: None)
    rank = _idle_rank()
    try:
        control = ControlPlane(agent, standby, -1, wait_s=120)
        args = argparse.Namespace(node_rank=2, workdir=tmp_path, join=None, stuck_restarts=0)
        codes: list[int] = []
        node = threading.Thread(target=lambda: codes.append(node_agent(args, {5: rank}, client(agent, 300), control)),
                                daemon=True)
        node.start()
        took_over: list[object] = []
        watching = threading.Thread(target=lambda: took_over.append(watcher.watch()), daemon=True)
        watching.start()
        time.sleep(1.0)
        assert not took_over  # the agent answers: nothing to take over
        silent.cut()
        cut = time.monotonic()
        watching.join(UNACKED_S + 2.0 + SLACK_S)
        assert took_over and isinstance(took_over[0], dict) and took_over[0]["gen"] == 1, took_over
        assert took_over[0]["lost_as"] == "silent"  # (so the takeover goes on only with half of the ranks: quorum)
        standby_store.set(TAKEOVER_KEY, "1")  # (what take_over says once it has the job)
        rank.kill()
        deadline = time.monotonic() + UNACKED_S + SLACK_S
        while not standby_store.check([EXIT_KEY.format(5)]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert standby_store.check([EXIT_KEY.format(5)]), "the launcher did not follow the standby"
        assert int(standby_store.get(EXIT_KEY.format(5))) == -9
        assert time.monotonic() - cut < 2 * (UNACKED_S + SLACK_S)
        node.join(10)
    finally:
        rank.kill()
        server.kill()


def test_a_launcher_that_reaches_neither_agent_leaves_once_the_job_has_dropped_its_ranks(silent: NetworkNamespace,
                                                                                        tmp_path: Path) -> None:
    """This machine is cut off from both the agent's machine and the standby's (here both stores are in the silent
    one): its launcher leaves with the reason once neither has answered for ``judged_lost_after`` (the silence bound
    and twice the heartbeat timeout), by when the job has dropped its ranks. Before, it waited out the control
    plane's 120 s for a takeover it could not have seen."""
    from megatron_odyssey.runtime.control_plane import judged_lost_after

    agent_server, agent = _store_in(silent, 29911)
    standby_server, standby = _store_in(silent, 29912)
    rank = _idle_rank()
    lost_after = judged_lost_after(2.0)
    assert lost_after == UNACKED_S + 4.0
    try:
        node, failed = _launcher(tmp_path, rank, agent, ControlPlane(agent, standby, -1, 120, lost_after))
        time.sleep(1.0)
        silent.cut()
        cut = time.monotonic()
        node.join(UNACKED_S + lost_after + SLACK_S)
        took = time.monotonic() - cut
        assert failed and isinstance(failed[0], ConnectionError), failed
        assert (f"neither the agent's store {agent[0]}:{agent[1]} nor the standby's {standby[0]}:{standby[1]} has "
                "answered for") in str(failed[0]) and "cut off from both" in str(failed[0]), failed[0]
        assert lost_after <= took < UNACKED_S + lost_after + SLACK_S, took  # (not before, and not the 120 s)
    finally:
        rank.kill()
        agent_server.kill()
        standby_server.kill()


def test_a_launcher_cut_off_from_the_agent_only_leaves_once_the_standby_says_its_ranks_were_fenced(
        silent: NetworkNamespace, tmp_path: Path) -> None:
    """This machine stops reaching the agent's machine (here the agent's store is in the silent one) but still reaches
    the standby's, which does not take over (it reaches the agent). The agent fences this machine's rank and says so
    in the standby's store too (``Replica.fence``): the launcher, which reaches only the standby, learns there that
    the job dropped its ranks and leaves with that reason. Before, the standby's answers kept it waiting for a
    takeover that would never come, up to the control plane's 120 s, then it left saying it was cut off from both."""
    from megatron_odyssey.runtime.control_plane import FENCE_KEY, Dropped, Replica, serve

    server, agent = _store_in(silent)
    port = free_port()
    standby_store = serve("0.0.0.0", port, 30)
    standby = (silent.host_ip, port)  # (as the agent's machine reaches it: this machine does too)
    rank = _idle_rank()
    try:
        node, failed = _launcher(tmp_path, rank, agent, ControlPlane(agent, standby, -1, 120, lost_after_s=600))
        time.sleep(1.0)
        silent.cut()
        node.join(UNACKED_S + SLACK_S)  # its connection to the agent broke: it follows, the standby answering
        assert node.is_alive() and not failed, failed  # (no fence said yet: a takeover may still come)
        Replica(("127.0.0.1", port)).fence(FENCE_KEY.format(5), "was fenced: missed heartbeats for 10.0 s")
        fenced = time.monotonic()
        node.join(10)
        assert failed and isinstance(failed[0], Dropped), failed
        assert (f"the agent's store {agent[0]}:{agent[1]} does not answer this machine, and the standby's store "
                f"{standby[0]}:{standby[1]} says that the agent fenced its ranks [5] (rank 5 was fenced: missed "
                f"heartbeats for 10.0 s): this machine is cut off from the agent's") in str(failed[0]), failed[0]
        assert time.monotonic() - fenced < 5  # (not the 120 s, nor the 600 s)
        assert not standby_store.check([TAKEOVER_KEY])
    finally:
        rank.kill()
        server.kill()


def test_a_launcher_whose_agent_and_standby_are_both_gone_says_so_at_once(tmp_path: Path) -> None:
    """Both stores' processes are gone (their machines refuse the connection): nobody can take the job over, so
    the launcher leaves at once with the reason, without waiting for the job to drop its ranks."""
    servers = [subprocess.Popen([sys.executable, "-c", SERVE, "0"], stdout=subprocess.PIPE, start_new_session=True)
               for _ in range(2)]
    rank = _idle_rank()
    try:
        agent, standby = (("127.0.0.1", int(server.stdout.readline().split()[1])) for server in servers)
        node, failed = _launcher(tmp_path, rank, agent, ControlPlane(agent, standby, -1, 120, lost_after_s=600))
        time.sleep(0.5)
        for server in servers:
            server.kill()
        t0 = time.monotonic()
        node.join(30)
        assert failed and isinstance(failed[0], ConnectionError), failed
        assert "both refuse the connection (both processes are gone)" in str(failed[0]), failed[0]
        assert time.monotonic() - t0 < 15  # (neither the 600 s nor the 120 s)
    finally:
        rank.kill()
        for server in servers:
            server.kill()


@pytest.mark.parametrize("standby", [True, False], ids=["standby", "no-standby"])
def test_a_network_blip_longer_than_the_bound_costs_a_connection_not_the_launcher(silent: NetworkNamespace,
                                                                                     tmp_path: Path,
                                                                                     standby: bool) -> None:
    """The agent's machine is silent for longer than the bound, then answers again, and no standby took over (or
    there is none: ``--no-standby``): the launcher's broken connection is replaced by a new one to the same agent,
    and its rank's exit reaches that agent. Before, the launcher raised (its store answered, yet its own client was
    broken) and its machine left the job."""
    from megatron_odyssey.launch import EXIT_KEY
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import judged_lost_after

    server, agent = _store_in(silent)
    standby_store = dist.TCPStore("0.0.0.0", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    rank = _idle_rank()
    stop = threading.Event()
    try:
        control = ControlPlane(agent, (silent.host_ip, standby_store.port) if standby else None, -1, wait_s=120)
        node, failed = _launcher(tmp_path, rank, agent, control, stop)
        time.sleep(1.0)
        # (learnt from the job's config in the agent's store, a TrainConfig's defaults here: a 14 s blip is shorter)
        assert control.lost_after_s == judged_lost_after(TrainConfig().heartbeat_timeout_s) == UNACKED_S + 10.0
        silent.cut()
        time.sleep(UNACKED_S + 4.0)  # (the launcher's poll fails meanwhile: its connection is aborted)
        silent.mend()
        time.sleep(2.0)
        assert not failed, failed
        rank.kill()
        agents = client(agent, 30)
        deadline = time.monotonic() + 30
        while not agents.check([EXIT_KEY.format(5)]) and time.monotonic() < deadline and not failed:
            time.sleep(0.1)
        assert not failed, failed
        assert int(agents.get(EXIT_KEY.format(5))) == -9
        assert not standby_store.check([EXIT_KEY.format(5)])  # (no takeover: nothing went to the standby)
    finally:
        stop.set()  # (it waits for the job's end, which this test's agent never says)
        node.join(10)
        rank.kill()
        server.kill()
    assert not node.is_alive() and not failed, failed


@pytest.mark.parametrize("witness", [False, True], ids=["no-witness", "witness"])
def test_an_agent_whose_standby_goes_silent_needs_a_majority_from_then_on(silent: NetworkNamespace, tmp_path: Path,
                                                                          capsys: pytest.CaptureFixture,
                                                                          witness: bool) -> None:
    """The standby's store is in the silent machine: the agent cannot tell its power loss from its own machine being
    cut off, so from then on it starts a generation only with more than half of the ranks of the generation the standby
    last acknowledged (``runtime.quorum``), or half where it claims the job's witness (``--witness-dir``); a standby
    whose machine refuses the connection instead is gone for good (``test_agent_records``: no quorum). The agent says
    in its store that it went on without the standby, which reads it there if its machine comes back
    (``control_plane.DISMISSED_KEY``; ``test_a_standby_the_agent_went_on_without_never_takes_the_job_over``)."""
    from megatron_odyssey.runtime.agent import Agent, free_port
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import DISMISSED_KEY, Replica, serve
    from megatron_odyssey.runtime.quorum import NoQuorum, Witness

    server, address = _store_in(silent)
    try:
        cfg = TrainConfig(nproc=4, tp=1, pp=1, layers=4, hidden=32, heads=4, seq=16, global_batch=4, micro_batch=1,
                          steps=4)
        agent = Agent(cfg, None, tmp_path, procs={}, store=serve("127.0.0.1", free_port(), 10))
        agent.witness = Witness.create(tmp_path, "agent on machine 0") if witness else None
        agent.replica = Replica(address, connect_timeout_s=30)
        agent._replicate_state()
        assert agent.replicated == frozenset(range(4)) and agent.quorum is None  # (acknowledged: no quorum needed)
        silent.cut()
        t0 = time.monotonic()
        assert not agent._to_standby(lambda r: r.step({"committed": 0}, {"step": 0}))
        assert time.monotonic() - t0 < 3 * (UNACKED_S + SLACK_S)  # (three attempts, each within the bound)
        assert agent.replica is None and agent.quorum is not None
        assert agent.quorum.references == (frozenset(range(4)),)
        assert "its machine is silent: it lost power or stands still, or this machine is cut off" in capsys.readouterr().err
        assert agent.store.get(DISMISSED_KEY).decode().startswith("its store stopped answering at generation 0, "
                                                                  "before the first commit: ")
        agent.quorum.check({0, 1, 2})
        with pytest.raises(NoQuorum, match=r"holds 1 of the job's 4 ranks"):
            agent.quorum.check({0})
        if witness:  # (the tie is the witness's: this agent claims it first)
            agent.quorum.check({0, 1})
            assert agent.witness.holder_of(frozenset(range(4))) == "agent on machine 0"
        else:
            with pytest.raises(NoQuorum, match=r"holds 2 of the job's 4 ranks"):  # (the tie is the standby's)
                agent.quorum.check({0, 1})
    finally:
        server.kill()


def test_a_store_that_may_be_gone_is_asked_without_the_store_clients_retries(silent: NetworkNamespace,
                                                                             capfd: pytest.CaptureFixture) -> None:
    """The loops that wait for a lost agent or standby to answer (``answering``, a heartbeat's reconnect, the
    standby's probe) knock first: a machine gone silent or a process gone costs one connect of at most a second and
    nothing on the terminal. Before, each pass made a store client, whose retries logged several lines each: a
    machine cut off from the job filled its terminal with about a thousand of them while it waited."""
    from megatron_odyssey.runtime.control_plane import PROBE_TIMEOUT_S, NotThere, answering, client_if_there

    server, address = _store_in(silent)
    try:
        assert answering(address) is not None  # (there: a client that answers)
        capfd.readouterr()
        silent.cut()
        t0 = time.monotonic()
        assert answering(address) is None
        with pytest.raises(NotThere, match="does not answer") as gone:
            client_if_there(address)
        assert gone.value.answer == "silent"
        assert time.monotonic() - t0 < 2 * PROBE_TIMEOUT_S + 3.0  # (two knocks of at most a second each)
        silent.mend()
        server.kill()
        server.wait()
        with pytest.raises(NotThere, match="refuses the connection") as gone:
            client_if_there(address)
        assert gone.value.answer == "refused"
        assert "socket.cpp" not in capfd.readouterr().err  # (c10d's connect retries: none were made)
    finally:
        server.kill()


LISTEN = ("import socket, sys; s = socket.create_server(('0.0.0.0', int(sys.argv[1]))); print('up', flush=True); "
          "[s.accept()[0].close() for _ in iter(int, 1)]")
CONNECT = ("import socket, sys\ntry:\n    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=2).close(); "
           "print('reached')\nexcept OSError as e:\n    print(type(e).__name__)")


@pytest.fixture
def routed() -> RoutedMachines:
    try:
        with routed_machines(3) as machines:
            yield machines
    except Unavailable as why:
        pytest.skip(f"no routed machines here: {why}")


@pytest.mark.parametrize("rejecting", [False, True], ids=["dropping", "rejecting"])
def test_a_cut_between_two_routed_machines_leaves_every_other_path_open(routed: RoutedMachines,
                                                                        rejecting: bool) -> None:
    """The harness of a partition that is not transitive (``testing.network_namespace.routed_machines``): after the
    cut between machines 0 and 1, a connection between them times out (a cut that drops: no refusal) or is refused
    at once (one that rejects, as a firewall's reset), both ways, and each still reaches machine 2 and this host,
    which reaches both. A second, rejecting cut between this host and machine 2 leaves machines 0 and 1 reaching
    both."""
    machines, port = routed, 29913
    for m in machines.machines:  # a listener on each machine
        server = m.popen([sys.executable, "-c", LISTEN, str(port)], stdout=subprocess.PIPE, start_new_session=True)
        assert server.stdout.readline().strip() == b"up"

    def reach(src: NetworkNamespace | None, dst: str) -> str:
        argv = [sys.executable, "-c", CONNECT, dst, str(port)]
        run = src.popen(argv, stdout=subprocess.PIPE) if src else subprocess.Popen(argv, stdout=subprocess.PIPE)
        return run.communicate(timeout=30)[0].decode().strip()

    m0, m1, m2 = machines.machines
    assert reach(m0, m1.ip) == reach(None, m1.ip) == "reached"
    machines.cut(0, 1, rejecting=rejecting)
    t0 = time.monotonic()
    cut = "ConnectionRefusedError" if rejecting else "TimeoutError"
    assert reach(m0, m1.ip) == reach(m1, m0.ip) == cut  # both ways
    assert not rejecting or time.monotonic() - t0 < 1.9  # (refused at once: no probe's timeout waited out)
    assert reach(m0, m2.ip) == reach(m1, m2.ip) == reach(None, m0.ip) == reach(None, m1.ip) == "reached"
    assert reach(m0, m0.host_ip) == "ConnectionRefusedError"  # this host answers (nothing listens there)
    if rejecting:
        machines.cut(None, 2, rejecting=True)
        assert reach(None, m2.ip) == "ConnectionRefusedError"
        assert reach(m0, m2.ip) == reach(m1, m2.ip) == reach(m2, m0.ip) == reach(None, m0.ip) == "reached"


PROBER = ("import sys, time, torch.distributed as d\nfrom datetime import timedelta\n"
          "from megatron_odyssey.runtime.reachability import Prober\n"
          "host, port, ident = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])\n"
          "store = d.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=30))\n"
          "prober = Prober(ident, host, port)\nprint('up', flush=True)\n"
          "while True:\n    try:\n        prober.tick(store)\n    except Exception:\n        pass\n"
          "    time.sleep(0.1)")


@pytest.mark.parametrize("case", ["rejecting firewall", "standby's process gone", "standby's machine gone",
                                  "two machines, machine gone", "two machines, machine gone, witness"])
def test_a_standby_that_refuses_is_taken_for_gone_only_where_it_cannot_hold_half_of_the_ranks(
        routed: RoutedMachines, tmp_path: Path, capsys: pytest.CaptureFixture, case: str) -> None:
    """The agent on this host (rank 0), its standby's store on machine 0 with rank 1, ranks 2 and 3 on machines 1
    and 2 (each a real prober beating to the agent's store, ``runtime.reachability``); "two machines": ranks 0 and 1
    only. The standby's store stops answering with a refusal. A ``rejecting firewall`` between this host and machine
    0 refuses too, while the standby runs on: ranks 2 and 3 still reach its store, so the agent needs a majority
    from then on (``runtime.quorum``). Where the standby's process is gone (rank 1 says it does not reach it), or its
    whole machine (rank 1 answers nothing: 1 of 4 ranks, too few to take the job), it is gone: no quorum, as before.
    In a job of two machines the lost machine's rank is half: without a witness the refusal is taken for the loss
    (said), with one the tie is the witness's."""
    from megatron_odyssey.launch import LocalRank, RemoteRank
    from megatron_odyssey.runtime.agent import Agent
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import Replica
    from megatron_odyssey.runtime.quorum import NoQuorum, Witness
    from megatron_odyssey.runtime.reachability import ADDRESS_KEY
    from megatron_odyssey.testing.processes import start_sleeper

    two = case.startswith("two machines")
    nproc = 2 if two else 4
    m0 = routed.machines[0]
    store_port = free_port()
    store = dist.TCPStore("0.0.0.0", store_port, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    server, address = _store_in(m0)
    rank0 = start_sleeper(120.0)
    probers = []
    try:
        for ident in range(1, nproc):
            machine = routed.machines[ident - 1]
            prober = machine.popen([sys.executable, "-c", PROBER, machine.host_ip, str(store_port), str(ident)],
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, start_new_session=True)
            assert prober.stdout.readline().strip() == b"up"
            probers.append(prober)
        cfg = TrainConfig(nproc=nproc, tp=1, pp=1, layers=4, hidden=32, heads=4, seq=16, global_batch=nproc,
                          micro_batch=1, steps=4)
        procs = {0: LocalRank(rank0), **{i: RemoteRank(store, i) for i in range(1, nproc)}}
        agent = Agent(cfg, None, tmp_path, procs=procs, store=store)
        agent.witness = Witness.create(tmp_path, "agent on machine 0") if case.endswith("witness") else None
        agent.replica = Replica(address, connect_timeout_s=30)
        agent._replicate_state()
        said = [ADDRESS_KEY.format(i) for i in range(1, nproc)]
        deadline = time.monotonic() + 60
        while not store.check(said) and time.monotonic() < deadline:  # (each prober says where it listens)
            time.sleep(0.05)
        assert store.check(said), "a prober never said where it listens"
        if case == "rejecting firewall":
            routed.cut(None, 0, rejecting=True)
        else:
            server.kill()
            server.wait()
            if "machine gone" in case:
                probers[0].kill()
        assert not agent._to_standby(lambda r: r.step({"committed": 0}, {"step": 0}))
        err = capsys.readouterr().err
        assert agent.replica is None and "the standby agent's store stopped answering" in err, err
        if case == "rejecting firewall":
            assert agent.quorum is not None and agent.quorum.references == (frozenset(range(4)),)
            assert "its machine refuses the connection, but ranks [2, 3] reach the standby's store: a firewall " \
                   "between this machine and the standby's may reject the connections while it runs on" in err, err
            agent.quorum.check({0, 2, 3})
            with pytest.raises(NoQuorum, match=r"holds 2 of the job's 4 ranks"):  # (ties: the standby's)
                agent.quorum.check({0, 2})
        elif case == "two machines, machine gone, witness":
            assert agent.quorum is not None and "but ranks [1], half of the job's or more, did not say" in err, err
            agent.quorum.check({0})  # (the tie: this agent claims the witness, which nobody else did)
            assert agent.witness.holder_of(frozenset(range(2))) == "agent on machine 0"
        else:
            assert agent.quorum is None and "its process is gone; going on without a standby" in err, err
            if two:
                assert "with two machines and no --witness-dir, taking it for its processes' loss" in err, err
    finally:
        server.kill()
        rank0.kill()
        for prober in probers:
            prober.kill()


NAME = ("import socket, sys, time\n"
        "for address in sys.argv[1:]:\n"
        "    t = time.monotonic()\n"
        "    name = socket.getnameinfo((address, 1, 0, 0) if ':' in address else (address, 1), 0)[0]\n"
        "    print(address, name, round(time.monotonic() - t, 3))\n")


def test_a_routed_machine_names_every_lab_address_without_dns(routed: RoutedMachines) -> None:
    """Inside the lab's machines DNS cannot be reached, and each reverse lookup cost 5 s: every store connection made
    there (c10d names each peer, in the server's one thread too) waited for it. Each machine's own /etc/hosts names
    the lab's addresses, IPv4-mapped ones too, and the loopback."""
    m0, m1, _ = routed.machines
    addresses = [m1.ip, f"::ffff:{m1.ip}", m0.host_ip, "127.0.0.1", "::ffff:127.0.0.1", "0.0.0.0"]
    said = m0.popen([sys.executable, "-c", NAME, *addresses], stdout=subprocess.PIPE).communicate(timeout=60)[0]
    rows = [line.split() for line in said.decode().splitlines()]
    assert [r[0] for r in rows] == addresses
    assert all(r[1].startswith("odyssey-lab-") or r[1] == "localhost" for r in rows), rows
    assert max(float(r[2]) for r in rows) < 1.0, rows
