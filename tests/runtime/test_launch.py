"""odyssey-launch without Megatron-LM: torchrun's environment, exit handling, bad arguments, and the
node agent's exit reports and fencing over the store (real processes, real TCPStore)."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from megatron_odyssey.launch import FINISHED_KEY, RemoteExits, RemoteRank, parse, report_exit
from megatron_odyssey.runtime.control_plane import FENCE_KEY
from megatron_odyssey.testing.ports import job_port

ENV_DUMP = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ODYSSEY_STORE",
        "ODYSSEY_SILENCE_TIMEOUT_S"]
open(sys.argv[1] + "/env" + os.environ["RANK"] + ".json", "w").write(json.dumps({k: os.environ[k] for k in keys}))
sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "1" else 0)
"""


def _launch(tmp: Path, exit_code_of_rank1: int, port: int, *flags: str) -> subprocess.CompletedProcess:
    script = tmp / "job.py"
    script.write_text(ENV_DUMP)
    return subprocess.run([sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "3",
                           "--master-port", str(port), "--workdir", str(tmp / "logs"), *flags, str(script), str(tmp),
                           str(exit_code_of_rank1)], capture_output=True, text=True, timeout=120)


def test_ranks_get_torchruns_environment_and_a_plain_job_passes(tmp_path: Path) -> None:
    port = job_port(1900)
    proc = _launch(tmp_path, 0, port, "--silence-timeout", "25")
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_PORT"] for e in envs} == {str(port)}
    assert {e["ODYSSEY_STORE"] for e in envs} == {f"127.0.0.1:{port + 1}"}  # the agent's store
    assert {e["ODYSSEY_SILENCE_TIMEOUT_S"] for e in envs} == {"25"}  # (their connections' bound: runtime.sockets)


def test_a_rank_that_dies_before_training_fails_the_job_with_its_log(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 3, job_port(1910))
    assert proc.returncode == 1
    assert "rank(s) [1] exited [3] before training started" in proc.stderr


def test_a_machine_that_may_not_open_enough_files_for_the_store_is_refused_before_any_rank_starts(
        tmp_path: Path) -> None:
    """Machine 0 serves the agent's store: three connections per rank. A launcher whose processes may open at most 100
    files (hard limit) cannot serve 40 ranks: it says so, with the numbers and the remedy, and starts no rank (before,
    the store reset the connections past its limit and those ranks failed to start, "Connection reset by peer")."""
    import resource

    def at_most_100_files() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))

    script = tmp_path / "job.py"
    script.write_text(ENV_DUMP)
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "40", "--master-port",
                           str(job_port(1945)), "--workdir", str(tmp_path / "logs"), str(script), str(tmp_path), "0"],
                          capture_output=True, text=True, timeout=120, preexec_fn=at_most_100_files)
    assert proc.returncode == 1, proc.stderr
    assert re.search(r"\[odyssey launch node 0\] this machine serves the agent's store to 40 ranks on 1 machines: about "
                     r"226 open files \(3 connections per rank, 2 per machine, a log per rank started here, 64 of its "
                     r"own\), but its processes may open at most 100 \(the hard limit: ulimit -Hn\)\. Raise it for "
                     r"the job \(ulimit -n 65536", proc.stderr), proc.stderr
    assert not list(tmp_path.glob("env*.json"))  # (no rank started)


WAIT_FOR_SIGTERM = """
import os, signal, sys, time
rank, out, mode = os.environ["RANK"], sys.argv[1], sys.argv[2]
def handler(signum, frame):  # as Megatron's --exit-signal-handler: finish, save, leave cleanly
    open(f"{out}/got{rank}", "w").write(signal.Signals(signum).name)
    sys.exit(0)
signal.signal(signal.SIGTERM, handler if mode == "save" else signal.SIG_IGN)
open(f"{out}/ready{rank}", "w").write("")
time.sleep(120)
"""


