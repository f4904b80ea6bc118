"""A job that trained to its end leaves with 0, not SIGABRT (``megatron_lm.clean_exit``), with real gloo ranks.

The race (pytorch/pytorch#190489) is made certain here instead of waited for: rank 0's last collective is still in
a gloo worker thread when its interpreter shuts down. Its peer joins only once rank 0 runs its exit handlers, and
rank 0's last handlers hold the GIL, in C, until the peer says its collective is done and a while after, so the
worker thread, done, is waiting for the GIL to drop the collective's tensors when the interpreter starts finalising;
Python then ends that thread, through C++ code that may not be unwound: abort. Two things keep the race certain
however loaded the machine: the peer is told to join only after every exit handler that runs Python code (torch's
own, registered at its import, ran after that before, and handed the GIL over: both ranks left with 0 three times in
a row in CI), and rank 0 waits for the peer's word that it is done, not for a fixed time."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_odyssey.megatron_lm.clean_exit import leave_with_groups_destroyed

RANK = textwrap.dedent("""
    import atexit, ctypes, os, sys


    class PollFd(ctypes.Structure):
        _fields_ = [("fd", ctypes.c_int), ("events", ctypes.c_short), ("revents", ctypes.c_short)]


    flags, rank = sys.argv[1], int(os.environ["RANK"])
    if rank == 0:
        # Rank 0's last exit handlers (they run last registered, first called: so registered before any import, whose
        # own handlers run Python code, which hands the GIL over): two C calls made with the GIL held (ctypes.PyDLL
        # does not release it), called from C, so no Python code runs between them and the interpreter's finalisation:
        # wait (at most 60 s) until the peer writes to the pipe that its collective with this rank is done, then 2 s
        # more for this rank's worker thread to finish it and wait for the GIL
        libc = ctypes.PyDLL(None)
        peer_done = PollFd(os.open(os.path.join(flags, "peer_done"), os.O_RDWR), 1, 0)  # (read-write: no blocking)
        atexit.register(libc.usleep, 2_000_000)
        atexit.register(libc.poll, ctypes.byref(peer_done), 1, 60_000)
        # the handler before them: the peer may join rank 0's last collective now
        atexit.register(os.mkdir, os.path.join(flags, "finalising"))
    import time
    from pathlib import Path
    import torch, torch.distributed as dist
    from megatron_odyssey.megatron_lm.clean_exit import leave_with_groups_destroyed

    flags = Path(flags)


    def main():
        dist.init_process_group("gloo")
        if rank == 0:  # its last collective, still in the worker thread when it leaves main()
            inp, out = torch.ones(4), torch.empty(8)
            dist.all_gather_into_tensor(out, inp, async_op=True)
            del inp, out
            (flags / "returned").write_text("")
            return
        returned = None
        while not (flags / "finalising").exists():  # rank 0 is finalising (or, with the fix, tearing down)
            if returned is None and (flags / "returned").exists():
                returned = time.time()
            # with the fix rank 0 tears down, waiting for this collective, before it finalises: join 2 s after its
            # main() returned. Without it, wait for finalising however long a loaded machine takes to get there
            # (joining earlier lets the collective finish before the exit: no race, no abort)
            if sys.argv[2] == "destroy" and returned is not None and time.time() - returned > 2:
                print("rank 0 said it was done:", (flags / "done0").exists(), flush=True)  # (its teardown waits on us)
                break
            time.sleep(0.01)
        dist.all_gather_into_tensor(torch.empty(8), torch.ones(4))
        try:  # (without blocking: if rank 0 is gone, nobody reads the pipe)
            pipe = os.open(flags / "peer_done", os.O_WRONLY | os.O_NONBLOCK)
            os.write(pipe, b"x")
            os.close(pipe)
        except OSError:
            pass
        dist.destroy_process_group()


    if sys.argv[2] == "destroy":
        main = leave_with_groups_destroyed(main, wanted=lambda: True, lock=lambda: None,
                                           done=lambda: (flags / f"done{rank}").write_text(""))
    main()
