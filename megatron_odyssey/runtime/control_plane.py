"""The control plane's second copy: a standby agent, on another machine, that takes over when the agent's
machine is lost.

Why a standby agent and not a replicated store (etcd): the store is not where the state that matters
lives. Everything a takeover needs (the generation, the layout that holds the state, the last committed
step, the dead and fenced ranks, the failure records) is in the agent's memory, and most store keys
(heartbeats, ready counts, the process-group rendezvous of a generation) are worthless once their agent is
gone. Replicating that state costs one write per committed step; an etcd cluster would cost a server
to install and run on three machines, a client library, and every store operation of every rank going
through consensus, for keys that a new generation throws away anyway. (``torch.distributed.elastic``'s
etcd backend replicates its rendezvous for the same reason we replicate the agent: so that it outlives a
machine.)

How it works:

- **write-ahead** (:class:`Replica`): the agent writes its state into the standby's own store *before*
  each commit and each published plan; so whatever a rank saw from the agent, the standby knows too.
  A commit the standby knows of but no rank saw is applied by the ranks after the takeover (each still
  holds its synchronised gradients); no rank can have applied a step the standby does not know of.
- **watch** (:class:`Standby`): the standby probes the agent's store; when it has been unreachable for
  ``takeover_after_s`` (and, on one machine, the agent's process is gone), it takes over
  (``Agent.take_over``): it seeds its store so that every rank's pending wait ends (the last commit, an
  abort of the generation), announces itself (:data:`TAKEOVER_KEY`), and recovers as after a failure:
  the survivors register, the ranks of a lost machine are found dead by their missing heartbeats, and a
  new generation starts, on the same layout when no rank was lost (new groups, no transfers), else on
  the planner's choice.
- **follow** (:class:`ControlPlane`, a rank's side): a rank whose store operation fails asks whether the
  agent is still there; when the standby has taken over it moves its store client (and its heartbeat) to
  the standby and recovers like after a peer failure.
- **fence without a node agent**: a rank whose launcher died with the agent's machine cannot be killed
  by anyone; after a takeover its heartbeat thread watches its fence key and ends the process itself.

A deposed agent (one that comes back after the standby took over, e.g. from a pause) sees the takeover
on its next write-ahead and leaves without touching the ranks.

A partition (machine 0 cut off but running, or the standby's machine cut off) leaves both agents running, each
with the ranks it reaches: :mod:`.quorum` lets only one side go on.
"""
from __future__ import annotations

import json
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

from .process_probe import is_zombie
from .quorum import GONE, SILENT

STANDBY_KEY = "odyssey/standby"  # in the agent's store: HOST:PORT of the standby's store (launch mode)
TAKEOVER_KEY = "odyssey/takeover"  # in the standby's store: set when it takes over (JSON: generation, committed step,
# reason)
#: the agent went on without its standby (why): in the agent's store, set as it drops it; and in the standby's, set by
#: the standby once it read that there (its copy of the job's state stops there: it must never take the job over)
DISMISSED_KEY = "odyssey/standby/dismissed"
FINISHED_KEY = "odyssey/replica/finished"  # in the standby's store: the agent ended the job (its exit code)
STATE_KEY = "odyssey/replica/state"  # the agent's state of this generation (written at each decision)
AGENT_PID_KEY = "odyssey/replica/agent_pid"  # the agent's pid, said at once (before its slow start-up)
STEP_KEY = "odyssey/replica/step"  # the agent's per-commit state (written ahead of every commit)
# a drop of a slow node the agent decided and waits to carry out, or is fencing (runtime.drop_gate), or null: written
# ahead of the commit that tells the ranks, and at every change (one key: newer than any state or step it joins)
DROP_KEY = "odyssey/replica/drop"
STEP_SLOT = "odyssey/replica/steps/{}"  # the committed steps' records by commit number, a ring the standby reads
SLOTS = 256
DONE_KEY = "odyssey/done/{}"  # a rank finished the job (set before it exits)
#: a rank leaves with a non-zero code the training script chose, not a failure: {"code": ..., "why": ...}
LEAVING_KEY = "odyssey/leaving/{}"
FENCE_KEY = "odyssey/fence/{}"  # the agent asks a rank's node agent to SIGKILL it (or, without one, the rank itself)
PROBE_TIMEOUT_S = 1.0  # a connect or an operation on a store that may be gone
ANNOUNCE_S = 60.0  # how long a standby on the agent's machine waits for the agent it backs to be started
REPLICA_RECONNECT_S = 10.0  # how long a reconnect to the standby's store may take to be accepted


def say_leaving(store: Any, ident: int, code: int, why: str) -> None:
    """Tell the agent, before this rank leaves with ``code``, that the code is the training script's own choice (the
    agent then ends the job with it instead of recovering). Best effort: with the agent gone there is nobody to tell."""
    try:
        store.set(LEAVING_KEY.format(ident), json.dumps({"code": code, "why": why}))
        store.check([LEAVING_KEY.format(ident)])  # a round trip: in the store before the process exits
    except Exception:  # noqa: BLE001 - the agent is gone
        pass


def parse_address(text: str) -> tuple[str, int]:
    host, port = text.rsplit(":", 1)
    return host, int(port)


