"""This process's TCP connections, found through ``/proc/self/fd``: torch's store client and gloo keep their sockets
to themselves, and the two things we must do to one act on the connection, whoever holds a descriptor of it: shut it
(``world.shut_connections``), or bound how long its peer may stay silent (:func:`bound_silence`).

Why the bound: a machine that loses power or its network sends nothing more, not even the reset a killed process's
kernel sends, so a store client's request to it waits for an answer while Linux retransmits (``tcp_retries2``: about
15 minutes); a client waiting in ``get`` for a key sends nothing and waits for ever. With ``TCP_USER_TIMEOUT`` and
keepalive probes, a connection whose peer acknowledges nothing for :func:`silence_bound` (10 s unless
``odyssey-launch --silence-timeout`` says otherwise) is aborted by the kernel, so the
request fails and its caller follows the standby (``control_plane``); a rank's gloo connections are bounded alike,
so a collective with a rank on that machine fails and the rank recovers (nothing else could end it: the agent cannot
kill a process on a machine it cannot reach). A live peer's kernel acknowledges within milliseconds however busy
its processes are, so a slow agent or a rank computing for minutes is never taken for a lost one."""
from __future__ import annotations

import os
import socket
from collections.abc import Iterator

UNACKED_S = 10.0  # a control store's machine that acknowledges nothing for this long is gone (the default)
KEEPALIVE_S = 2  # an idle connection is probed after this long, then this often (the probes go unanswered when gone)
SILENCE_ENV = "ODYSSEY_SILENCE_TIMEOUT_S"  # odyssey-launch --silence-timeout, for the launcher and its ranks
MIN_UNACKED_S = 3.0  # (at least one keepalive probe goes unanswered before a connection is aborted)


def silence_bound() -> float:
    """How long a peer may acknowledge nothing: ``odyssey-launch --silence-timeout`` (its processes' environment),
    else :data:`UNACKED_S`."""
    return float(os.environ.get(SILENCE_ENV, UNACKED_S))


def tcp_connections() -> Iterator[socket.socket]:
    """Each connected TCP socket of this process, as a socket object that does not own its descriptor (its owner
    closes it)."""
    for name in os.listdir("/proc/self/fd") if os.path.isdir("/proc/self/fd") else []:
        try:
            sock = socket.socket(fileno=int(name))
        except (OSError, ValueError):  # not a socket (or closed meanwhile)
            continue
        try:
            if sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM:
                try:
                    sock.getpeername()
                except OSError:  # listening, or not connected
                    continue
                yield sock
        finally:
            sock.detach()  # the descriptor stays open


def route_address(host: str, port: int) -> str:
    """This machine's address on the route to ``host`` (what the machines there can reach it at; a UDP socket's
    connect sends no packet, it only picks the route)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return s.getsockname()[0]
        except OSError:
            return socket.gethostbyname(socket.gethostname())


def open_files_allowed() -> int:
    """Raises this process's soft limit of open files to its hard limit (children started afterwards inherit it) and
    returns the limit. A control store holds a descriptor for each client's connection, a few per rank: past the
    soft limit (commonly 1024) its server resets new connections, and their ranks fail to start with "Connection
    reset by peer" (a store whose process may open 64 files served 50 clients)."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    cap = hard
    if hard == resource.RLIM_INFINITY:  # (Linux caps it at fs.nr_open)
        try:
            with open("/proc/sys/fs/nr_open") as nr_open:
                cap = int(nr_open.read())
        except (OSError, ValueError):
            cap = 1 << 20
    if soft != resource.RLIM_INFINITY and soft < cap:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (cap, hard))
            soft = cap
        except (ValueError, OSError):
            pass
    return cap if soft == resource.RLIM_INFINITY else soft


def _plain(ip: str) -> str:
    return ip.removeprefix("::ffff:")  # an IPv4 peer of an IPv6 socket


def bound_silence(peer: tuple[str, int] | None = None, unacked_s: float | None = None) -> int:
    """Abort this process's connections to ``peer`` (host, port), or all of them (a rank's: its store's and its
    gloo peers'), once their peer has acknowledged nothing for ``unacked_s`` (default :func:`silence_bound`), idle
    ones included (keepalive); returns how many were bounded. Nothing where the platform lacks ``TCP_USER_TIMEOUT``
    (Linux has it)."""
    if not hasattr(socket, "TCP_USER_TIMEOUT"):
        return 0
    unacked_s = silence_bound() if unacked_s is None else unacked_s
    ips = None
    if peer is not None:
        try:
            ips = {_plain(info[4][0]) for info in socket.getaddrinfo(peer[0], peer[1], type=socket.SOCK_STREAM)}
        except OSError:
            return 0
    bounded = 0
    for sock in tcp_connections():
        host, port = sock.getpeername()[:2]
        if ips is not None and (port != peer[1] or _plain(host) not in ips):
            continue
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, int(unacked_s * 1000))
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_S)
            bounded += 1
        except OSError:  # closed meanwhile
            continue
    return bounded


def bound_answers(fds: set[int], answer_s: float) -> int:
    """Make each of these connections' receives fail once nothing arrived for ``answer_s`` (``SO_RCVTIMEO``; torch's
    store client then raises "Socket Timeout"). For a client that only makes requests its store answers at once: a
    stopped process (SIGSTOP, a hung process, a machine paused whole) answers nothing while its kernel still accepts
    and acknowledges, so :func:`bound_silence` never ends such a wait, and a store client's own timeout does not
    bound it either (torch 2.13). Not for a client that waits in the store for a key. Returns how many."""
    import struct

    bounded = 0
    for sock in tcp_connections():
        if sock.fileno() in fds:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, struct.pack("ll", int(answer_s),
                                                                               int(answer_s % 1 * 1e6)))
            bounded += 1
    return bounded


def connection_fds() -> set[int]:
    """The descriptors of this process's TCP connections now (to find the ones a new client opens)."""
    return {sock.fileno() for sock in tcp_connections()}
