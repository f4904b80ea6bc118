"""A second machine on this one, for tests of a machine that goes silent: a Linux network namespace joined to this
one by a veth pair. Taking the pair's link down makes every process in it silent to us, as a machine that lost power
or its network is: no reset, no FIN, the packets are dropped (a SIGKILLed process's kernel closes its connections,
so its peers learn at once; ``faults.kind=kill-machine`` is that kinder loss).

Needs root and iproute2's ``ip`` (CI's machine has both); :class:`Unavailable` says why not otherwise."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


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
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]


def _ip(*argv: str) -> None:
    done = subprocess.run(["ip", *argv], capture_output=True, text=True)
    if done.returncode != 0:
        raise Unavailable(f"`ip {' '.join(argv)}` failed: {done.stderr.strip()}")


@contextmanager
def network_namespace() -> Iterator[NetworkNamespace]:
    """A namespace of its own per process (names and a /30 subnet from the pid, so parallel test workers do not
    meet); its processes are SIGKILLed and it is removed on the way out."""
    if os.geteuid() != 0:
        raise Unavailable("needs root (a network namespace)")
    if shutil.which("ip") is None:
        raise Unavailable("needs iproute2's `ip`")
    pid = os.getpid()
    name, host_link, link = f"ody{pid}", f"oh{pid}", f"on{pid}"
    net = f"10.{200 + (pid >> 14) % 50}.{(pid >> 6) & 0xff}.{(pid & 0x3f) << 2}"  # a /30 of its own
    base = [int(x) for x in net.split(".")]
    host_ip, ip = ".".join(map(str, base[:3] + [base[3] + 1])), ".".join(map(str, base[:3] + [base[3] + 2]))
    _ip("netns", "add", name)
    try:
        _ip("link", "add", host_link, "type", "veth", "peer", "name", link)
        _ip("link", "set", link, "netns", name)
        _ip("addr", "add", f"{host_ip}/30", "dev", host_link)
        _ip("link", "set", host_link, "up")
        _ip("netns", "exec", name, "ip", "addr", "add", f"{ip}/30", "dev", link)
        _ip("netns", "exec", name, "ip", "link", "set", link, "up")
        _ip("netns", "exec", name, "ip", "link", "set", "lo", "up")
        yield NetworkNamespace(name, link, ip, host_link, host_ip)
    finally:
        space = NetworkNamespace(name, link, ip, host_link, host_ip)
        for p in space.pids():
            try:
                os.kill(p, signal.SIGKILL)
            except ProcessLookupError:
                pass
        subprocess.run(["ip", "link", "del", host_link], capture_output=True)
        subprocess.run(["ip", "netns", "del", name], capture_output=True)