def client(address: tuple[str, int], timeout_s: float) -> Any:
    """A client of a job's store (the agent's or the standby's) whose requests fail within ``sockets.silence_bound``
    once that machine is gone silent (lost power or network), instead of after Linux's 15 minutes of retransmits:
    every client of a control store is made here."""
    import torch.distributed as dist

    from .sockets import bound_silence

    store = dist.TCPStore(address[0], address[1], is_master=False, timeout=timedelta(seconds=timeout_s))
    bound_silence(address)
    return store


def serve(host: str, port: int, timeout_s: float) -> Any:
    """The server of a job's store (the agent's or the standby's), listening on ``host`` (an IPv4 address; "0.0.0.0":
    every interface) at ``port``: every control store is served from here.

    Why not ``TCPStore(is_master=True)`` alone: c10d then listens on a dual-stack IPv6 socket, so every peer arrives
    as ``::ffff:a.b.c.d``, and the store's one server thread names each new connection with ``getnameinfo``, which
    finds no such address in /etc/hosts and asks DNS. One dropped DNS packet stops that thread for the resolver's
    5 s, and every rank's heartbeat and commit with it (``benchmarks/bench_store_stalls.py``: while 500 new clients
    connected, a live client's operations stopped 9 times for 5.01 s; none with an IPv4 socket). On an IPv4 socket
    peers arrive as ``a.b.c.d``, which /etc/hosts answers for this machine's own ranks. An IPv6 ``host`` keeps c10d's
    own socket."""
    import errno
    import socket

    import torch.distributed as dist

    from .sockets import open_files_allowed

    open_files_allowed()  # (a descriptor per client connection: see store_files_needed)
    kw = dict(is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s))
    if ":" in host:
        return dist.TCPStore(host, port, **kw)
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # (as c10d's own: a restarted agent's port)
        listener.bind((host, port))
        listener.listen(socket.SOMAXCONN)
    except OSError as exc:
        listener.close()
        raise OSError(exc.errno, f"the store cannot listen on {host}:{port}: "
                                 f"{errno.errorcode.get(exc.errno or 0, 'error')} ({exc.strerror})") from exc
    return dist.TCPStore(host, port, master_listen_fd=listener.detach(), **kw)  # (the store owns and closes it)


#: connections a rank holds to a control store: its main thread's, its heartbeat's and its abort watcher's clients
STORE_CLIENTS_PER_RANK = 3
STORE_CLIENTS_PER_MACHINE = 2  # its launcher's (and, on the standby's machine, its node agent's)
OWN_FILES = 64  # the serving process's own: its libraries, pipes, logs


class TooFewFiles(OSError):
    """A machine that serves a control store may not open a descriptor for each connection it will hold."""


def store_files_needed(ranks: int, machines: int, local_ranks: int) -> int:
    """Descriptors the process serving a control store (the agent's or the standby's) needs: one per client
    connection of every rank and machine, a log per rank it starts, and its own."""
    return STORE_CLIENTS_PER_RANK * ranks + STORE_CLIENTS_PER_MACHINE * machines + local_ranks + OWN_FILES


def check_open_files(ranks: int, machines: int, local_ranks: int, role: str) -> None:
    """Raises :class:`TooFewFiles` where this process may not open what serving ``role``'s store needs, even with
    its soft limit raised to the hard one (``sockets.open_files_allowed``): the store would reset the connections
    past it, and those ranks fail to start with "Connection reset by peer", far from the cause."""
    from .sockets import open_files_allowed

    allowed, needed = open_files_allowed(), store_files_needed(ranks, machines, local_ranks)
    if allowed < needed:
        raise TooFewFiles(f"this machine serves {role} store to {ranks} ranks on {machines} machines: about {needed} "
                          f"open files ({STORE_CLIENTS_PER_RANK} connections per rank, {STORE_CLIENTS_PER_MACHINE} per "
                          f"machine, a log per rank started here, {OWN_FILES} of its own), but its processes may open "
                          f"at most {allowed} (the hard limit: ulimit -Hn). Raise it for the job (ulimit -n "
                          f"{max(65536, needed)} in the job's script, a container's --ulimit nofile=65536, or "
                          f"/etc/security/limits.conf); else the store resets the connections past it and those ranks "
                          f"fail to start")


SLOW_NAME_S = 1.0  # a reverse lookup this slow stalls a control store visibly (see serve)
NAMES_WAIT_S = 120.0  # a standby names the ranks' machines once all said where they listen, or this long on


def slow_name(hosts: list[str], limit_s: float = SLOW_NAME_S,
              lookup: Callable[[str], Any] | None = None) -> tuple[str, float] | None:
    """The first of ``hosts`` (addresses) whose reverse lookup took longer than ``limit_s``, and how long; None where
    every one was quick. c10d's store names each new connection's peer this way, in its one server thread (see
    :func:`serve`), so a lookup that slow stops every client of the store for that long. ``lookup``: what to time
    (default ``socket.getnameinfo``, as c10d does)."""
    import socket

    lookup = lookup or (lambda host: socket.getnameinfo((host, 0), 0))
    for host in hosts:
        start = time.monotonic()
        try:
            lookup(host)
        except OSError:  # (no name: it took as long to find out)
            pass
        took = time.monotonic() - start
        if took > limit_s:
            return host, took
    return None


