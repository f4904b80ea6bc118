"""A rank's own error is not a peer failure (issue 10): real ranks raise (``--fail kind=error``), real
gloo peers die. One error: the job recovers without the rank and ends with the fault-free
parameters, the traceback on the terminal. The same error on a second rank, or an error during
start-up: the job stops within seconds with the real error on the terminal."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from megatron_odyssey.runtime.config import TrainConfig
from megatron_odyssey.runtime.errors import ErrorRecord, describe_exit, error_place, is_peer_failure, last_traceback
from megatron_odyssey.runtime.faults import FailSpec, InjectedError, Injector

TOL = 1e-5
MODEL = dict(layers=4, hidden=32, heads=4, seq=16, global_batch=8, micro_batch=1, steps=4, seed=11)
JOB = ["--nproc", "4", "--pp", "2", "--layers", "4", "--hidden", "32", "--heads", "4", "--seq", "16",
       "--global-batch", "8", "--micro-batch", "1", "--steps", "4", "--seed", "11"]
TIMEOUT_S = 120.0  # TrainConfig.timeout_s: what a rank would have waited for a plan that never comes


def odyssey_train(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """``odyssey train`` as a user runs it; returns the process (terminal output captured) and wall time."""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", "train", *JOB, "--workdir",
                           str(tmp_path / "run"), "--report", str(tmp_path / "report.json"), *flags],
                          capture_output=True, text=True, timeout=600)
    return proc, time.monotonic() - t0


@pytest.fixture
def reference(fault_free_reference):
    return fault_free_reference(TrainConfig(nproc=1, tp=1, pp=1, **MODEL))


def test_a_rank_error_is_printed_and_the_job_recovers_without_it(reference, tmp_path: Path) -> None:
    proc, _ = odyssey_train(tmp_path, "--fail", "step=1,rank=3,phase=backward,kind=error",
                            "--save-params", str(tmp_path / "p.pt"))
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-4000:]
    # the traceback reached the terminal, from the raise in the injector up to the training loop
    assert "Traceback (most recent call last)" in terminal and "InjectedError: injected error" in terminal
    assert "in train_step" in terminal and "runtime/faults.py" in terminal
    report = json.loads((tmp_path / "report.json").read_text())
    (failure,) = report["failures"]
    assert failure["ranks"] == [3] and failure["policy"] in ("reroute", "reconfigure")
    assert failure["error"]["type"] == "InjectedError" and failure["error"]["place"].startswith("megatron_odyssey/runtime/faults.py:")
    assert report["steps"][-1]["alive"] == 3
    params = torch.load(tmp_path / "p.pt")
    worst = max((params[k] - reference["params"][k]).abs().max().item() for k in params)
    assert set(params) == set(reference["params"]) and worst < TOL, worst
    assert [s["loss"] for s in report["steps"]] == pytest.approx(reference["losses"], abs=TOL)


def test_a_rank_that_crashes_in_native_code_is_named_with_its_signal_and_stack(reference, tmp_path: Path) -> None:
    """A real SIGSEGV (``kind=crash``), no error record from the rank: the terminal says which signal ended it and
    shows the Python stack faulthandler left in its log; the survivors end equal to the fault-free run."""
    proc, _ = odyssey_train(tmp_path, "--fail", "step=1,rank=2,phase=backward,kind=crash",
                            "--save-params", str(tmp_path / "p.pt"))
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 0, terminal[-4000:]
    assert "rank 2 was killed by SIGSEGV; the end of its log:" in terminal
    crash = terminal[terminal.index("rank 2 was killed by SIGSEGV"):]
    assert "Fatal Python error: Segmentation fault" in crash and "runtime/faults.py" in crash
    assert "(the other threads' stacks: in the log)" in crash  # the crashed thread's stack only
    report = json.loads((tmp_path / "report.json").read_text())
    (failure,) = report["failures"]
    assert failure["ranks"] == [2] and failure["ended"] == {"2": "was killed by SIGSEGV"} and failure["error"] is None
    params = torch.load(tmp_path / "p.pt")
    assert max((params[k] - reference["params"][k]).abs().max().item() for k in params) < TOL


def test_how_a_process_ended_and_its_last_traceback_are_read_as_torch_prints_them() -> None:
    assert describe_exit(-9) == "was killed by SIGKILL" and describe_exit(-11) == "was killed by SIGSEGV"
    assert describe_exit(1) == "exited with code 1" and describe_exit(-77) == "was killed by signal 77"
    # torch.distributed's excepthook prefixes each line of an uncaught exception with the rank
    log = ("[rank1]: Traceback (most recent call last):\n[rank1]:   File \"train.py\", line 3, in <module>\n"
           "[rank1]:     step()\n[rank1]: InjectedException")
    assert last_traceback("noise\n" + log) == ("Traceback (most recent call last):\n  File \"train.py\", line 3, in "
                                               "<module>\n    step()\nInjectedException")
    # faulthandler at a fatal signal: every thread, the crashed one ("Current thread") anywhere among them
    dump = ("Fatal Python error: Segmentation fault\n\nThread 0x1 (most recent call first):\n  File \"hb.py\", line 1 "
            "in run\n\nCurrent thread 0x2 (most recent call first):\n  File \"kernel.py\", line 9 in launch\n\n"
            "Thread 0x3 (most recent call first):\n  File \"loader.py\", line 4 in fetch\n")
    assert last_traceback(log + "\n" + dump) == ("Fatal Python error: Segmentation fault\nCurrent thread 0x2 (most recent "
                                                "call first):\n  File \"kernel.py\", line 9 in launch\n(the other "
                                                "threads' stacks: in the log)")


SIGNALS_PROBE = """
import argparse, os, signal, sys, time
from megatron_odyssey.megatron_lm.rank import stack_dump_signal
from megatron_odyssey.runtime.errors import dump_stacks_on_signals

