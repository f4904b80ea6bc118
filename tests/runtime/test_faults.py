"""Fault kinds whose moment matters (``runtime.faults``), on real gloo processes."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from megatron_odyssey.runtime.agent import free_port

FROZEN_PEER = """
import sys, time, torch, torch.distributed as dist
from datetime import timedelta
from megatron_odyssey.runtime.faults import FailSpec, Injector
rank, port = int(sys.argv[1]), int(sys.argv[2])
store = dist.TCPStore("127.0.0.1", port, is_master=rank == 0, wait_for_workers=False, timeout=timedelta(seconds=60))
dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=300))
message = torch.zeros(16 * 1024 * 1024)
if rank == 1:
    Injector([FailSpec.parse("step=0,rank=1,phase=grad-sync,kind=freeze")], ident=1)(0, "grad-sync")
    time.sleep(0.5)  # (the fault fired and returned: not stopped outside a collective)
    print("entering", flush=True)
    dist.recv(message, 0)
    print("received", flush=True)
else:
    time.sleep(3.0)  # (the receiver is inside its receive by now: it freezes there before the message comes)
    dist.send(message, 1)
    print("sent", flush=True)
"""


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def test_freeze_stops_the_rank_inside_its_next_collective_with_its_messages_under_way(tmp_path: Path) -> None:
    """``kind=freeze`` returns at once and stops the process (SIGSTOP) only once its main thread is inside a
    torch.distributed call: here the receive of 64 MB whose sender then stays in its send, as a machine that froze in
    the middle of a transfer leaves its peers (``kind=hang`` stops the rank at the fault's phase, before any of it)."""
    port = free_port()
    script = tmp_path / "frozen_peer.py"
    script.write_text(FROZEN_PEER)
    procs = [subprocess.Popen([sys.executable, str(script), str(rank), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for rank in range(2)]
    try:
        deadline = time.monotonic() + 60
        while _state(procs[1].pid) != "T":
            assert time.monotonic() < deadline and procs[1].poll() is None, procs[1].communicate(timeout=10)
            time.sleep(0.05)
        time.sleep(2.0)
        assert procs[0].poll() is None  # its send waits for the frozen receiver
        for p in procs:
            p.kill()
        outs = [p.communicate(timeout=30) for p in procs]
        assert outs[1][0] == "entering\n" and "sent" not in outs[0][0], outs
        assert "[odyssey fault] freezing (SIGSTOP) inside recv (distributed_c10d.py:" in outs[1][1], outs[1][1]
    finally:
        for p in procs:
            p.kill()