def say_slow_names(addresses: list[str], say: Callable[[str], None], ranks: int,
                   lookup: Callable[[str], Any] | None = None) -> threading.Thread:
    """Times naming the machines of ``addresses`` (the ranks' "ip:port", ``reachability.said_addresses``; each
    machine once, the loopback left out: /etc/hosts names it) with :func:`slow_name`, in a thread of its own (a slow
    lookup stops the thread that makes it), and ``say``s the first slow one, once, with the remedy and its cost: the
    store here names each new connection's peer so, one connection after another, in its one thread (:func:`serve`),
    so the ``ranks``' clients (:data:`STORE_CLIENTS_PER_RANK` each) are all served only after that many lookups
    (``bench_store_names.py``: 300 clients in 16.3 s with a resolver 50 ms late, 1.9 s with /etc/hosts). The thread,
    started."""
    hosts = sorted(h for h in {a.rpartition(":")[0] for a in addresses} if h and not h.startswith("127."))

    def check() -> None:
        slow = slow_name(hosts, lookup=lookup)
        if slow is not None:
            connections = STORE_CLIENTS_PER_RANK * ranks
            say(f"naming machine {slow[0]} by its address (a reverse DNS lookup) took {slow[1]:.1f} s on this "
                f"machine: the job's store names each new connection's peer so, one after another, in its one "
                f"thread, so the {connections} connections of the job's {ranks} ranks take about "
                f"{connections * slow[1]:.0f} s to be served when the job starts (and a rank that reconnects waits "
                f"behind the connections before it). List the job's machines in /etc/hosts on the agent's and the "
                f"standby's machines, or mend their DNS")

    thread = threading.Thread(target=check, daemon=True, name="odyssey-name-check")
    thread.start()
    return thread


def every_interface(address: str) -> str:
    """Where a store that peers reach at ``address`` listens: every interface of its family ("::" for an IPv6
    address, which :func:`serve` leaves to c10d's own listener; a host name is taken for an IPv4 one)."""
    return "::" if ":" in address else "0.0.0.0"