def _launch_and_terminate(tmp: Path, mode: str, port: int, *flags: str) -> tuple[subprocess.CompletedProcess, float]:
    """Two ranks of a job that waits; SIGTERM to the launcher once both run (a scheduler stopping the job)."""
    script = tmp / "job.py"
    script.write_text(WAIT_FOR_SIGTERM)
    proc = subprocess.Popen([sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "2", "--master-port",
                             str(port), "--workdir", str(tmp / "logs"), *flags, str(script), str(tmp), mode],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not all((tmp / f"ready{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=240)
    finally:
        proc.kill()  # (only if it is still there)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err), time.monotonic() - t0


def test_sigterm_to_the_launcher_reaches_every_rank_which_may_leave_cleanly(tmp_path: Path) -> None:
    """As torchrun: Megatron's --exit-signal-handler gets the scheduler's SIGTERM, saves and exits with 0."""
    proc, wall = _launch_and_terminate(tmp_path, "save", job_port(1920), "--termination-grace", "600")
    assert proc.returncode == 0, proc.stderr
    assert wall < 240, wall  # the launcher left with its ranks, not after the termination grace (on a loaded machine
    # the ranks' own exit took 21 s: the grace is long enough that nothing but waiting it out comes near it)
    assert "received SIGTERM: passing it to the ranks" in proc.stderr
    assert [(tmp_path / f"got{r}").read_text() for r in range(2)] == ["SIGTERM", "SIGTERM"]


def test_ranks_still_running_after_the_termination_grace_are_killed(tmp_path: Path) -> None:
    proc, wall = _launch_and_terminate(tmp_path, "ignore", job_port(1930), "--termination-grace", "1")
    assert proc.returncode == 128 + signal.SIGTERM, proc.stderr
    assert "received SIGTERM and passed it to the ranks: the job is being stopped" in proc.stderr
    assert "exited" not in proc.stderr  # not reported as ranks failing at start-up
    assert wall < 30, wall  # the grace (1 s), not the job's 120 s
    # why they died, on the terminal (the agent only sees SIGKILLs), and what to change
    assert "rank(s) [0, 1] still running 1 s after SIGTERM: killing them" in proc.stderr
    assert "raise --termination-grace" in proc.stderr


RAISE = """
import os
rank = int(os.environ["RANK"])
def set_up():
    if rank == 1:
        raise ValueError("rank one's bad config")
    if rank == 2:
        raise KeyError("rank two's missing key")
set_up()
"""


def test_start_up_errors_of_every_failing_rank_reach_the_terminal(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text(RAISE)
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "3",
                           "--master-port", str(job_port(1940)), "--workdir", str(tmp_path / "logs"),
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "before training started" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 2  # each rank's own error, not just the first
    assert "ValueError: rank one's bad config" in proc.stderr and "KeyError: \"rank two's missing key\"" in proc.stderr
    assert "in set_up" in proc.stderr and str((tmp_path / "logs").resolve()) in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "x.py"], "outside 0..1"),
    (["--silence-timeout", "1", "x.py"], "--silence-timeout must be at least 3 seconds (one unanswered keepalive "
                                         "probe), got 1.0"),
])
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["--nnodes", "2", "--witness-dir", "/nonexistent/w", "x.py"], "--witness-dir /nonexistent/w is not a directory"),
    (["--witness-dir", ".", "x.py"], "--witness-dir takes the tie between the agent and its standby: it needs "
                                     "--nnodes 2 or more, without --no-standby"),
    (["--nnodes", "2", "--no-standby", "--witness-dir", ".", "x.py"], "it needs --nnodes 2 or more, without "
                                                                      "--no-standby"),
])
def test_bad_witness_directories(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse(["--no-python", *argv])
    assert message in capsys.readouterr().err


def test_the_witness_directory_from_the_environment(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/odyssey_launch.sh`` passes it through the environment for any job: a one-machine job ignores it,
    machine 0 checks it, and the other machines take machine 0's (which machine 1 checks it sees, below)."""
    monkeypatch.setenv("ODYSSEY_WITNESS_DIR", str(tmp_path))
    assert parse(["--no-python", "x.py"]).witness_dir is None
    assert parse(["--no-python", "--nnodes", "2", "x.py"]).witness_dir == str(tmp_path)
    monkeypatch.setenv("ODYSSEY_WITNESS_DIR", "/nonexistent/w")
    assert parse(["--no-python", "--nnodes", "2", "--node-rank", "1", "x.py"]).witness_dir == "/nonexistent/w"
    with pytest.raises(SystemExit):
        parse(["--no-python", "--nnodes", "2", "x.py"])
    assert "ODYSSEY_WITNESS_DIR (--witness-dir) /nonexistent/w is not a directory" in capsys.readouterr().err


def _both_machines_refuse(tmp_path: Path, port: int, witness: tuple[Path | None, Path | None], refusal: str,
                          machine_1_in: tuple[str, ...] = ()) -> None:
    """Machines 0 and 1 of a two-machine job (a rank each) started with these --witness-dir (None: without;
    ``machine_1_in``: what machine 1's launcher runs inside): both exit 1, each saying ``refusal``, and machine 0
    that the job stops before it trains, within 120 s, long before their ranks would end (600 s; without the refusal
    machine 0 waits for them). The launchers take seconds on a quiet host, and took 40 s beside another test job."""
    script = tmp_path / "job.py"
    script.write_text("import time\ntime.sleep(600)\n")

    def machine(node: int) -> list[str]:
        return [sys.executable, "-m", "megatron_odyssey.launch", "--nnodes", "2", "--node-rank", str(node),
                "--nproc-per-node", "1", "--master-port", str(port), "--workdir", str(tmp_path / f"logs{node}"),
                *(["--witness-dir", str(witness[node])] if witness[node] else []), str(script)]

    t0 = time.monotonic()
    launchers = [subprocess.Popen(machine(0), stderr=subprocess.PIPE, text=True),
                 subprocess.Popen([*machine_1_in, *machine(1)], stderr=subprocess.PIPE, text=True)]
    try:
        said = [p.communicate(timeout=150)[1] for p in launchers]
    finally:
        for p in launchers:
            p.kill()
    assert [p.returncode for p in launchers] == [1, 1], said
    assert refusal in said[0] and "the job stops before it trains" in said[0], said[0]
    assert refusal in said[1], said[1]
    assert time.monotonic() - t0 < 120


def test_a_witness_directory_the_standbys_machine_does_not_see_stops_the_job_before_it_trains(tmp_path: Path) -> None:
    """Machine 1 runs in a mount namespace where the witness directory is an empty file system of its own (storage
    machine 0 does not share with it). A witness only one side can claim would let both sides of a tie go on, so
    the standby refuses it and machine 0 stops the job, both saying why, within seconds."""
    if subprocess.run(["unshare", "-m", "true"], capture_output=True).returncode != 0:
        pytest.skip("no mount namespace here (unshare -m needs root)")
    witness = tmp_path / "witness"
    witness.mkdir()
    _both_machines_refuse(tmp_path, job_port(1870), (witness, witness),
                          "--witness-dir: the standby's machine does not see " + str(witness / "odyssey-witness-"),
                          ("unshare", "-m", "sh", "-c", f'mount -t tmpfs none "{witness}" && exec "$@"', "-"))
    assert list(witness.iterdir()) == []  # (machine 0's job directory, empty, went with the job)


@pytest.mark.parametrize("machine_0, machine_1", [("a", "b"), (None, "b")], ids=["another", "only-machine-1"])
def test_a_witness_directory_machine_1_was_given_must_be_machine_0s(tmp_path: Path, machine_0: str | None,
                                                                     machine_1: str) -> None:
    """Machine 0's --witness-dir is the job's: machine 1 given another one (or one where machine 0 has none) would
    have its user believe the tie is claimed there. Both machines say which and stop before the job trains."""
    for name in ("a", "b"):
        (tmp_path / name).mkdir()
    refusal = (f"--witness-dir {tmp_path / 'b'} on machine 1 is not machine 0's ({tmp_path / 'a'})" if machine_0
               else f"--witness-dir {tmp_path / 'b'} is given on machine 1 but not on machine 0")
    _both_machines_refuse(tmp_path, job_port(1880 + 5 * (machine_0 is None)),
                          (machine_0 and tmp_path / machine_0, tmp_path / machine_1), refusal)
    assert list((tmp_path / "a").iterdir()) == []  # (machine 0's job directory, empty, went with the job)


@pytest.mark.parametrize("by", ["flag", "environment"])
def test_a_witness_directory_the_job_cannot_write_in_stops_machine_0_before_any_rank_starts(tmp_path: Path,
                                                                                             by: str) -> None:
    """Machine 0 makes the job's own directory in the witness directory before any rank starts: where it cannot
    (/sys, where not even root may make one), its launcher exits 1 at once, naming where the path came from and the
    system's reason, and starts no rank."""
    if not Path("/sys").is_dir():
        pytest.skip("no /sys here")
    script = tmp_path / "job.py"
    script.write_text(f"open({str(tmp_path / 'started')!r}, 'w').close()\n")
    given = ["--witness-dir", "/sys"] if by == "flag" else []
    env = {**os.environ, **({"ODYSSEY_WITNESS_DIR": "/sys"} if by == "environment" else {})}
    t0 = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "megatron_odyssey.launch", "--nnodes", "2", "--node-rank", "0",
                           "--nproc-per-node", "1", "--master-port", str(job_port(1890 + 5 * (by == "environment"))),
                           "--workdir", str(tmp_path / "logs"), *given, str(script)],
                          capture_output=True, text=True, timeout=60, env=env)
    said = "--witness-dir" if by == "flag" else "ODYSSEY_WITNESS_DIR (--witness-dir)"
    assert done.returncode == 1, done.stderr
    assert re.search(rf"{re.escape(said)} /sys: cannot make the job's directory there \(\[Errno \d+\] .+\)",
                     done.stderr), done.stderr
    assert time.monotonic() - t0 < 30 and not (tmp_path / "started").exists()


