"""Megatron-LM's own ``pretrain_gpt.py``, with our patch applied, through real failures.

Needs a Megatron-LM checkout (branch core_r0.16.0 or a neighbour) with its Python requirements
importable: ``MEGATRON_LM_PATH=/path/to/Megatron-LM``; skipped otherwise. Four CPU ranks (gloo)
train a tiny Llama-style GPT on mock data (PP=2 x DP=2). The reference is stock Megatron-LM under
torchrun without ``--odyssey``; under ``odyssey-launch`` one rank is SIGKILLed mid-iteration, the
survivors recover in-process (rerouted or re-arranged pipelines) and finish, and every line
Megatron logs for an iteration (loss, grad norm, learning rate, consumed samples) equals the
reference's.
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MLM = os.environ.get("MEGATRON_LM_PATH")

pytestmark = pytest.mark.skipif(not MLM or not (Path(MLM) / "pretrain_gpt.py").exists(),
                                reason="set MEGATRON_LM_PATH to a Megatron-LM checkout to run pretrain_gpt.py")

ITERS = 5
TINY_GPT = [
    "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4", "--ffn-hidden-size", "176",
    "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1", "--global-batch-size", "8",
    "--train-iters", str(ITERS), "--lr", "1e-3", "--min-lr", "1e-4", "--lr-decay-style", "cosine",
    "--clip-grad", "1.0", "--weight-decay", "0.01", "--seed", "1234",
    "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "128",
    "--distributed-backend", "gloo", "--transformer-impl", "local", "--use-cpu-initialization",
    "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-gelu-fusion",
    "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--eval-iters", "0", "--eval-interval", "1000",
]
# what Megatron's training_log prints per iteration, minus timing
_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?learning rate: (\S+) .*?"
                  r"lm loss: (\S+) .*?grad norm: (\S+)")


def _env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_MAX_CONNECTIONS="1")


def _script(work: Path) -> Path:
    """pretrain_gpt.py from the checkout with patches/pretrain_gpt.py.patch applied, as a user would."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "pretrain_gpt.py").write_text((Path(MLM) / "pretrain_gpt.py").read_text())
    subprocess.run(["patch", "-p1", "-i", str(ROOT / "patches" / "pretrain_gpt.py.patch")], cwd=work, check=True,
                   capture_output=True)
    return work / "pretrain_gpt.py"


def _iterations(text: str) -> dict[int, tuple[str, ...]]:
    return {int(m.group(1)): m.groups()[1:] for m in _LOG.finditer(text)}


def _port(offset: int) -> int:
    return 20000 + (os.getpid() * 7) % 20000 + offset


def run_odyssey(work: Path, extra: list[str], port: int, nodes: int = 1) -> tuple[int, dict, str]:
    script = _script(work)
    report = work / "report.json"
    launch = [sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", str(4 // nodes),
              "--nnodes", str(nodes), "--master-port", str(port)]
    args = [str(script), *TINY_GPT, "--odyssey", "--odyssey-heartbeat-timeout", "10",
            "--odyssey-report", str(report), *extra]
    procs = [subprocess.Popen(launch + ["--node-rank", str(n), "--workdir", str(work / f"logs{n}")] + args,
                              env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(nodes)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    logs = "".join(outs) + "".join(p.read_text() for p in sorted(work.glob("logs*/rank*.log")))
    return max(p.returncode for p in procs), (json.loads(report.read_text()) if report.exists() else {}), logs


@pytest.fixture(scope="module")
def stock(tmp_path_factory: pytest.TempPathFactory) -> dict[int, tuple[str, ...]]:
    """Stock Megatron-LM (torchrun, no --odyssey): the fault-free reference."""
    work = tmp_path_factory.mktemp("stock")
    script = _script(work)
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
                           "--master-port", str(_port(0)), str(script), *TINY_GPT],
                          env=_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    its = _iterations(proc.stdout)
    assert sorted(its) == list(range(1, ITERS + 1))
    return its


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
def test_pretrain_gpt_survives_a_killed_rank(stock: dict, tmp_path: Path, policy: str) -> None:
    code, report, logs = run_odyssey(tmp_path, ["--odyssey-policy", policy, "--odyssey-inject-fault",
                                                "step=2,rank=1,phase=backward,kind=kill"],
                                     _port(10 if policy == "reroute" else 20))
    assert code == 0, logs[-4000:]
    assert [s["step"] for s in report["steps"]] == list(range(ITERS))  # training continued and finished
    (failure,) = report["failures"]
    assert failure["ranks"] == [1] and failure["policy"] == policy
    assert report["steps"][-1]["alive"] == 3
    assert _iterations(logs) == stock  # loss, grad norm, lr, consumed samples: as if nothing failed


def test_two_machines_rank_on_the_second_dies(stock: dict, tmp_path: Path) -> None:
    """Two odyssey-launch processes stand for two machines (coordinator + node agent)."""
    code, report, logs = run_odyssey(tmp_path, ["--odyssey-inject-fault", "step=3,rank=3,phase=forward,kind=kill"],
                                     _port(30), nodes=2)
    assert code == 0, logs[-4000:]
    (failure,) = report["failures"]
    assert failure["ranks"] == [3]
    assert [s["step"] for s in report["steps"]] == list(range(ITERS))
    assert _iterations(logs) == stock