def knock(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> str:
    """How the machine at ``address`` answers a connection: "accepted"; "refused" (nothing listens there: its process
    is gone); or "silent" (no answer within ``timeout_s``, or another error: a machine gone silent gives none)."""
    import socket

    try:
        socket.create_connection(address, timeout=timeout_s).close()
        return "accepted"
    except ConnectionRefusedError:
        return "refused"
    except OSError:
        return "silent"


def client_if_there(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> Any:
    """:func:`client` when the machine at ``address`` accepts a connection now; else ConnectionError at once, saying
    how it answered. For a store that may be gone: a store client would retry a refused or unreachable connection
    for its whole timeout, logging several lines per try (thousands from a loop that waits minutes for it)."""
    answer = knock(address)
    if answer != "accepted":
        raise NotThere(answer, f"{address[0]}:{address[1]} " + ("refuses the connection" if answer == "refused"
                                                                else "does not answer"))
    return client(address, timeout_s)


class Dropped(ConnectionError):
    """The agent does not answer this machine, but the standby's store says that the job dropped every rank of it:
    it is cut off from the agent's machine only, and waiting for it would only keep its ranks for nothing."""


class NoTakeover(ConnectionError):
    """The standby says it will never take over: the agent went on without it (``DISMISSED_KEY``)."""


class NotThere(ConnectionError):
    """A store's machine did not accept a connection; ``answer``: how it answered (:func:`knock`)."""

    def __init__(self, answer: str, message: str):
        super().__init__(message)
        self.answer = answer


def listening(address: tuple[str, int], timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Something accepts connections at ``address``: asked before making a store client, which retries a
    refused connection for its whole timeout (a gone store would cost that long to find out)."""
    return knock(address, timeout_s) == "accepted"


def reachable(store: Any) -> bool:
    """The store answers a round trip (a ``set`` alone would not tell: TCPStore does not wait for its reply)."""
    try:
        store.check([TAKEOVER_KEY])
        return True
    except Exception:  # noqa: BLE001 - any store error means: not reachable now
        return False


# -- the agent's side -----------------------------------------------------------------------------------
class Replica:
    """The agent's write-ahead copy of its state in the standby's store."""

    def __init__(self, address: tuple[str, int], connect_timeout_s: float = 60.0):
        from .sockets import bound_answers, connection_fds, silence_bound

        self.address = address
        before = connection_fds()
        self.store = client(address, connect_timeout_s)  # the standby starts before the agent (or with it)
        # every request of the write-ahead is one a live standby answers at once: none within the silence bound comes
        # from a process that stands still (write_ahead); before, the agent waited for it for ever
        bound_answers(connection_fds() - before, silence_bound())
        self.seq = -1  # commits written (a restart from a checkpoint commits a step number again)

    def state(self, state: dict[str, Any]) -> None:
        """A new generation's state (a decision), before its plan is published."""
        self.store.set(STATE_KEY, json.dumps(state))
        self._round_trip()

    def step(self, step_state: dict[str, Any], record: dict[str, Any]) -> None:
        """Step ``record["step"]`` is about to be committed."""
        self.seq += 1
        slot = STEP_SLOT.format(self.seq % SLOTS)
        self.store.multi_set([STEP_KEY, slot], [json.dumps({**step_state, "seq": self.seq}), json.dumps(record)])
        self._round_trip()

    def drop(self, spec: dict[str, Any] | None) -> None:
        """The drop waiting or being fenced now (``Agent._pending_drop_json``), or None."""
        self.store.set(DROP_KEY, json.dumps(spec))
        self._round_trip()

    def fence(self, key: str, why: str) -> None:
        """A rank on another machine was fenced (``key``: the fence key its node agent watches): said here too, for a
        machine cut off from the agent's only, whose node agent reaches this store alone (``ControlPlane.fences``)."""
        self.store.set(key, why)
        self._round_trip()

    def _round_trip(self) -> None:
        """Make the write durable before the agent acts on it (a set is fire-and-forget), and learn whether
        the standby took over meanwhile (this agent is then deposed)."""
        if self.store.check([TAKEOVER_KEY]):
            raise Deposed(self.store.get(TAKEOVER_KEY).decode())

    def write_ahead(self, write: Callable[["Replica"], None], attempts: int = 3) -> None:
        """``write(self)``, reconnecting after a store error (a broken connection; a standby on a loaded machine
        may take seconds to accept); :class:`ReplicaLost` when every attempt failed. Deposed goes through."""
        first: Exception | None = None
        last: Exception | None = None
        answer = "accepted"
        for attempt in range(attempts):
            try:
                write(self)
                return
            except Deposed:
                raise
            except Exception as exc:  # noqa: BLE001 - a broken connection to the standby's store
                first, last = first or exc, exc
                if "Socket Timeout" in str(exc):
                    # its machine acknowledged the request, its process answered nothing within the silence bound: it
                    # stands still (paused whole, SIGSTOP), and may go on, as a silent machine may. Not asked again:
                    # a new client of a process that stands still waits for ever in torch's constructor
                    answer = "silent"
                    break
                time.sleep(0.2 * (attempt + 1))
                try:  # (a standby that is gone refuses at once)
                    self.store = client_if_there(self.address, REPLICA_RECONNECT_S)
                    answer = "accepted"
                except NotThere as gone:
                    answer, last = gone.answer, gone
                except Exception as again:  # noqa: BLE001
                    last = again
        raise ReplicaLost(f"{type(first).__name__}: {first}; last: {type(last).__name__}: {last}", answer)

    def finish(self, code: int) -> None:
        try:
            self.store.set(FINISHED_KEY, str(code))
            self.store.check([FINISHED_KEY])
        except Exception:  # noqa: BLE001 - the standby's machine is gone: nothing to tell
            pass


class Deposed(RuntimeError):
    """The standby took over from this agent (it was unreachable for too long): this agent must leave."""


class ReplicaLost(RuntimeError):
    """The standby's store kept failing: the agent goes on without a standby. ``answer``: how its machine answered a
    connection last (:func:`knock`): "refused" says its process is gone (or a firewall rejects: ``runtime.quorum``),
    anything else may be a partition."""

    def __init__(self, message: str, answer: str):
        super().__init__(message)
        self.answer = answer


# -- the standby's side ---------------------------------------------------------------------------------
@dataclass
class Dismissed:
    """:meth:`Standby.watch`'s answer where the agent went on without this standby (``DISMISSED_KEY``)."""

    why: str


@dataclass
class Standby:
    """Watches the agent, keeps a copy of its committed steps on this machine, and says when to take over.

    ``store`` is this standby's own store (the agent writes into it); ``agent_address`` the agent's store;
    ``same_machine``: both agents run on this machine, so a live agent process (its pid is in the replicated
    state) is never taken over from, however slowly its store answers; and the agent starts after this standby
    listens, so until its launcher (or the agent itself) says its pid, there is no agent to lose yet: waited for up
    to ``announce_s``.
    """

    store: Any
    agent_address: tuple[str, int]
    steps_path: Path
    takeover_after_s: float = 2.0
    poll_s: float = 0.05
    same_machine: bool = False
    announce_s: float = ANNOUNCE_S
    log: Callable[[str], None] = lambda msg: print(f"[odyssey standby] {msg}", flush=True)
    ranks: int = 0  # the job's ranks, whose machines this standby times naming (0: none; on the agent's machine the
    # agent does, for both)
    name_lookup: Callable[[str], Any] | None = None  # (tests: what say_slow_names times)
    seen: int = -1  # the newest commit (its number) whose record was copied
    lost_since: float | None = None
    last_contact: float = field(default_factory=time.time)
    started: float = field(default_factory=time.time)

    def __post_init__(self) -> None:
        self.steps_path.parent.mkdir(parents=True, exist_ok=True)
        self.steps_path.write_text("")
        self._agent: Any = None
        self.dismissed: str | None = None  # the agent went on without this standby: why (DISMISSED_KEY)
        self.agent_answer = "accepted"  # how the agent's machine last answered a connection (knock)
        self.names_asked = 0.0  # when the agent's store was last asked where the ranks listen (None: names checked)

    def watch(self) -> dict[str, Any] | int | Dismissed:
        """Until the agent ends the job (its exit code) or is lost (the state to take over with), or went on without
        this standby (:class:`Dismissed`): its machine stood still, or a blip outlasted the agent's write-ahead, and
        the agent dropped it. Its copy of the job's state ends there, and the agent writes it nothing more (nor the
        job's end): taking over from it later, at the agent's loss or at the job's end, would resume the job from a
        step long past. It says so in its own store, for the ranks that ask it after a loss of the agent."""
        while True:
            if self.store.check([FINISHED_KEY]):
                self.copy_steps()
                return int(self.store.get(FINISHED_KEY))
            self.copy_steps()
            if self.same_machine and self.store.check([STATE_KEY]) and not self._agent_process_alive():
                self.log("the agent's process is gone")  # exact on one machine: no grace needed
                self.copy_steps()
                return self.snapshot(GONE)
            if self._agent_answers():
                self.lost_since = None
                self.last_contact = time.time()
                if self.dismissed is not None:
                    self.store.set(DISMISSED_KEY, self.dismissed)
                    self.log(f"the agent went on without this standby ({self.dismissed}); its copy of the job's state "
                             f"ends there, so it will not take the job over: this machine's ranks train on, and a "
                             f"loss of the agent's machine now ends the job")
                    return Dismissed(self.dismissed)
                self._check_names()
            else:
                now = time.time()
                if self.lost_since is None:
                    self.lost_since = now
                    self.log(f"the agent's store {self.agent_address[0]}:{self.agent_address[1]} does not answer")
                if now - self.lost_since >= self.takeover_after_s and not self._agent_process_alive():
                    if self.store.check([FINISHED_KEY]):
                        continue
                    if not self.store.check([STATE_KEY]):
                        if self.same_machine and not self.store.check([AGENT_PID_KEY]):
                            # (no agent said yet: it starts once this store listens; before, a standby gave a
                            # starting agent 2 s, and under load left its job to wait 60 s for this store and fail)
                            if now - self.started < self.announce_s:
                                time.sleep(self.poll_s)
                                continue
                            self.log(f"no agent was started within {self.announce_s:g} s: nothing to back up")
                            return 1
                        self.log("the agent was lost before it started the job: nothing to take over")
                        return 1
                    self.copy_steps()
                    # refused: its process is gone (or a firewall rejects); silent: it may run on, cut off from us
                    return self.snapshot(GONE if self.agent_answer == "refused" else SILENT)
            time.sleep(self.poll_s)

    def _agent_answers(self) -> bool:
        try:
            if self._agent is None:
                self._agent = client_if_there(self.agent_address)
            if self._agent.check([DISMISSED_KEY]):  # (the round trip that says the agent answers)
                self.dismissed = self._agent.get(DISMISSED_KEY).decode(errors="replace")
            self.agent_answer = "accepted"
            return True
        except NotThere as gone:  # (the knock says how: the takeover needs it, and knocking again costs up to 1 s)
            self.agent_answer = gone.answer
        except Exception:  # noqa: BLE001 - a broken connection: the next probe knocks
            self.agent_answer = "silent"
        self._agent = None
        return False

    def _check_names(self) -> None:
        """Once, when every rank said in the agent's store where it listens (or ``NAMES_WAIT_S`` on, those that did):
        times naming their machines on this machine (:func:`say_slow_names`). This standby's store names them too, at
        their connections (each rank holds its clients from the start, ``ControlPlane.ready``) and at a takeover,
        and this machine's resolver is not the agent's. Asked at most once a second."""
        from .reachability import ADDRESS_KEY, said_addresses

        if not self.ranks or self.names_asked is None or time.time() - self.names_asked < 1.0:
            return
        self.names_asked = time.time()
        try:  # (every rank's key in one round trip, while it waits for them all)
            if not self._agent.check([ADDRESS_KEY.format(i) for i in range(self.ranks)]) and \
                    time.time() - self.started < NAMES_WAIT_S:
                return
            addresses = said_addresses(self._agent, list(range(self.ranks)))
        except Exception:  # noqa: BLE001 - a broken connection: the next probe knocks, and this is asked again
            return
        self.names_asked = None
        say_slow_names(list(addresses.values()), self.log, self.ranks, self.name_lookup)

    def _agent_process_alive(self) -> bool:
        """On one machine: whether the agent's process lives (its pid from its state, or, while it is still
        starting up, imports and forks its ranks before its store exists, from its first word)."""
        if not self.same_machine:
            return False
        if self.store.check([STATE_KEY]):
            pid = int(json.loads(self.store.get(STATE_KEY))["agent_pid"])
        elif self.store.check([AGENT_PID_KEY]):
            pid = int(self.store.get(AGENT_PID_KEY))
        else:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return not is_zombie(pid)

    def copy_steps(self) -> None:
        """Committed steps' records the agent wrote ahead, onto this machine's disk."""
        if not self.store.check([STEP_KEY]):
            return
        newest = int(json.loads(self.store.get(STEP_KEY))["seq"])
        first = max(self.seen + 1, newest - SLOTS + 1)
        if newest < first:
            return
        records = self.store.multi_get([STEP_SLOT.format(s % SLOTS) for s in range(first, newest + 1)])
        with self.steps_path.open("a") as f:
            for value in records:
                f.write(value.decode() + "\n")
        self.seen = newest

    def snapshot(self, lost_as: str = GONE) -> dict[str, Any]:
        """The state to take over with; ``lost_as``: how the agent was lost (``runtime.quorum``: from a silent one
        the takeover needs half of the job's ranks)."""
        state = json.loads(self.store.get(STATE_KEY)) if self.store.check([STATE_KEY]) else {}
        step = json.loads(self.store.get(STEP_KEY)) if self.store.check([STEP_KEY]) else {}
        if step.get("generation") == state.get("gen"):
            state.update(step)  # the newest commit of the newest generation
        if self.store.check([DROP_KEY]):
            state["pending_drop"] = json.loads(self.store.get(DROP_KEY))
        state["lost_agent_s"] = time.time() - self.last_contact
        state["lost_as"] = lost_as
        return state


def free_port() -> int:
    """A TCP port free on this machine now (for a store or a private world about to be started)."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PidRank:
    """A rank on this machine that another process started (the lost agent forked it): seen by its pid.
    Its exit status went to its parent, which is gone: a rank that said it finished (``DONE_KEY``) exited 0,
    any other exit is taken as a failure."""

    def __init__(self, pid: int, store: Any, ident: int):
        self.pid, self.store, self.ident = pid, store, ident
        self.code: int | None = None

    @property
    def exitcode(self) -> int | None:
        if self.code is None:
            try:
                os.kill(self.pid, 0)
                gone = is_zombie(self.pid)
            except ProcessLookupError:
                gone = True
            except PermissionError:
                gone = False
            if gone:
                self.code = 0 if self.store.check([DONE_KEY.format(self.ident)]) else -9
        return self.code

    def kill(self) -> None:
        try:
            os.kill(self.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass

    def join(self, timeout: float | None = None) -> None:
        deadline = time.monotonic() + (timeout or 0)
        while self.exitcode is None and time.monotonic() < deadline:
            time.sleep(0.01)


class OrphanRank:
    """A rank on the lost machine whose launcher is gone with it: nobody reports its exit and nobody can
    kill it. The agent finds it dead by its heartbeat; asked to fence it, it sets the rank's fence key,
    which the rank's heartbeat thread obeys (:meth:`ControlPlane.fenced`; ``joined_pid``: a rank that joined the
    running job obeys its own process's key). A rank that finished the job says so (``DONE_KEY``) before it exits."""

    def __init__(self, store: Any, ident: int, joined_pid: int | None = None):
        self.store, self.ident, self.code = store, ident, None
        self.fence_key = rank_fence_key(ident, joined_pid)

    @property
    def exitcode(self) -> int | None:
        if self.code is None and self.store.check([DONE_KEY.format(self.ident)]):
            self.code = 0
        return self.code

    def kill(self) -> None:
        self.store.set(self.fence_key, "1")
        self.code = -9  # given up on: whatever it does now, it is not in the next generation

    def join(self, timeout: float | None = None) -> None:
        pass


# -- a rank's side ------------------------------------------------------------------------------------
def answering(address: tuple[str, int]) -> Any | None:
    """A new client of the store at ``address`` if it answers now, else None."""
    return ask(address)[0]


def ask(address: tuple[str, int]) -> tuple[Any | None, str]:
    """As :func:`answering`, with how the store's machine answered the knock (:func:`knock`; "accepted" where the
    machine took the connection but the store did not answer)."""
    try:
        fresh = client_if_there(address)
    except NotThere as gone:
        return None, gone.answer
    except Exception:  # noqa: BLE001 - not there (now)
        return None, "accepted"
    return (fresh if reachable(fresh) else None), "accepted"


def judged_lost_after(heartbeat_timeout_s: float) -> float:
    """Seconds after which the job has dropped the ranks of a machine it does not hear from: every request to that
    machine fails within the silence bound (``sockets``), and its ranks' heartbeats are missed for at most twice
    their timeout (the agent's grace). The job's machines judge one another by these; a launcher or rank that has
    reached neither agent for this long is not waited for (:meth:`ControlPlane.follow`)."""
    from .sockets import silence_bound

    return silence_bound() + 2 * heartbeat_timeout_s


def rank_fence_key(ident: int, joined_pid: int | None = None) -> str:
    """The key that fences rank ``ident``'s process: its rank's, or, for the process ``joined_pid`` that joined the
    running job, its own, not its rank's earlier life's (which the agent may set, late, while the replacement is
    already up, and writes into the standby's store too)."""
    return FENCE_KEY.format(ident if joined_pid is None else f"{ident}.{joined_pid}")


@dataclass
class Followed:
    """Where to go on after a store error (:meth:`ControlPlane.follow`)."""

    store: Any
    took_over: bool  # the standby's store (it took the job over); else the same agent's, on a new connection


class ControlPlane:
    """Where a rank's agent is: its store, and the standby that takes over when it is lost."""

    def __init__(self, primary: tuple[str, int], standby: tuple[str, int] | None, ident: int,
                 wait_s: float = 120.0, lost_after_s: float | None = None, joined_pid: int | None = None):
        self.current, self.standby, self.ident, self.wait_s = primary, standby, ident, wait_s
        #: the key whose setting tells this rank to leave after a takeover (``joined_pid``: this process joined the
        #: running job, and obeys its own key, not its rank's earlier life's)
        self.fence_key = rank_fence_key(ident, joined_pid)
        self.lost_after_s = lost_after_s  # the job has dropped a machine that heard nobody this long (judged_lost_after)
        self.moved = False  # the standby took over: fence keys are watched from now on
        self.lock = threading.Lock()
        self.asking = threading.local()  # each thread's client of the standby's store while it asks (not shared)
        #: the clients :meth:`ready` is making, by the thread they are for (None: on its way)
        self.arriving: dict[int, Any] = {}
        #: a machine's node agent: its ranks' fence keys. The agent says each fence in the standby's store too
        #: (``Replica.fence``), so a machine that reaches only the standby learns there that the job dropped it
        self.fences: dict[int, str] = {}

    @classmethod
    def from_env(cls, primary: tuple[str, int], ident: int, store: Any, wait_s: float,
                 lost_after_s: float | None = None, joined_pid: int | None = None) -> "ControlPlane":
        """Launch mode: the standby (machine 1's launcher) registers its address in the agent's store
        while the ranks start; a job on more than one machine waits for it (``ODYSSEY_STANDBY=expected``)."""
        standby = None
        if os.environ.get("ODYSSEY_STANDBY") == "expected":
            from .generation import wait_key

            standby = parse_address(wait_key(store, STANDBY_KEY, "the standby agent's address", wait_s).decode())
        return cls(primary, standby, ident, wait_s, lost_after_s, joined_pid)

    def ready(self) -> None:
        """Gives the calling thread a client of the standby's store, for a takeover (each thread that may follow one
        calls it at its start): a takeover then opens no connection from it. Each new connection costs the standby's
        one store thread a reverse lookup of its peer (see :func:`serve`), and at a takeover every thread of every
        rank would connect at once, on the job's way back. Made in a thread of its own, while the calling thread goes
        on: at the job's start the standby's store serves every rank's connections (and knocks) one lookup after
        another, so a new client waits its turn, however short its timeout (eight threads at once behind a resolver
        0.4 s late: 10-12 s each), and a heartbeat thread that waited so at its start did not beat. The caller holds
        it from its first ask after it arrived (:meth:`_held`). Nothing where the standby does not answer now (it is
        asked afresh when needed)."""
        owner = threading.get_ident()
        with self.lock:
            if self.standby is None or owner in self.arriving or getattr(self.asking, "standby", None) is not None:
                return
            self.arriving[owner] = None

        def connect() -> None:
            try:
                fresh = client_if_there(self.standby)
            except Exception:  # noqa: BLE001 - not there now
                fresh = None
            with self.lock:
                if fresh is None:
                    self.arriving.pop(owner, None)
                elif owner in self.arriving:
                    self.arriving[owner] = fresh

        threading.Thread(target=connect, daemon=True, name="odyssey-standby-client").start()

    def _held(self) -> Any | None:
        """The calling thread's client of the standby's store: the one it last asked with, else the one :meth:`ready`
        made for it, once it arrived (one that arrives after the thread made its own is let go)."""
        held = getattr(self.asking, "standby", None)
        with self.lock:
            arrived = self.arriving.get(threading.get_ident())
            if arrived is not None or held is not None:
                self.arriving.pop(threading.get_ident(), None)
        if held is None and arrived is not None:
            self.asking.standby = held = arrived
        return held

    def connect(self, timeout_s: float = PROBE_TIMEOUT_S) -> Any:
        """A client of the store the job's agent answers on now (for a rank's background threads); after a takeover,
        the thread's own client of the standby's store where it holds one (:meth:`ready`)."""
        if self.moved:  # (the standby's store is the current one: asked once, held client first, else a new one)
            held = self._standby_took_over()
            return held if held is not None else client_if_there(self.current, timeout_s)  # (raises: how it answered)
        try:
            return client_if_there(self.current, timeout_s)
        except Exception:
            moved = self._standby_took_over()
            if moved is None:
                raise
            return moved

    def follow(self, store: Any) -> Followed | None:
        """After an error: None when ``store`` still answers (the error was not its connection's); else the store
        to go on with: the standby's once it has taken over, or the same agent's on a new connection (the last one
        broke: a network blip outlasted ``sockets.silence_bound``, and a broken client is never used again). Raises
        ConnectionError when the agent stays lost and no standby takes over within ``wait_s``; sooner where nobody
        can answer again (:meth:`_give_up_on_both`); and, without a standby, as soon as the agent's machine refuses
        the connection (its process is gone)."""
        if reachable(store):
            return None
        deadline = time.monotonic() + self.wait_s
        if self.standby is None:  # the same agent again after a blip, or nobody
            while time.monotonic() < deadline:
                fresh, answer = ask(self.current)
                if fresh is not None:
                    return Followed(fresh, took_over=False)
                if answer == "refused":  # (its process is gone: it will not answer again)
                    break
                time.sleep(0.1)
            raise ConnectionError(f"the agent's store {self.current[0]}:{self.current[1]} is gone and this job has "
                                  f"no standby agent")
        unanswered_since: float | None = None  # neither machine has accepted a connection since then
        while time.monotonic() < deadline:
            if self.current == self.standby and self.moved:  # a thread of ours moved already
                held = self._standby_took_over()  # (this thread's own client of it, if it holds one)
                return Followed(held or client(self.current, PROBE_TIMEOUT_S), took_over=True)
            moved, standby_answer = self._ask_the_standby()
            if moved is not None:
                return Followed(moved, took_over=True)
            fresh, agent_answer = ask(self.current)
            if fresh is not None:
                return Followed(fresh, took_over=False)
            if "accepted" in (agent_answer, standby_answer):
                unanswered_since = None  # (the standby is up and may yet take over; or the agent's machine is up)
            else:
                unanswered_since = unanswered_since or time.monotonic()
                self._give_up_on_both(agent_answer, standby_answer, time.monotonic() - unanswered_since)
            time.sleep(0.1)
        raise ConnectionError(f"the agent's store {self.current[0]}:{self.current[1]} is gone and the standby "
                              f"{self.standby[0]}:{self.standby[1]} did not take over within {self.wait_s:.0f} s")

    def _give_up_on_both(self, agent_answer: str, standby_answer: str, unanswered_s: float) -> None:
        """Raises ConnectionError once neither the agent's machine nor the standby's can answer again: both refuse
        (their processes are gone), or neither has accepted a connection for ``lost_after_s``, by when the job has
        dropped this machine's ranks (it is cut off, or both machines are lost). Until then a blip may end, and
        the standby may take over; waiting out ``wait_s`` for machines this one cannot reach would only keep its
        ranks waiting for nothing."""
        both_gone = agent_answer == standby_answer == "refused"
        if not both_gone and (self.lost_after_s is None or unanswered_s < self.lost_after_s):
            return
        agent, standby = (f"{host}:{port}" for host, port in (self.current, self.standby))
        if both_gone:
            raise ConnectionError(f"the agent's store {agent} and the standby's {standby} both refuse the connection "
                                  f"(both processes are gone)")
        raise ConnectionError(f"neither the agent's store {agent} nor the standby's {standby} has answered for "
                              f"{unanswered_s:.0f} s, by when the job has dropped this machine's ranks (this machine "
                              f"is cut off from both, or both machines are lost)")

    def _standby_took_over(self) -> Any | None:
        return self._ask_the_standby()[0]

    def _ask_the_standby(self) -> tuple[Any | None, str]:
        """The standby's store once it has taken over (else None), and how its machine answered (:func:`knock`)."""
        if self.standby is None:
            return None, "refused"
        # one client per thread, held from start-up (ready) or while it asks (every 0.1 s until the takeover): a new
        # client per ask costs a reverse lookup in c10d, and many of them a DNS packet dropped, 5 s of this thread
        # (see serve). A held client that broke meanwhile is replaced at once
        attempts = ("held", "new") if self._held() is not None else ("new",)
        for attempt in attempts:
            try:
                if attempt == "new":
                    self.asking.standby = client_if_there(self.standby)
                standby = self.asking.standby
                if not standby.check([TAKEOVER_KEY]):
                    self._dropped(standby)
                    self._dismissed(standby)
                    return None, "accepted"
                break
            except NotThere as gone:  # the standby is not there either (yet)
                return None, gone.answer
            except (Dropped, NoTakeover):
                raise
            except Exception:  # noqa: BLE001 - its machine accepted, its store did not answer (yet); or held broke
                self.asking.standby = None
                if attempt == "new":
                    return None, "accepted"
        self.asking.standby = None  # (it is the caller's store now)
        with self.lock:
            if self.current != self.standby:
                print(f"[odyssey rank {self.ident}] the agent is lost; the standby agent at "
                      f"{self.standby[0]}:{self.standby[1]} took over", file=sys.stderr, flush=True)
            self.current, self.moved = self.standby, True
        return standby, "accepted"

    def _dropped(self, standby: Any) -> None:
        """Raises :class:`Dropped` where the agent fenced every rank of this machine (said in the standby's store)."""
        keys = list(self.fences.values())
        if not keys or not standby.check(keys):
            return
        first = min(self.fences)
        why = standby.get(self.fences[first]).decode(errors="replace")
        raise Dropped(f"the agent's store {self.current[0]}:{self.current[1]} does not answer this machine, and the "
                      f"standby's store {self.standby[0]}:{self.standby[1]} says that the agent fenced its ranks "
                      f"{sorted(self.fences)} (rank {first} {why}): this machine is cut off from the "
                      f"agent's, and the job goes on without it")

    def _dismissed(self, standby: Any) -> None:
        """Raises :class:`NoTakeover` where the standby says the agent went on without it (``DISMISSED_KEY``): it will
        never take over, so a rank that lost the agent need not wait for it. (Asked only while the agent does not
        answer.)"""
        if standby.check([DISMISSED_KEY]):
            why = standby.get(DISMISSED_KEY).decode(errors="replace")
            raise NoTakeover(f"the agent's store {self.current[0]}:{self.current[1]} does not answer, and the "
                             f"standby at {self.standby[0]}:{self.standby[1]} will not take over: the agent had "
                             f"gone on without it ({why}), so its copy of the job's state is out of date; the "
                             f"job stops (relaunch it from its last checkpoint)")

    def fenced(self, store: Any) -> bool:
        """After a takeover: the agent asked this rank (whose launcher may be gone) to leave."""
        return self.moved and store.check([self.fence_key])


def stale_takeover(store: Any, generation: int, committed: int) -> str | None:
    """Why the standby that took over (``store``: its store, ``TAKEOVER_KEY`` set) holds an older state than a rank
    that saw ``generation`` and the commit of step ``committed``, or None. The agent writes ahead to its standby
    before each plan and each commit, so a standby it kept holds at least what any rank saw: an older one was
    dropped by the agent and took over before it could read that (its machine came back as the agent's was lost).
    Going on from it would train steps the ranks already applied."""
    said = json.loads(store.get(TAKEOVER_KEY))
    theirs = (int(said.get("generation", -1)), int(said.get("committed", -1)))
    if theirs >= (generation, committed) or ("committed" not in said and theirs[0] >= generation):
        return None
    return (f"the standby agent took over from a copy of the job's state older than this rank's (generation "
            f"{theirs[0]}, step {theirs[1]} committed, against generation {generation}, step {committed}): the agent "
            f"had gone on without it, so the job cannot go on from it; the job stops (relaunch it from its last "
            f"checkpoint)")