@pytest.mark.parametrize("said, message", [("2", "--silence-timeout must be at least 3 seconds"),
                                           ("ten", "ODYSSEY_SILENCE_TIMEOUT_S='ten' (--silence-timeout) is not a "
                                                   "number of seconds")])
def test_a_bad_silence_timeout_from_the_environment(said: str, message: str, capsys: pytest.CaptureFixture,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``scripts/odyssey_launch.sh`` passes it through the environment: checked as the flag is."""
    monkeypatch.setenv("ODYSSEY_SILENCE_TIMEOUT_S", said)
    with pytest.raises(SystemExit):
        parse(["--no-python", "x.py"])
    assert message in capsys.readouterr().err


def test_remote_rank_reads_exits_and_requests_fencing_through_the_store() -> None:
    import torch.distributed as dist

    from megatron_odyssey.runtime.agent import free_port

    port = free_port()
    server = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    coordinator = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))  # the node agent
    remote = RemoteRank(coordinator, 5)
    assert remote.exitcode is None
    remote.kill()  # the coordinator fences: the node agent sees the request
    assert client.check([FENCE_KEY.format(5)])
    t0 = time.monotonic()
    remote.join(0.2)
    assert time.monotonic() - t0 >= 0.2  # still running: join waits its timeout
    report_exit(client, 5, -9)  # the node agent reports the SIGKILL
    remote.join(5)  # a store set is not acknowledged: the coordinator polls, as it does in supervise()
    assert remote.exitcode == -9
    # the coordinator reads every remote exit in one round trip, however many ranks it asks about
    report_exit(client, 7, 0)
    exits = RemoteExits(coordinator, every_s=0.0)
    ranks = [RemoteRank(coordinator, i, exits) for i in range(64)]
    assert {r.ident: r.exitcode for r in ranks if r.exitcode is not None} == {5: -9, 7: 0}
    del server


def _node_agent(tmp: Path, port: int, local: dict, node_rank: int = 2) -> tuple[object, list[int]]:
    """Machine ``node_rank``'s node agent in a thread (no control plane: a store error ends it), reporting to the
    store at ``port``; its return code lands in the list."""
    import argparse
    import threading

    import torch.distributed as dist

    from megatron_odyssey.launch import node_agent

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=5))
    codes: list[int] = []
    args = argparse.Namespace(node_rank=node_rank, workdir=tmp, join=None, stuck_restarts=0)
    thread = threading.Thread(target=lambda: codes.append(node_agent(args, local, client)), daemon=True)
    thread.start()
    return thread, codes


def _rank(code: str):
    from megatron_odyssey.launch import LocalRank

    return LocalRank(subprocess.Popen([sys.executable, "-c", code], start_new_session=True))


def test_a_machine_whose_ranks_ended_waits_for_the_jobs_end_and_exits_with_its_code(tmp_path: Path,
                                                                                      capfd: pytest.CaptureFixture) -> None:
    """Machine 2's ranks end while the job goes on without them: the agent fences rank 4 (SIGKILL), rank 5 fails
    with an error. Its launcher waits for the job's end and exits with the job's code, 0, as every machine's
    launcher does: before, it exited at once with 247 (its rank's SIGKILL), and a scheduler that stops a job when a
    task fails (``srun --kill-on-bad-exit``) would have stopped the job that recovered. The agent's launcher, ending
    the job, keeps its store up until that machine has read the end (``finish_job``), and no longer."""
    import torch.distributed as dist

    from megatron_odyssey.launch import FINISH_WAIT_S, SAW_END_KEY, finish_job

    from megatron_odyssey.launch import CONFIG_KEY

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    server.set(CONFIG_KEY, "{}")  # (training has started)
    fenced, failed = _rank("import time; time.sleep(120)"), _rank("raise SystemExit(1)")
    try:
        node, codes = _node_agent(tmp_path, server.port, {4: fenced, 5: failed})
        server.set(FENCE_KEY.format(4), "1")
        exits = RemoteExits(server, every_s=0.0)
        deadline = time.monotonic() + 30
        while (exits.code(4) is None or exits.code(5) is None) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert (exits.code(4), exits.code(5)) == (-9, 1)
        time.sleep(0.5)
        assert node.is_alive() and not codes  # waiting for the job, not failing it
        t0 = time.monotonic()
        finish_job(server, 0)
        took = time.monotonic() - t0
        node.join(10)
        assert codes == [0] and server.check([SAW_END_KEY.format(2)])
        assert took < FINISH_WAIT_S / 2, took  # (it read the end: the store was not held up to the bound)
        assert ("[odyssey launch node 2] this machine's ranks have ended (one was killed by SIGKILL); the job goes on "
                "without them: waiting for its end") in capfd.readouterr().err
        # a machine that said it waits and never reads the end (lost meanwhile) holds the store up to the bound only
        t0 = time.monotonic()
        server.append("odyssey/awaiting-end", "3;")
        finish_job(server, 0, wait_s=0.5)
        assert 0.5 <= time.monotonic() - t0 < 5
    finally:
        fenced.kill()


def test_a_machine_whose_rank_fails_before_training_started_leaves_at_once(tmp_path: Path) -> None:
    """Before training started the job has no end to wait for: the agent's launcher stops every rank and leaves with
    the start-up error (``coordinate``), so this machine's launcher leaves with its rank's code at once."""
    import torch.distributed as dist

    from megatron_odyssey.launch import AWAITING_END_KEY

    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    node, codes = _node_agent(tmp_path, server.port, {4: _rank("raise SystemExit(1)")})
    node.join(30)
    assert codes == [1] and not server.check([AWAITING_END_KEY])


def test_a_machine_that_cannot_learn_the_jobs_end_leaves_with_its_ranks_code(tmp_path: Path,
                                                                            capfd: pytest.CaptureFixture) -> None:
    """The agent's machine is lost and no standby takes over (``--no-standby``) after this machine's rank failed:
    its launcher does not wait for an end that cannot come, it leaves with its rank's code and says why."""
    import torch.distributed as dist

    from megatron_odyssey.launch import CONFIG_KEY
    from megatron_odyssey.runtime.control_plane import free_port

    port = free_port()
    server = subprocess.Popen([sys.executable, "-c", "import sys, time, torch.distributed as d; s = d.TCPStore("
                               "'127.0.0.1', int(sys.argv[1]), is_master=True, wait_for_workers=False); "
                               "print('up', flush=True); time.sleep(120)", str(port)], stdout=subprocess.PIPE,
                              start_new_session=True)
    try:
        assert server.stdout.readline() == b"up\n"
        dist.TCPStore("127.0.0.1", port, is_master=False).set(CONFIG_KEY, "{}")  # (training has started)
        node, codes = _node_agent(tmp_path, port, {4: _rank("raise SystemExit(3)")})
        deadline, said = time.monotonic() + 30, ""
        while "waiting for its end" not in said and time.monotonic() < deadline:
            time.sleep(0.1)
            said += capfd.readouterr().err
        assert "waiting for its end" in said and node.is_alive() and not codes
        server.kill()  # the agent's machine, lost
        server.wait(10)
        node.join(30)
        assert codes == [3]
        assert "[odyssey launch node 2] the job's end cannot be learned" in capfd.readouterr().err
    finally:
        server.kill()


def test_logged_training_compares_to_the_last_printed_digit() -> None:
    from megatron_odyssey.testing.megatron_lm_job import JobResult, same_training

    line = (" [2026-11-21 22:38:56.004435] iteration        3/       5 | consumed samples:           24 | "
            "elapsed time per iteration (ms): 5070.7 | learning rate: 4.109424E-04 | global batch size:     8 | "
            "lm loss: {loss} | loss scale: 1.0 | grad norm: {norm} |")
    ref = JobResult(0, 1.0, line.format(loss="5.228603E+00", norm="1.256")).iterations()
    assert ref == {3: ("24", "4.109424E-04", "5.228603E+00", "1.256")}
    assert JobResult(0, 1.0, line.format(loss="5.228603E+00", norm="1.256")).iteration_ms() == {3: 5070.7}
    assert same_training(ref, JobResult(0, 1.0, line.format(loss="5.228604E+00", norm="1.257")).iterations())
    assert not same_training(ref, JobResult(0, 1.0, line.format(loss="5.228606E+00", norm="1.256")).iterations())
    assert not same_training(ref, JobResult(0, 1.0, line.format(loss="5.228603E+00", norm="1.259")).iterations())
    assert not same_training(ref, {})


def test_a_failed_jobs_tail_leaves_pythons_warnings_out() -> None:
    from megatron_odyssey.testing.megatron_lm_job import JobResult

    logs = "\n".join(["[odyssey rank 3] iteration 1: RuntimeError: Connection reset by peer; recovering",
                      "/m/core/optimizer/optimizer.py:28: UserWarning: Apex is not installed. Falling back",
                      "  warnings.warn(",
                      "/m/core/tensor_parallel/layers.py:713: DeprecationWarning: tp_group is None",
                      "[odyssey agent] stopping the job: the reason"])
    assert JobResult(1, 1.0, logs).tail() == ("[odyssey rank 3] iteration 1: RuntimeError: Connection reset by peer; "
                                              "recovering\n[odyssey agent] stopping the job: the reason")
    assert JobResult(1, 1.0, logs).tail(10) == "the reason"


# -- a machine that comes back: odyssey-launch --join (its Megatron side: tests/runtime/test_megatron_lm.py) --

JOIN_ENV_DUMP = """
import json, os, sys, time
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ODYSSEY_STORE", "ODYSSEY_JOIN_RANK"]
ident = os.environ["ODYSSEY_JOIN_RANK"]
open(sys.argv[1] + "/env" + ident + ".json", "w").write(json.dumps({**{k: os.environ[k] for k in keys}, "pid": os.getpid()}))
time.sleep(float(sys.argv[2]))
"""


def _job_store(nproc: int, tp: int) -> tuple[object, str]:
    """A running job's store as a joining machine sees it: the agent's address and the job's config."""
    import torch.distributed as dist

    from megatron_odyssey.launch import CONFIG_KEY
    from megatron_odyssey.runtime.config import TrainConfig
    from megatron_odyssey.runtime.control_plane import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=30))
    cfg = TrainConfig(nproc=nproc, tp=tp, pp=2, layers=4, hidden=32, heads=4, seq=16, global_batch=8, micro_batch=1,
                      steps=4)
    store.set(CONFIG_KEY, json.dumps(cfg.__dict__))
    return store, f"127.0.0.1:{port}"


