"""A second machine on this one, for tests of a machine that goes silent: a Linux network namespace joined to this
one by a veth pair. Taking the pair's link down makes every process in it silent to us, as a machine that lost power
or its network is: no reset, no FIN, the packets are dropped (a SIGKILLed process's kernel closes its connections,
so its peers learn at once; ``faults.kind=kill-machine`` is that kinder loss).

:func:`routed_machines`: several such machines behind a router (a namespace of its own that forwards), so that
the network between two of them can be cut while each still reaches the others (a partition that is not
transitive, as a failed switch port between two racks makes): :meth:`RoutedMachines.cut`, which drops the packets,
or resets every connection as a firewall that rejects does.

:func:`loopback`: a namespace of one loopback for a whole job, its sockets' buffers smaller than a tiny model's
messages where asked.

Needs root and iproute2's ``ip`` (CI's machine has both); :class:`Unavailable` says why not otherwise.
:func:`silent_address` needs neither: one address on the loopback that answers no connection."""
from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from .processes import kill_all


@contextmanager
def silent_address(host: str = "127.0.0.1") -> Iterator[str]:
    """An "ip:port" on this machine whose connections time out, as to a machine gone silent (a firewall that
    rejects would refuse them instead, and a refusal is an answer): a listener that accepts nothing, whose queue of
    one is filled, so Linux drops every further SYN. Needs no root; any 127.x.y.z is this machine's loopback."""
    import socket

    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind((host, 0))
    listener.listen(0)
    address = listener.getsockname()
    fillers = []
    try:
        for _ in range(2):  # (the queue of one, and one SYN that waits for room)
            filler = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            filler.setblocking(False)
            filler.connect_ex(address)
            fillers.append(filler)
        yield f"{address[0]}:{address[1]}"
    finally:
        for sock in (*fillers, listener):
            sock.close()


class Unavailable(RuntimeError):
    """This machine cannot make a network namespace (not root, no ``ip``, or the kernel refuses)."""


@dataclass(frozen=True)
class NetworkNamespace:
    name: str
    link: str  # its end of the veth pair
    ip: str  # its address, reachable from this namespace
    host_link: str  # this namespace's end of the pair
    host_ip: str  # this namespace's address on it, reachable from the namespace

    def popen(self, argv: list[str], **kwargs) -> subprocess.Popen:
        """``argv`` run inside the namespace."""
        return subprocess.Popen(["ip", "netns", "exec", self.name, *argv], **kwargs)

    def cut(self) -> None:
        """The namespace's link goes down: from now on nothing it sends reaches us, nor anything we send it."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.link, "down")

    def mend(self) -> None:
        """The namespace's link comes back up (a network blip ends)."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.link, "up")

    def pids(self) -> list[int]:
        return _pids(self.name)


def _pids(space: str) -> list[int]:
    """The processes running in namespace ``space``."""
    out = subprocess.run(["ip", "netns", "pids", space], capture_output=True, text=True)
    return [int(p) for p in out.stdout.split()]


def _kill_everything_in(space: str) -> None:
    kill_all(_pids(space))


def _can_make_namespaces(what: str) -> None:
    """Unavailable unless this process can make ``what`` (root and iproute2's ``ip``)."""
    if os.geteuid() != 0:
        raise Unavailable(f"needs root ({what})")
    if shutil.which("ip") is None:
        raise Unavailable("needs iproute2's `ip`")


def _write_proc_sys(space: str, values: dict[str, str], unless: str) -> None:
    """Write each of ``values`` (a path under /proc/sys: its value) inside namespace ``space``, whose kernel
    settings of that kind are its own; Unavailable, starting with ``unless``, where it refuses."""
    script = " && ".join(f"echo {value} > /proc/sys/{path}" for path, value in values.items())
    done = subprocess.run(["ip", "netns", "exec", space, "sh", "-c", script], capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"{unless}: {done.stderr.strip()}")


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")


def _in(space: str | None, *argv: str) -> tuple[str, ...]:
    """``ip`` arguments run in ``space`` (None: this namespace)."""
    return ("netns", "exec", space, "ip", *argv) if space else argv


def _joined(a: str | None, a_link: str, a_ip: str, b: str, b_link: str, b_ip: str) -> None:
    """A veth pair between namespace ``a`` (None: this one) and ``b``, each end addressed in one /30 and up."""
    _ip("link", "add", a_link, "type", "veth", "peer", "name", b_link)
    if a:
        _ip("link", "set", a_link, "netns", a)
    _ip("link", "set", b_link, "netns", b)
    for space, link, ip in ((a, a_link, a_ip), (b, b_link, b_ip)):
        _ip(*_in(space, "addr", "add", f"{ip}/30", "dev", link))
        _ip(*_in(space, "link", "set", link, "up"))


