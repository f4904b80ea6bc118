"""Which ranks still reach each other, asked when ranks stop together and nothing tells which one is at fault.

A network can fail between two machines while each still reaches the others (a failed link or switch port between
two racks: a partition that is not transitive). Their ranks then stop inside a collective together, each waiting in
communication on the other (``progress_judge``: the first to stop is only a guess), or each takes the other's
silence for a failure and waits for a recovery that no failure called for (``Agent._left_waiting``: before, the job
stopped). Either way the agent asks which machines reach each other, and keeps the largest set of ranks whose
machines all reach each other (a maximum clique of the graph of mutual reach, networkx, each machine weighed by its
ranks); the rest are fenced and recovered from as failures. Where every machine reaches every other, the rounds' old
rules stand.

Machines, not ranks: the ranks of one machine share its network path, so one rank per machine probes one address
per other machine: M x (M - 1) connections a round instead of N x (N - 1) for N ranks on M machines, and a round in a
partition waits out a probe's timeout for each unreached machine, not for each of its ranks (``PROBE_THREADS`` at
once). A machine is the address its ranks reach the agent's store from (said in the store, :data:`ADDRESS_KEY`, with
the port of each rank's listener). A connection that is accepted reached the machine; one that times out or finds no
route did not. A refused one is no proof either way: the rank listening there may be gone while its machine's path
works, or a firewall between the two machines may reject (reset) what it does not let through. So where the rank
probed refuses, the machine's other ranks' listeners are tried in turn, and the machine counts as reached only when
one of them accepts (a machine whose every rank is gone does not answer the round, and so is neither kept nor cut by
it). A machine whose rank asked does not answer is asked again through its next rank (``Agent._reach_round``).
The ranks' side: each listens on a port of its own; its heartbeat thread, which runs while the main thread is
stuck in a collective, answers a round (:class:`Prober`). A probe is a TCP connection opened and closed: it tests the
path between the two machines' addresses, not a device fabric (NCCL over InfiniBand takes another path), with a bound
of :data:`PROBE_TIMEOUT_S`.
"""
from __future__ import annotations

import json
import os
import socket
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from .sockets import route_address

ADDRESS_KEY = "odyssey/reach_at/{}"  # rank -> "ip:port" of its listener
ASK_KEY = "odyssey/reach/ask"  # JSON {"round": id, "ranks": [...], "machines": [[machine, [address, ...]], ...]}:
# each of those ranks probes the machines but its own (each through its ranks' listeners, in that order)
ANSWER_KEY = "odyssey/reach/{}/{}"  # (round, rank) -> JSON list of the machines it reached
TARGET = -1  # a round's one target that is no machine: the standby's store (``Agent._standby_may_live``)
PROBE_TIMEOUT_S = 2.0
PROBE_THREADS = 32


