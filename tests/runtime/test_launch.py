"""odyssey-launch without Megatron-LM: torchrun's environment, exit handling, bad arguments, and the
node agent's exit reports and fencing over the store (real processes, real TCPStore)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path

import pytest

from megatron_odyssey.launch import FENCE_KEY, RemoteExits, RemoteRank, parse, report_exit

ENV_DUMP = """
import json, os, sys
keys = ["RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "ODYSSEY_STORE"]
open(sys.argv[1] + "/env" + os.environ["RANK"] + ".json", "w").write(json.dumps({k: os.environ[k] for k in keys}))
sys.exit(int(sys.argv[2]) if os.environ["RANK"] == "1" else 0)
"""


def _launch(tmp: Path, exit_code_of_rank1: int, port: int) -> subprocess.CompletedProcess:
    script = tmp / "job.py"
    script.write_text(ENV_DUMP)
    return subprocess.run([sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "3",
                           "--master-port", str(port), "--workdir", str(tmp / "logs"), str(script), str(tmp),
                           str(exit_code_of_rank1)], capture_output=True, text=True, timeout=120)


def test_ranks_get_torchruns_environment_and_a_plain_job_passes(tmp_path: Path) -> None:
    port = 31000 + os.getpid() % 1000
    proc = _launch(tmp_path, 0, port)
    assert proc.returncode == 0, proc.stderr
    envs = [json.loads((tmp_path / f"env{r}.json").read_text()) for r in range(3)]
    assert [e["RANK"] for e in envs] == ["0", "1", "2"] and {e["WORLD_SIZE"] for e in envs} == {"3"}
    assert {e["MASTER_PORT"] for e in envs} == {str(port)}
    assert {e["ODYSSEY_STORE"] for e in envs} == {f"127.0.0.1:{port + 1}"}  # the agent's store


def test_a_rank_that_dies_before_training_fails_the_job_with_its_log(tmp_path: Path) -> None:
    proc = _launch(tmp_path, 3, 32000 + os.getpid() % 1000)
    assert proc.returncode == 1
    assert "rank(s) [1] exited [3] before training started" in proc.stderr


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
                           "--master-port", str(33000 + os.getpid() % 1000), "--workdir", str(tmp_path / "logs"),
                           str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "before training started" in proc.stderr
    assert proc.stderr.count("Traceback (most recent call last)") == 2  # each rank's own error, not just the first
    assert "ValueError: rank one's bad config" in proc.stderr and "KeyError: \"rank two's missing key\"" in proc.stderr
    assert "in set_up" in proc.stderr and str((tmp_path / "logs").resolve()) in proc.stderr


@pytest.mark.parametrize("argv, message", [
    (["--nproc-per-node", "0", "x.py"], "--nproc-per-node must be >= 1"),
    (["--nnodes", "2", "--node-rank", "2", "x.py"], "outside 0..1"),
])
def test_bad_arguments(argv: list[str], message: str, capsys: pytest.CaptureFixture) -> None:
    with pytest.raises(SystemExit):
        parse(argv)
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
