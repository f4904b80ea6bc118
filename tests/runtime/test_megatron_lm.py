"""Megatron-LM's own ``pretrain_gpt.py``, with our patch applied, through a real failure.

Needs a Megatron-LM checkout (branch core_r0.16.0 or a neighbour): ``MEGATRON_LM_PATH=/path/to/Megatron-LM``;
skipped otherwise. Four CPU ranks (gloo) train a tiny Llama-style GPT on mock data under
``odyssey-launch``; one rank is SIGKILLed mid-iteration, the survivors recover in-process and
finish, and every iteration's loss equals the fault-free run's.
"""
from __future__ import annotations

import json
import os
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
    "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
    "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
    "--untie-embeddings-and-output-weights", "--disable-bias-linear",
    "--attention-dropout", "0", "--hidden-dropout", "0",
    "--pipeline-model-parallel-size", "2", "--log-interval", "1", "--eval-iters", "0",
]


def patched_script(tmp: Path) -> Path:
    """pretrain_gpt.py from the checkout with patches/pretrain_gpt.py.patch applied, as a user would."""
    work = tmp / "mlm"
    work.mkdir()
    (work / "pretrain_gpt.py").write_text((Path(MLM) / "pretrain_gpt.py").read_text())
    subprocess.run(["patch", "-p1", "-i", str(ROOT / "patches" / "pretrain_gpt.py.patch")], cwd=work, check=True,
                   capture_output=True)
    return work / "pretrain_gpt.py"


def run_job(tmp: Path, name: str, extra: list[str]) -> tuple[int, dict, str]:
    script = patched_script(tmp / name) if (tmp / name).mkdir() is None else None
    report = tmp / name / "report.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([MLM, str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="")
    port = 29000 + (os.getpid() % 1000) * 2 + (0 if name == "reference" else 10)
    cmd = [sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", "4", "--master-port", str(port),
           "--workdir", str(tmp / name / "logs"), str(script), *TINY_GPT, "--odyssey",
           "--odyssey-heartbeat-timeout", "10", "--odyssey-report", str(report), *extra]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    logs = proc.stdout + proc.stderr + "".join(p.read_text() for p in sorted((tmp / name / "logs").glob("rank*.log")))
    return proc.returncode, (json.loads(report.read_text()) if report.exists() else {}), logs


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    code, report, logs = run_job(tmp_path_factory.mktemp("mlm"), "reference", [])
    assert code == 0, logs[-4000:]
    return report


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
def test_pretrain_gpt_survives_a_killed_rank(reference: dict, tmp_path: Path, policy: str) -> None:
    code, report, logs = run_job(tmp_path, policy, ["--odyssey-policy", policy,
                                                    "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"])
    assert code == 0, logs[-4000:]
    assert [s["step"] for s in report["steps"]] == list(range(ITERS))  # training continued and finished
    (failure,) = report["failures"]
    assert failure["ranks"] == [1] and failure["policy"] == policy
    assert report["steps"][-1]["alive"] == 3
    ref = [s["loss"] for s in reference["steps"]]
    got = [s["loss"] for s in report["steps"]]
    assert got == pytest.approx(ref, rel=1e-5, abs=1e-6)  # the same global batches, the same model
