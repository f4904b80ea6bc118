"""A control store names each new connection's peer on its own machine before it serves it (c10d's server thread;
``runtime.control_plane.serve``): where that machine's resolver is slow, every new connection waits for it, and where
/etc/hosts names the peer's machine, the resolver is never asked. The premise of the agent's and the standby's
slow-name line and its remedy (``control_plane.say_slow_names``), and of ``benchmarks/bench_store_names.py``. Two
machines behind a router (network namespaces: root and iproute2), a real store, a real name server that answers late
(``testing.slow_dns``)."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from megatron_odyssey.runtime.control_plane import free_port
from megatron_odyssey.testing.network_namespace import Unavailable, routed_machines
from megatron_odyssey.testing.slow_dns import reverse_name, slow_names

DELAY_S = 0.4
SERVER = ("import sys, time; from megatron_odyssey.runtime.control_plane import serve; "
          "s = serve('0.0.0.0', int(sys.argv[1]), 60); print('up', flush=True); time.sleep(600)")
CLIENTS = ("import json, sys, time; from megatron_odyssey.runtime.control_plane import client\n"
           "took = []\n"
           "for _ in range(4):\n"
           "    t = time.monotonic(); c = client((sys.argv[1], int(sys.argv[2])), 60); c.check(['x'])\n"
           "    took.append(time.monotonic() - t)\n"
           "print(json.dumps(took))")


@pytest.fixture(scope="module")
def machines():
    try:
        with routed_machines(2) as lab:
            yield lab
    except Unavailable as why:
        pytest.skip(f"no second machine here: {why}")


def _beside_a_store_slow_to_name(machines, script: str, named: bool = False) -> tuple[object, list[str]]:
    """``script`` run on machine 1 (its arguments: the store's address and port; it prints JSON) against a store on
    machine 0, whose resolver answers ``DELAY_S`` late (``named``: its /etc/hosts names machine 1): what the script
    printed, and the names the resolver was asked about."""
    store_machine, ranks_machine = machines.machines
    port = free_port()
    with slow_names(store_machine, DELAY_S, (ranks_machine.ip,) if named else ()) as names:
        server = store_machine.popen([sys.executable, "-c", SERVER, str(port)], stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "up"
            done = subprocess.run(["ip", "netns", "exec", ranks_machine.name, sys.executable, "-c", script,
                                   store_machine.ip, str(port)], capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr[-2000:]
            printed = json.loads(done.stdout)
        finally:
            server.kill()
            server.wait()
        return printed, names.stop()


@pytest.mark.parametrize("named", [False, True], ids=["resolver", "etc-hosts"])
def test_a_store_serves_a_new_connection_once_its_machine_named_the_peer(machines, named):
    took, asked = _beside_a_store_slow_to_name(machines, CLIENTS, named)
    peer = reverse_name(machines.machines[1].ip)
    if named:
        assert peer not in asked, asked
    else:  # each new client waited for its own lookup (an answer that says "no name" is not kept either)
        assert asked.count(peer) >= 4, asked
        assert all(t >= DELAY_S for t in took), took


READY = ("import json, sys, threading, time; from megatron_odyssey.runtime.control_plane import ControlPlane\n"
         "address, took = (sys.argv[1], int(sys.argv[2])), []\n"
         "def thread(k):\n"
         "    control = ControlPlane(address, address, k)\n"
         "    t = time.monotonic(); control.ready(); returned = time.monotonic() - t\n"
         "    while control._held() is None and time.monotonic() - t < 60: time.sleep(0.02)\n"
         "    took.append((returned, time.monotonic() - t if control._held() is not None else None))\n"
         "threads = [threading.Thread(target=thread, args=(k,)) for k in range(8)]\n"
         "[t.start() for t in threads]; [t.join() for t in threads]\n"
         "print(json.dumps(took))")


def test_a_thread_that_readies_its_client_of_a_standby_slow_to_name_it_goes_on_at_once(machines):
    """``ControlPlane.ready`` at start-up, eight threads at once (a rank's main thread, heartbeat and abort watcher
    call it as they start), against a standby's store whose machine's resolver answers 0.4 s late: each new
    connection, and each knock before it, waits its turn behind the others' lookups, seconds in all; each thread
    goes on at once and holds its client once it arrived. Before, ``ready`` made the client in the calling thread,
    which waited that long (10-12 s here): a heartbeat thread that did not beat at its start."""
    took, asked = _beside_a_store_slow_to_name(machines, READY)
    returned, arrived = zip(*took)
    assert len(took) == 8 and None not in arrived, took  # every thread holds its client
    assert max(arrived) > 8 * DELAY_S, took  # (they did wait their turn, one lookup after another) ...
    assert max(returned) < 2.0, took  # ... but not in the thread that asked
    assert asked.count(reverse_name(machines.machines[1].ip)) >= 16, asked  # (a knock and a client each)