def _name_addresses(spaces: list[str], addresses: list[str]) -> None:
    """Each namespace's own /etc/hosts (``ip netns exec`` mounts /etc/netns/NAME/hosts over it) names every address
    of the lab, IPv4-mapped too (c10d's sockets are IPv6), and the loopback: a store names each connection's peer
    (``getnameinfo``), and DNS, which is not reachable from inside, would cost 5 s a name, in the store's one server
    thread too, where a real machine's DNS answers at once."""
    lines = ["127.0.0.1 localhost", "::1 localhost", "::ffff:127.0.0.1 localhost",
             "0.0.0.0 odyssey-lab-any"]  # (a store listening on every interface names it too; glibc names "::" itself)
    for k, address in enumerate(addresses):
        lines += [f"{address} odyssey-lab-{k}", f"::ffff:{address} odyssey-lab-{k}"]
    for space in spaces:
        os.makedirs(f"/etc/netns/{space}", exist_ok=True)
        with open(f"/etc/netns/{space}/hosts", "w") as hosts:
            hosts.write("\n".join(lines) + "\n")


def _unname(spaces: list[str]) -> None:
    for space in spaces:
        shutil.rmtree(f"/etc/netns/{space}", ignore_errors=True)


@contextmanager
def network_namespace() -> Iterator[NetworkNamespace]:
    """A namespace of its own per process (names and a /30 subnet from the pid, so parallel test workers do not
    meet); its processes are SIGKILLed and it is removed on the way out."""
    _can_make_namespaces("a network namespace")
    pid = os.getpid()
    name, host_link, link = f"ody{pid}", f"oh{pid}", f"on{pid}"
    net = f"10.{200 + (pid >> 14) % 50}.{(pid >> 6) & 0xff}.{(pid & 0x3f) << 2}"  # a /30 of its own
    base = [int(x) for x in net.split(".")]
    host_ip, ip = ".".join(map(str, base[:3] + [base[3] + 1])), ".".join(map(str, base[:3] + [base[3] + 2]))
    _ip("netns", "add", name)
    try:
        _joined(None, host_link, host_ip, name, link, ip)
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _name_addresses([name], [host_ip, ip])
        yield NetworkNamespace(name, link, ip, host_link, host_ip)
    finally:
        _unname([name])
        _kill_everything_in(name)
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass(frozen=True)
class Loopback:
    """A network namespace with its loopback alone, where the machines of a test's job run (their processes can be
    stopped whole while their kernel, this one, keeps their connections open). ``buffer_bytes``: its TCP sockets
    get that much send and receive buffer (Linux keeps ``net.ipv4.tcp_wmem``/``tcp_rmem`` per namespace), so that
    a tiny model's messages are as much larger than their sockets' buffers as a real model's are than a real
    machine's (a send to a peer that stopped reading then stops inside gloo, with its message in flight); None: the
    host's."""

    name: str
    buffer_bytes: int | None

    def argv(self, argv: list[str]) -> list[str]:
        """``argv`` run inside the namespace (``ip netns exec`` execs it: the same pid)."""
        return ["ip", "netns", "exec", self.name, *argv]

    def pids(self) -> list[int]:
        return _pids(self.name)


@contextmanager
def loopback(buffer_bytes: int | None = None) -> Iterator[Loopback]:
    """A :class:`Loopback` namespace of this process's own; its processes are SIGKILLed and it is removed on the
    way out."""
    _can_make_namespaces("a network namespace")
    name = f"olb{os.getpid()}"
    _ip("netns", "add", name)
    try:
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        if buffer_bytes is not None:
            sizes = f"{buffer_bytes} {buffer_bytes} {buffer_bytes}"
            _write_proc_sys(name, {"net/ipv4/tcp_rmem": sizes, "net/ipv4/tcp_wmem": sizes},
                            "the namespace's socket buffers cannot be set")
        yield Loopback(name, buffer_bytes)
    finally:
        _kill_everything_in(name)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