""")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(tmp_path: Path, mode: str) -> list[int]:
    script = tmp_path / "rank.py"
    script.write_text(RANK)
    os.mkfifo(tmp_path / "peer_done")
    env = dict(os.environ, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()), WORLD_SIZE="2",
               OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join([str(Path(__file__).parents[2]),
                                                                 os.environ.get("PYTHONPATH", "")]))
    procs = [subprocess.Popen([sys.executable, str(script), str(tmp_path), mode], env=dict(env, RANK=str(r)),
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    return [p.returncode for p in procs], outs


def test_a_collective_still_in_a_gloo_thread_at_exit_aborts_the_process(tmp_path: Path) -> None:
    """The bug, without the fix: rank 0 leaves with SIGABRT, "terminate called without an active exception" (16 of
    16 tries here: 4 quiet, 8 beside four busy processes, 4 beside eight). Up to three tries, the first abort counts (a
    worker thread starved for the 2 s after its peer's word would miss the race); a premise that no longer holds
    still fails."""
    for attempt in range(3):
        (tmp_path / str(attempt)).mkdir()
        codes, outs = _run(tmp_path / str(attempt), "plain")
        if codes[0] != 0:
            break
    assert codes[0] == -signal.SIGABRT and "terminate called without an active exception" in outs[0], (codes, outs)
    assert codes[1] == 0, outs[1]


def test_destroying_the_groups_when_the_job_ends_leaves_with_0(tmp_path: Path) -> None:
    """With ``pretrain`` wrapped: the groups are destroyed (waiting for the collective) before the interpreter
    shuts down, and both ranks leave with 0."""
    codes, outs = _run(tmp_path, "destroy")
    assert codes == [0, 0], (codes, outs)
    # rank 0 told the agent its work was done before its teardown, which waited for the peer's collective
    assert "rank 0 said it was done: True" in outs[1], outs[1]


def test_groups_are_left_alone_after_an_error_or_a_nonzero_exit() -> None:
    """A peer may still be inside a collective with a rank that failed: no teardown then (it could wait for it)."""
    calls: list[str] = []

    def failing() -> None:
        raise RuntimeError("boom")

    def leaving(code: int):
        def run() -> None:
            raise SystemExit(code)
        return run

    def wanted() -> bool:  # (asked only where the groups would be destroyed; False: this process's session world
        calls.append("asked")  # of other tests stays up)
        return False

    with pytest.raises(RuntimeError):
        leave_with_groups_destroyed(failing, wanted=wanted, lock=lambda: None)()
    with pytest.raises(SystemExit):
        leave_with_groups_destroyed(leaving(1), wanted=wanted, lock=lambda: None)()
    assert calls == []
    with pytest.raises(SystemExit):  # a code not of Megatron's choosing is an error's
        leave_with_groups_destroyed(leaving(16), wanted=wanted, lock=lambda: None, chosen=dict)()
    assert calls == []
    with pytest.raises(SystemExit):  # Megatron's exit checks leave with 0: torn down
        leave_with_groups_destroyed(leaving(0), wanted=wanted, lock=lambda: None)()
    assert leave_with_groups_destroyed(lambda: 7, wanted=wanted, lock=lambda: None)() == 7
    with pytest.raises(SystemExit):  # and so does Megatron's rerun state machine, with its own codes
        leave_with_groups_destroyed(leaving(16), wanted=wanted, lock=lambda: None, chosen=lambda: {16: "resume"})()
    assert calls == ["asked"] * 3


def test_megatrons_own_exit_codes_are_its_rerun_state_machines() -> None:
    """16 (resume to tell a transient fault from a faulty device) and 17 (a result failed validation), each read
    from the installed megatron-core, with what it means for the terminal."""
    pytest.importorskip("megatron.core.rerun_state_machine")
    from megatron_odyssey.megatron_lm.clean_exit import chosen_exits

    chosen = chosen_exits()
    assert sorted(chosen) == [16, 17]
    assert "resume the job" in chosen[16] and "failed its validation" in chosen[17]