def _join(tmp: Path, address: str, node_rank: int, nproc: int, sleep_s: float = 0.0) -> int:
    """``odyssey-launch --join`` in this process (its ranks are real processes): the launcher's exit code."""
    from megatron_odyssey.launch import join_running_job

    script = tmp / "joiner.py"
    script.write_text(JOIN_ENV_DUMP)
    return join_running_job(parse(["--join", address, "--nnodes", "4", "--node-rank", str(node_rank), "--nproc-per-node",
                                   str(nproc), "--workdir", str(tmp / "logs"), str(script), str(tmp), str(sleep_s)]))


def test_join_fails_clearly_without_a_job_at_the_address(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    from megatron_odyssey.runtime.control_plane import free_port

    assert _join(tmp_path, f"127.0.0.1:{free_port()}", 1, 1) == 2
    err = capsys.readouterr().err
    assert "--join" in err and "cannot reach the job" in err and "nothing listens there" in err


@pytest.mark.parametrize("node_rank, nproc, message", [(3, 2, "are not ranks of the job (0..3)"),
                                                       (1, 1, "joins whole")])
def test_a_joining_machine_is_numbered_as_at_launch(tmp_path: Path, capsys: pytest.CaptureFixture, node_rank: int,
                                                    nproc: int, message: str) -> None:
    store, address = _job_store(nproc=4, tp=2)
    assert _join(tmp_path, address, node_rank, nproc) == 2 and message in capsys.readouterr().err


def test_each_joining_node_starts_in_a_private_world_and_its_exits_reach_the_agent(tmp_path: Path) -> None:
    """Machine 1 of a job with TP=2 comes back with 4 ranks: two nodes, each a private world of its 2
    tensor-parallel ranks (torchrun's variables for it), each rank told the global rank it joins as; the
    launcher reports their exits to the agent like any machine's node agent."""
    store, address = _job_store(nproc=8, tp=2)
    assert _join(tmp_path, address, 1, 4) == 0
    envs = {r: json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(4, 8)}
    assert [envs[r]["RANK"] for r in range(4, 8)] == ["0", "1", "0", "1"]
    assert [envs[r]["LOCAL_RANK"] for r in range(4, 8)] == ["0", "1", "2", "3"]  # the machine's devices
    assert {e["WORLD_SIZE"] for e in envs.values()} == {"2"} and {e["MASTER_ADDR"] for e in envs.values()} == {"127.0.0.1"}
    assert envs[4]["MASTER_PORT"] == envs[5]["MASTER_PORT"] != envs[6]["MASTER_PORT"] == envs[7]["MASTER_PORT"]
    assert {e["ODYSSEY_STORE"] for e in envs.values()} == {address}
    exits = RemoteExits(store, every_s=0.0)
    assert [exits.code(r) for r in range(4, 8)] == [0, 0, 0, 0]


def test_a_joined_rank_answers_to_its_own_fence_and_exit_not_its_earlier_lifes(tmp_path: Path) -> None:
    """Rank 1 died and was fenced (late, as an agent that waits out a heartbeat timeout does) while its
    replacement was already up: the replacement ignores the old fence, obeys its own, and the agent reads its
    exit, not the earlier life's."""
    import threading

    from megatron_odyssey.launch import exits_reported
    from megatron_odyssey.runtime.control_plane import rank_fence_key
    from megatron_odyssey.runtime.joining import JoinRequests, announce

    store, address = _job_store(nproc=2, tp=1)
    report_exit(store, 1, -9)  # its earlier life's death, reported by its old machine
    codes: list[int] = []
    launcher = threading.Thread(target=lambda: codes.append(_join(tmp_path, address, 1, 1, sleep_s=120)), daemon=True)
    launcher.start()
    deadline = time.monotonic() + 60
    while not (tmp_path / "env1.json").exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = json.loads((tmp_path / "env1.json").read_text())["pid"]
    announce(store, 1, launched=True)  # (as the Megatron rank does, with its own pid)
    requests = JoinRequests()
    assert 1 in requests.poll(store) and requests.launched == {1}
    mine = RemoteRank(store, 1, RemoteExits(store, every_s=0.0, after=exits_reported(store)), joined_pid=pid)
    assert mine.fence_key == rank_fence_key(1, pid) != FENCE_KEY.format(1)
    store.set(FENCE_KEY.format(1), "1")  # the earlier life's fence, set late
    time.sleep(1.0)
    assert launcher.is_alive() and mine.exitcode is None
    mine.kill()
    mine.join(30)
    assert mine.exitcode == -9
    # its machine's launcher waits for the job's end (test_a_machine_whose_ranks_ended_waits_for_the_jobs_end)
    assert launcher.is_alive() and not codes
    store.set(FINISHED_KEY, "0")
    launcher.join(timeout=30)
    assert codes == [0]


# -- a node whose rank left stuck in a collective is started again (runtime.stuck_restart) --

LIVES = """
import json, os, signal, sys, time
ident = int(os.environ.get("ODYSSEY_JOIN_RANK") or os.environ["RANK"])
out, plan = sys.argv[1], dict(item.split(":") for item in sys.argv[2].split(";"))
life = sum(name.startswith(f"life{ident}.") for name in os.listdir(out))
keys = ["RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ODYSSEY_STORE", "ODYSSEY_JOIN_RANK"]
open(f"{out}/life{ident}.{life}.json", "w").write(json.dumps({**{k: os.environ.get(k) for k in keys}, "pid": os.getpid()}))
print(f"life {life} of rank {ident}", flush=True)
what = plan[str(ident)].split(",")[life]
if what == "ok":
    sys.exit(0)
if what == "kill":
    os.kill(os.getpid(), signal.SIGKILL)
if what == "wait":
    time.sleep(120)
import torch.distributed as dist
from megatron_odyssey.runtime.errors import ErrorRecord, leave_with
host, port = os.environ["ODYSSEY_STORE"].rsplit(":", 1)
record = ErrorRecord.stuck(ident, "step 3", "still inside gloo's send (a test's stand-in)", sys._getframe())
leave_with(dist.TCPStore(host, int(port), is_master=False), ident, record)
"""


def _machine_with_lives(tmp: Path, address: str, node_rank: int, nproc: int, plan: str, restarts: int = 2,
                        machine_0: bool = False):
    """Machine ``node_rank``'s launcher, its ranks started as at launch, each life of each rank doing what ``plan``
    says ("4:stuck,ok;5:ok,ok": rank 4's first life leaves stuck, with a real StuckInCollective record, its second
    ends well); its node agent (or machine 0's watch for stuck ranks) in a thread. Returns the thread and its codes."""
    import threading

    from megatron_odyssey.launch import node_agent, restart_stuck_on_machine_0, start_ranks

    (tmp / "out").mkdir(parents=True, exist_ok=True)
    script = tmp / "lives.py"
    script.write_text(LIVES)
    port = int(address.rsplit(":", 1)[1])
    args = parse(["--nnodes", "4", "--node-rank", str(node_rank), "--nproc-per-node", str(nproc), "--master-port",
                  str(port - 1), "--no-standby", "--workdir", str(tmp / "logs"), "--stuck-restarts", str(restarts),
                  str(script), str(tmp / "out"), plan])
    local = start_ranks(args)
    codes: list[int] = []
    if machine_0:
        stop, thread = restart_stuck_on_machine_0(args, local)
        return thread, codes, local, stop
    import torch.distributed as dist

    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=timedelta(seconds=10))
    thread = threading.Thread(target=lambda: codes.append(node_agent(args, local, client)), daemon=True)
    thread.start()
    return thread, codes, local, None