@dataclass(frozen=True)
class RoutedMachines:
    """Machines (network namespaces) behind one router namespace, which this namespace (the host, where the tests'
    other machines run) reaches too. Each machine is a :class:`NetworkNamespace` whose ``host_link`` and ``host_ip``
    are this namespace's link and address towards the router (as the machines reach us)."""

    router: str
    machines: tuple[NetworkNamespace, ...]
    subnets: tuple[str, ...]  # the host's /30 first, then each machine's
    ports: tuple[str, ...]  # the router's links, in the same order
    made: list[str]  # every namespace made (removed on the way out), the rejecting cuts' too

    def cut(self, a: int | None, b: int | None, rejecting: bool = False) -> None:
        """From now on nothing between machine ``a`` and machine ``b`` (None: the host) gets through, either way;
        each still reaches every other. The router drops the packets silently, as a failed link does; ``rejecting``:
        every packet between the two is answered with a reset instead, as by a firewall that rejects (a connection
        is refused, an open one reset), from the address it was sent to (:meth:`_rejector`)."""
        for src, dst in ((a, b), (b, a)):
            if rejecting:
                table = str(100 + len(self.made))
                _ip("netns", "exec", self.router, "ip", "route", "add", self._ip_of(dst), "via",
                    self._rejector(self._ip_of(dst)), "table", table)
                _ip("netns", "exec", self.router, "ip", "rule", "add", "iif", self._port(src), "from",
                    self._subnet(src), "to", self._subnet(dst), "lookup", table)
            else:
                _ip("netns", "exec", self.router, "ip", "rule", "add", "from", self._subnet(src), "to",
                    self._subnet(dst), "blackhole")

    def _rejector(self, impersonated: str) -> str:
        """A namespace of its own behind the router that holds ``impersonated`` (another machine's address) and
        listens on nothing, so its kernel resets whatever reaches it, in that machine's name; returns its address
        on its link to the router. (The router cannot answer so itself: it will not send from an address it does
        not hold, and holding it would take the machine's traffic from every other machine too; this machine's
        kernel has no netfilter to reject with.)"""
        k, pid = len(self.made), os.getpid()
        name, router_end, own_end = f"oj{k}x{pid}", f"oj{k}r{pid}", f"oj{k}s{pid}"
        _ip("netns", "add", name)
        self.made.append(name)
        gateway, address = f"192.0.2.{4 * k + 1}", f"192.0.2.{4 * k + 2}"
        _joined(self.router, router_end, gateway, name, own_end, address)
        _ip("netns", "exec", name, "ip", "addr", "add", f"{impersonated}/32", "dev", own_end)
        _ip("netns", "exec", name, "ip", "route", "add", "default", "via", gateway)
        return address

    def _subnet(self, machine: int | None) -> str:
        return self.subnets[0 if machine is None else machine + 1]

    def _port(self, machine: int | None) -> str:
        return self.ports[0 if machine is None else machine + 1]

    def _ip_of(self, machine: int | None) -> str:
        return self.machines[0].host_ip if machine is None else self.machines[machine].ip

    def pids(self) -> list[int]:
        return [p for m in self.machines for p in m.pids()]


@contextmanager
def routed_machines(count: int) -> Iterator[RoutedMachines]:
    """``count`` machines behind a router, each on a /30 of its own (from the pid, so parallel test workers do not
    meet; 10.100-199.x.0/24 holds up to 63); their processes are SIGKILLed and everything removed on the way out."""
    _can_make_namespaces("network namespaces")
    pid = os.getpid()
    net = f"10.{100 + (pid >> 8) % 100}.{pid & 0xff}"
    subnets = tuple(f"{net}.{4 * k}/30" for k in range(count + 1))
    router, host_link, router_host = f"or{pid}", f"oh{pid}", f"ot{pid}"
    host_ip, router_ip = f"{net}.1", f"{net}.2"
    names = [f"om{k}x{pid}" for k in range(count)]
    made: list[str] = []
    try:
        for name in (router, *names):
            _ip("netns", "add", name)
            made.append(name)
            _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        _joined(None, host_link, host_ip, router, router_host, router_ip)
        _ip("route", "add", f"{net}.0/24", "via", router_ip)  # (our own /30 is more specific: stays direct)
        _write_proc_sys(router, {"net/ipv4/ip_forward": "1"}, "the router namespace cannot forward")
        machines, addresses = [], [host_ip, router_ip]
        for k, name in enumerate(names, start=1):
            gateway, ip, link, port = f"{net}.{4 * k + 1}", f"{net}.{4 * k + 2}", f"om{k}l{pid}", f"or{k}p{pid}"
            _joined(router, port, gateway, name, link, ip)
            _ip("netns", "exec", name, "ip", "route", "add", "default", "via", gateway)
            machines.append(NetworkNamespace(name, link, ip, host_link, host_ip))
            addresses += [gateway, ip]
        _name_addresses(made, addresses)
        ports = (router_host, *(f"or{k}p{pid}" for k in range(1, count + 1)))
        yield RoutedMachines(router, tuple(machines), subnets, ports, made)
    finally:
        _unname(made)
        for name in made:
            _kill_everything_in(name)
        subprocess.run(["ip", "route", "del", f"{net}.0/24"], capture_output=True)
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
        for name in made:  # (a namespace's links go with it)
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