got = []
signal.signal(signal.SIGUSR1, lambda *_: got.append("exit flag"))  # as Megatron's --exit-signal-handler --exit-signal 10
ask = stack_dump_signal(argparse.Namespace(exit_signal=int(sys.argv[1])))
dump_stacks_on_signals(ask)
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.2)
print(signal.Signals(ask).name, got, flush=True)
os.kill(os.getpid(), ask)  # the agent asking for the stacks
time.sleep(0.2)
"""


@pytest.mark.parametrize("exit_signal, ask, flag", [(10, "SIGUSR2", ["exit flag"]), (15, "SIGUSR1", [])])
def test_the_stack_dump_signal_leaves_megatrons_exit_signal_to_megatron(exit_signal: int, ask: str, flag: list) -> None:
    """Real signals to a real process: with Megatron's exit signal on SIGUSR1 (a scheduler's early warning), the
    agent's request for stacks moves to SIGUSR2 and SIGUSR1 still reaches Megatron's handler; otherwise SIGUSR1
    is the request (and dumps instead of running a Python handler)."""
    out = subprocess.run([sys.executable, "-c", SIGNALS_PROBE, str(exit_signal)], capture_output=True, text=True,
                         timeout=120)
    assert out.stdout.strip() == f"{ask} {flag}", out.stdout + out.stderr
    assert "most recent call first" in out.stderr  # faulthandler's dump, on the request


def test_the_same_error_on_a_second_rank_stops_the_job_within_seconds(tmp_path: Path) -> None:
    proc, wall = odyssey_train(tmp_path, "--fail", "step=1,rank=3,phase=backward,kind=error",
                               "--fail", "step=2,rank=1,phase=forward,kind=error")
    ended = time.time()
    terminal = proc.stdout + proc.stderr
    assert proc.returncode != 0, terminal[-4000:]
    assert "recurred on rank 1 after rank 3: it looks deterministic, not a hardware failure" in terminal
    assert terminal.count("Traceback (most recent call last)") >= 2  # both ranks' errors, on the terminal
    assert wall < TIMEOUT_S / 2, wall  # nobody waited out a timeout (start-up included)
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False
    last = report["failures"][-1]
    assert last["ranks"] == [1] and "deterministic" in last["reason"] and last["error"]["type"] == "InjectedError"
    stop_s = ended - last["error"]["time"]  # from the second raise to the end of `odyssey train`
    print(f"the deterministic error stopped the job {stop_s:.2f} s after it was raised (wall {wall:.1f} s)")
    assert stop_s < 20.0, stop_s


@pytest.mark.parametrize("leaving", [[0, 1, 2, 3], [0, 1, 2]], ids=["every rank", "all but rank 3"])
def test_the_training_scripts_own_exit_ends_the_job_with_its_code(tmp_path: Path, leaving: list[int]) -> None:
    """The script ends the job with a code of its own after step 2 (as Megatron-LM's rerun state machine does with
    16, resume to disambiguate, on every rank at once): nothing is recovered, the job leaves with 16 (a wrapper that
    relaunches on it does), and the terminal and the report say why. A rank that does not leave with the others is
    waited for at most the hard timeout, then stopped and named."""
    fails = [f"step=2,rank={r},phase=between,kind=exit,code=16" for r in leaving]
    proc, wall = odyssey_train(tmp_path, *(x for f in fails for x in ("--fail", f)), "--soft-timeout", "3", "--hard-timeout", "6")
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 16, terminal[-4000:]
    # (which of the leaving ranks the agent saw first is a race: its reason is the one quoted)
    assert re.search(r"rank\(s\) \[[0-3, ]+\] left with exit code 16: the training script ended the job \(--fail "
                     r"step=2,rank=[0-3],phase=between,kind=exit,code=16\); not a failure, nothing to recover", terminal)
    assert re.search(r"training failed: the training script ended the job with exit code 16 at step 3: the training "
                     r"script ended the job \(--fail step=2,rank=[0-3],phase=between,kind=exit,code=16\)", terminal)
    assert "recover" not in terminal.split("left with exit code 16")[0][-2000:]  # nothing recovered before it
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["ok"] is False and not [f for f in report["failures"] if f.get("policy")]
    ended = report["ended_by_script"]
    assert (ended["code"], ended["step"], ended["ranks"]) == (16, 3, leaving)
    assert [s["step"] for s in report["steps"]] == [0, 1, 2]  # the steps before the exit were committed
    if leaving == [0, 1, 2, 3]:
        assert ended["others"] == {}
        assert wall < TIMEOUT_S / 2, wall  # nobody waited for a rank that had left
    else:
        assert set(ended["others"]) == {"3"}  # stopped (or failed without its peers) and named


def test_a_start_up_failure_ends_the_job_promptly_with_the_real_error(tmp_path: Path) -> None:
    bad = tmp_path / "corrupt"  # the files exist (a missing prefix is refused up front) but hold no index
    bad.with_suffix(".bin").write_bytes(b"x" * 64)
    bad.with_suffix(".idx").write_bytes(b"not an index")
    proc, wall = odyssey_train(tmp_path, "--data-path", str(bad))
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 1
    assert "failed during start-up" in terminal
    assert "Traceback (most recent call last)" in terminal and "indexed_dataset.py" in terminal
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("training failed: rank ") and "during start-up" in last and "rank logs kept in" in last
    assert wall < TIMEOUT_S / 2, wall  # not the 60 s "never came up" heartbeat rule, nor a timeout


def test_a_missing_dataset_is_refused_before_any_process_starts(tmp_path: Path) -> None:
    proc, wall = odyssey_train(tmp_path, "--data-path", str(tmp_path / "no-such-corpus"))
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1].startswith("odyssey train: error: --data-path ")


def test_gloo_peer_failures_are_told_apart_from_local_errors() -> None:
    """Against real gloo errors (torch 2.13 raises a plain RuntimeError for a dead peer)."""
    from _runtime_workers import classify_gloo_errors_worker, on_two_gloo_ranks

    results = {case: (kind, peer) for case, kind, peer in on_two_gloo_ranks(classify_gloo_errors_worker, 300)}
    assert results["peer killed"] == ("RuntimeError", True)
    assert results["shape bug"] == ("RuntimeError", False)
    assert results["shape bug in an aborted generation"] == ("RuntimeError", True)
    assert results["store timeout"] == ("DistStoreError", True)


def test_an_injected_error_is_local_and_placed_at_its_raise() -> None:
    injector = Injector([FailSpec.parse("step=2,rank=0,phase=optimizer,kind=error")], ident=0)
    injector(1, "optimizer")  # not its step: nothing happens
    with pytest.raises(InjectedError) as info:
        injector(2, "optimizer")
    assert not is_peer_failure(info.value)
    record = ErrorRecord.of(info.value, rank=0, where="step 2")
    assert record.type == "InjectedError" and record.place.startswith("megatron_odyssey/runtime/faults.py:")
    assert record.place.endswith("in __call__") and "Traceback" in record.traceback
    assert ErrorRecord.from_json(record.to_json()) == record
    try:
        torch.ones(2, 3) @ torch.ones(4, 5)
    except RuntimeError as exc:  # inside torch: the place is the caller's line, in this file
        assert error_place(exc).startswith("tests/runtime/test_errors.py:")


def test_a_bug_in_the_agent_stops_the_job_promptly_with_its_traceback(tmp_path: Path) -> None:
    """The agent's own code fails when a rank dies (here: the planner raises). Its helper threads must not
    keep the job alive until a timeout: the cause reaches the terminal and every process ends at once."""
    hook = tmp_path / "hook"
    hook.mkdir()
    (hook / "sitecustomize.py").write_text(
        "import megatron_odyssey.planning.planner as planner\n"
        "def decide(self, *args, **kwargs):\n"
        "    raise RuntimeError('planner bug planted by the test')\n"
        "planner.Planner.decide = decide\n")
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", "train", *JOB, "--workdir", str(tmp_path / "run"),
                           "--report", str(tmp_path / "report.json"), "--fail", "step=1,rank=3,phase=forward,kind=kill"],
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PYTHONPATH": f"{hook}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"})
    wall = time.monotonic() - t0
    terminal = proc.stdout + proc.stderr
    assert proc.returncode == 1, terminal[-4000:]
    assert "internal error, stopping the job" in terminal and "RuntimeError: planner bug planted by the test" in terminal
    assert "in recover" in terminal  # the traceback, not only the message
    assert wall < TIMEOUT_S / 2, wall
    assert json.loads((tmp_path / "report.json").read_text())["ok"] is False


def test_a_rank_stuck_in_a_collective_is_its_processs_failure_however_many_ranks_it_happens_to() -> None:
    """The agent's judgement of the records failed ranks leave, over a real store: a rank that left stuck in a gloo
    wait (``ErrorRecord.stuck``, from ``megatron_lm.rank.AbortWatcher``) is shown with its stack and recovered from,
    on a second rank too (the same wait on two ranks is gloo's, not a bug of the job); the same plain error on a
    second rank stops the job."""
    from datetime import timedelta
    from types import SimpleNamespace

    import torch.distributed as dist

    from megatron_odyssey.runtime.agent import Agent, free_port
    from megatron_odyssey.runtime.errors import ERROR_KEY

    store = dist.TCPStore("127.0.0.1", free_port(), is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=30))
    said: list[str] = []
    agent = SimpleNamespace(store=store, errors={}, fenced=set(), _started=lambda ident: True, log_error=said.append)
    why = "the main thread is still inside torch.distributed's all_reduce (distributed_c10d.py:3252) 10 s after ..."
    for ident in (3, 1):
        store.set(ERROR_KEY.format(ident), ErrorRecord.stuck(ident, "step 2", why, sys._getframe()).to_json())
        assert Agent.judge(agent, {ident}) is None, said
        shown, recovering = said[-2:]
        assert shown.startswith(f"rank {ident} failed (step 2): StuckInCollective: {why} (")
        assert "Stack of the main thread (most recent call last):" in shown and "in test_a_rank_stuck_in" in shown
        assert recovering == f"recovering without rank {ident}"

    def fail() -> None:
        raise RuntimeError("a bug")

    for ident in (0, 2):
        try:
            fail()
        except RuntimeError as exc:
            store.set(ERROR_KEY.format(ident), ErrorRecord.of(exc, ident, "step 3").to_json())
    assert Agent.judge(agent, {0}) is None
    assert "recurred on rank 2 after rank 0: it looks deterministic" in Agent.judge(agent, {2})