def _lives(tmp: Path, ident: int) -> list[dict]:
    out = tmp / "out"
    return [json.loads((out / f"life{ident}.{n}.json").read_text())
            for n in range(sum(p.name.startswith(f"life{ident}.") for p in out.iterdir()))]


def _until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def test_a_node_whose_rank_left_stuck_is_started_again_to_join_the_running_job(tmp_path: Path,
                                                                              capfd: pytest.CaptureFixture) -> None:
    """Machine 2 holds one node of two tensor-parallel ranks. Rank 4 leaves stuck in a collective (exit 13, a
    StuckInCollective record); rank 5 leaves with 0 (its node has no place in the next generation). The process was
    stuck, not the machine: the launcher starts both ranks again as a machine that comes back does (a private world
    of the node's two ranks, the global rank each joins as, the job's store), their logs going on after the first
    lives'. With ``--stuck-restarts 1``, when rank 4 is stuck again, the node is not started a third time, and the
    terminal says why; every exit of both lives reaches the agent, and the launcher then exits with the job's code."""
    from megatron_odyssey.launch import EXITS_KEY

    store, address = _job_store(nproc=8, tp=2)
    thread, codes, local, _ = _machine_with_lives(tmp_path, address, 2, 2, "4:stuck,stuck;5:ok,ok", restarts=1)
    try:
        _until(lambda: store.check([EXITS_KEY]) and store.get(EXITS_KEY).decode().count(";") == 4)
        assert sorted(filter(None, store.get(EXITS_KEY).decode().split(";"))) == ["4:13", "4:13", "5:0", "5:0"]
        first, second = zip(*(_lives(tmp_path, r) for r in (4, 5)))
        assert [(e["RANK"], e["WORLD_SIZE"], e["ODYSSEY_JOIN_RANK"]) for e in first] == [("4", "8", None),
                                                                                       ("5", "8", None)]
        assert [(e["RANK"], e["WORLD_SIZE"], e["ODYSSEY_JOIN_RANK"]) for e in second] == [("0", "2", "4"),
                                                                                        ("1", "2", "5")]
        assert second[0]["MASTER_ADDR"] == "127.0.0.1" and second[0]["MASTER_PORT"] == second[1]["MASTER_PORT"]
        assert {e["ODYSSEY_STORE"] for e in second} == {address}
        assert len(_lives(tmp_path, 4)) == 2  # (not a third time)
        log = (tmp_path / "logs" / "rank4.log").read_text()
        assert log.index("life 0 of rank 4") < log.index("rank 4 started again") < log.index("life 1 of rank 4")
        time.sleep(0.5)
        assert thread.is_alive() and not codes  # waits for the job's end, as any machine whose rank failed
        store.set(FINISHED_KEY, "0")
        thread.join(30)
        assert codes == [0]
        err = capfd.readouterr().err
        assert re.search(r"\[odyssey launch node 2\] rank\(s\) \[4\] left stuck in a collective \(rank 4 in "
                         r".*lives.py:\d+ in <module> \(step 3\)\); the process was stuck, not the machine: starting "
                         r"node 2's rank\(s\) \[4, 5\] again to join the running job \(restart 1\)", err), err
        assert ("rank(s) [4] left stuck in a collective again; node 2 was started again 1 time(s) already "
                "(--stuck-restarts 1): the job goes on without it") in err, err
    finally:
        for p in local.values():
            p.kill()


