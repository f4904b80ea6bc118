"""A name server that answers every query late and knows no name: a machine's resolver on a slow or lossy network,
for measuring what a control store's reverse lookups cost (``benchmarks/bench_store_names.py``).

    python -m megatron_odyssey.testing.slow_dns --at 10.100.1.6 --delay-ms 50

Answers each query with NXDOMAIN ("no such name") ``--delay-ms`` after it came, each in a timer of its own (a real
resolver answers queries side by side); prints "up" once it listens, and, on SIGTERM, the names it answered about
(a JSON list, in order: "2.4.100.10.in-addr.arpa." is a reverse lookup of 10.100.4.2). UDP on port 53 of ``--at``;
needs dnspython (the ``test`` extra).
"""
from __future__ import annotations

import argparse
import json
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


def serve(at: str, delay_s: float) -> None:
    import dns.message
    import dns.rcode

    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind((at, 53))
    answered: list[str] = []
    lock = threading.Lock()

    def answer(query: bytes, peer: tuple[str, int]) -> None:
        asked = dns.message.from_wire(query)
        reply = dns.message.make_response(asked)
        reply.set_rcode(dns.rcode.NXDOMAIN)
        sock.sendto(reply.to_wire(), peer)
        with lock:
            answered.extend(q.name.to_text() for q in asked.question)

    def stop(*_: object) -> None:
        with lock:
            print(json.dumps(answered), flush=True)
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    print("up", flush=True)
    while True:
        query, peer = sock.recvfrom(4096)
        threading.Timer(delay_s, answer, args=(query, peer)).start()


class NameServer:
    """A running :func:`serve` in a machine of the lab; :meth:`stop` ends it and says which names it was asked about
    (the first call; later ones say the same)."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.asked: list[str] | None = None

    def stop(self) -> list[str]:
        if self.asked is None:
            if self.proc.poll() is None:
                self.proc.terminate()
            out = self.proc.communicate(timeout=10)[0].strip().splitlines()
            self.asked = json.loads(out[-1]) if out and out[-1].startswith("[") else []
        return self.asked


def reverse_name(address: str) -> str:
    """The name a reverse lookup of the IPv4 ``address`` asks about."""
    return ".".join(reversed(address.split("."))) + ".in-addr.arpa."


@contextmanager
def slow_names(machine: Any, delay_s: float, named: tuple[str, ...] = ()) -> Iterator[NameServer]:
    """``machine`` (a ``testing.network_namespace.NetworkNamespace``) names addresses through a name server of its own
    that answers ``delay_s`` late and knows no name; its /etc/hosts names the loopback and ``named`` only. Its
    files are put back on the way out."""
    etc = Path(f"/etc/netns/{machine.name}")
    etc.mkdir(parents=True, exist_ok=True)
    hosts = etc / "hosts"
    before = hosts.read_text() if hosts.exists() else None
    hosts.write_text("".join(f"{a} odyssey-named-{k}\n" for k, a in enumerate(named)) +
                     "127.0.0.1 localhost\n::1 localhost\n")
    (etc / "resolv.conf").write_text(f"nameserver {machine.ip}\noptions timeout:5 attempts:2\n")
    proc = machine.popen([sys.executable, "-m", "megatron_odyssey.testing.slow_dns", "--at", machine.ip,
                          "--delay-ms", str(delay_s * 1e3)], stdout=subprocess.PIPE, text=True)
    server = NameServer(proc)
    try:
        if proc.stdout.readline().strip() != "up":
            raise RuntimeError(f"the name server on {machine.ip} did not start")
        yield server
    finally:
        server.stop()
        if before is None:
            hosts.unlink(missing_ok=True)
        else:
            hosts.write_text(before)
        (etc / "resolv.conf").unlink(missing_ok=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--at", required=True, help="the IPv4 address to answer on (port 53)")
    parser.add_argument("--delay-ms", type=float, default=50.0, help="how late each answer comes (default 50)")
    args = parser.parse_args()
    serve(args.at, args.delay_ms / 1e3)


if __name__ == "__main__":
    main()