class Listener(threading.Thread):
    """Accepts probes (and closes them at once) for as long as the process lives."""

    def __init__(self) -> None:
        super().__init__(daemon=True, name="odyssey-reach-listener")
        self.sock = socket.create_server(("0.0.0.0", 0))
        self.port = self.sock.getsockname()[1]
        # a forked child (Megatron's data-loader workers) must not keep it listening: a fenced rank would still seem
        # reachable while a child of it lingers
        os.register_at_fork(after_in_child=self.sock.close)

    def run(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
                conn.close()
            except OSError:
                return

    def close(self) -> None:
        """Stop listening (a shutdown first: a close alone leaves the socket listening while accept waits on it)."""
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def probe(machines: dict[int, list[str]], timeout_s: float = PROBE_TIMEOUT_S) -> list[int]:
    """The machines of ``machines`` (a machine -> the "ip:port" of its ranks' listeners, in the order to try them)
    that accepted a connection within ``timeout_s``. A refusal tries the machine's next listener (that
    rank may be gone, or a firewall rejects); a timeout or no route ends the machine's probe (its path fails)."""
    def reaches(item: tuple[int, list[str]]) -> int | None:
        machine, addresses = item
        for address in addresses:
            host, _, port = address.rpartition(":")
            try:
                socket.create_connection((host, int(port)), timeout=timeout_s).close()
                return machine
            except ConnectionRefusedError:
                continue
            except (OSError, ValueError):  # (timed out, unroutable; a malformed address)
                return None
        return None

    if not machines:
        return []
    with ThreadPoolExecutor(min(PROBE_THREADS, len(machines))) as pool:
        return sorted(m for m in pool.map(reaches, sorted(machines.items())) if m is not None)


class Prober:
    """A rank's side, driven by its heartbeat thread: says its listener's address to each store it beats to, and
    answers each round the agent asks it for (for its machine: it probes each other machine, through the listeners
    of that machine's ranks, ``probe``). The probes run in a thread of their own (the beats go on meanwhile); the
    heartbeat thread writes the answer at its next beat (a store client is not shared between threads)."""

    def __init__(self, ident: int, store_host: str, store_port: int):
        self.ident = ident
        self.listener = Listener()
        self.listener.start()
        self.address = f"{route_address(store_host, store_port)}:{self.listener.port}"
        self.said_to: Any = None
        self.answered: Any = None  # the last round answered
        self.running: tuple[str, threading.Thread, list[list[int]]] | None = None

    def tick(self, store: Any) -> None:
        if store is not self.said_to:  # (a new connection: the standby's store after a takeover)
            store.set(ADDRESS_KEY.format(self.ident), self.address)
            self.said_to = store
        if self.running is not None and not self.running[1].is_alive():
            key, _, result = self.running
            store.set(key, json.dumps(result[0] if result else []))
            self.running = None
        if self.running is not None or not store.check([ASK_KEY]):
            return
        ask = json.loads(store.get(ASK_KEY))
        if ask["round"] == self.answered or self.ident not in ask["ranks"]:
            return
        self.answered = ask["round"]
        targets = {machine: addresses for machine, addresses in ask["machines"] if self.address not in addresses}
        result: list[list[int]] = []
        thread = threading.Thread(target=lambda: result.append(probe(targets)), daemon=True,
                                  name="odyssey-reach-probe")
        thread.start()
        self.running = (ANSWER_KEY.format(ask["round"], self.ident), thread, result)


def said_addresses(store: Any, ranks: list[int]) -> dict[int, str]:
    """Where each of ``ranks`` that said so in ``store`` listens for probes ("ip:port", :class:`Prober`): its
    machine's address on the route to the agent's store."""
    said = [i for i in ranks if store.check([ADDRESS_KEY.format(i)])]
    values = store.multi_get([ADDRESS_KEY.format(i) for i in said]) if said else []
    return {i: v.decode() for i, v in zip(said, values)}


def machines(addresses: dict[int, str]) -> dict[int, list[int]]:
    """The ranks of ``addresses`` (rank -> "ip:port" of its listener) by machine: its first rank -> its ranks. A
    machine is an address its ranks reach the agent from."""
    by_host: dict[str, list[int]] = {}
    for rank in sorted(addresses):
        by_host.setdefault(addresses[rank].rpartition(":")[0], []).append(rank)
    return {ranks[0]: ranks for ranks in by_host.values()}


def kept(reach: dict[int, set[int]], members: dict[int, list[int]] | None = None) -> list[int]:
    """The largest set of machines that all reach each other both ways, from each answering machine's reached peers
    (machines that did not answer are left out). ``members``: each machine's ranks (default: a machine is one rank);
    the largest set has the most ranks, ties go to the one with the lowest ranks."""
    import networkx as nx

    members = members or {m: [m] for m in reach}
    graph = nx.Graph()
    graph.add_nodes_from(reach)
    graph.add_edges_from((a, b) for a, peers in reach.items() for b in peers if b in reach and a in reach[b])

    def ranks(clique: list[int]) -> list[int]:
        return sorted(r for m in clique for r in members[m])

    cliques = [sorted(c) for c in nx.find_cliques(graph)]
    return min(cliques, key=lambda c: (-len(ranks(c)), ranks(c))) if cliques else []


def complete(reach: dict[int, set[int]]) -> bool:
    """Every answering machine reaches every other both ways."""
    return all(b in reach[a] for a in reach for b in reach if a != b)