def test_a_node_whose_other_rank_died_is_not_started_again(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """Rank 4 leaves stuck, but rank 5 of its node was killed: that is the failure the job recovers from, and the
    node stays out. So does a node with --stuck-restarts 0."""
    from megatron_odyssey.launch import EXITS_KEY

    for plan, restarts, said in (("4:stuck;5:kill", 2, "but node 2's rank(s) [5] ended otherwise (exit [-9]): not "
                                                       "starting the node again"),
                                 ("4:stuck;5:ok", 0, None)):
        store, address = _job_store(nproc=8, tp=2)
        thread, codes, local, _ = _machine_with_lives(tmp_path / str(restarts), address, 2, 2, plan, restarts=restarts)
        try:
            _until(lambda: store.check([EXITS_KEY]) and store.get(EXITS_KEY).decode().count(";") == 2)
            time.sleep(1.0)  # (a restart would have begun)
            assert [len(_lives(tmp_path / str(restarts), r)) for r in (4, 5)] == [1, 1]
            store.set(FINISHED_KEY, "0")
            thread.join(30)
            assert codes == [0]
            err = capfd.readouterr().err
            assert "again to join the running job" not in err, err
            assert said is None or said in err, err
        finally:
            for p in local.values():
                p.kill()


def test_machine_0s_rank_left_stuck_is_started_again_and_supervised_as_a_joined_machines(tmp_path: Path) -> None:
    """On machine 0 the agent supervises the ranks launched with the job itself: the launcher's watch only starts the
    node again, and neither reports nor says the first lives' exits (the agent does). The life started again is a
    joined rank's: its exit is reported in the store, and it obeys its own fence key (its pid's), not the rank's."""
    from megatron_odyssey.launch import EXITS_KEY
    from megatron_odyssey.runtime.control_plane import rank_fence_key
    from megatron_odyssey.runtime.process_probe import RANK_PID_KEY

    store, address = _job_store(nproc=4, tp=2)
    thread, _, local, stop = _machine_with_lives(tmp_path, address, 0, 2, "0:stuck,wait;1:ok,wait", machine_0=True)
    try:
        _until(lambda: all(len(_lives(tmp_path, r)) == 2 for r in (0, 1)))
        second = [_lives(tmp_path, r)[1] for r in (0, 1)]
        assert [(e["RANK"], e["ODYSSEY_JOIN_RANK"]) for e in second] == [("0", "0"), ("1", "1")]
        assert not store.check([EXITS_KEY])  # (the first lives' exits are the agent's to see)
        assert not store.check([RANK_PID_KEY.format(0)])
        assert [p.pid for p in (local[0], local[1])] == [e["pid"] for e in second]
        store.set(FENCE_KEY.format(0), "1")  # the earlier life's fence: not this one's
        time.sleep(1.0)
        assert local[0].exitcode is None
        store.set(rank_fence_key(0, second[0]["pid"]), "1")
        _until(lambda: store.check([EXITS_KEY]))
        assert store.get(EXITS_KEY).decode() == "0:-9;"
        store.set(FINISHED_KEY, "0")
        thread.join(30)
        assert not thread.is_alive()
    finally:
        stop.set()
        for p in local.values():
            p.kill()
