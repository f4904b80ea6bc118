"""Run Megatron-LM's ``pretrain_gpt.py`` as a user would (our patch applied, stock torchrun or
``odyssey-launch``) and read what it logged. Shared by the Megatron-LM tests and benchmarks."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PATCHES = ROOT / "patches"


def patch_for(megatron_lm: str | Path) -> Path:
    """``patches/pretrain_gpt.core_r0.MINOR.0.patch`` for the checkout's megatron-core version."""
    info = (Path(megatron_lm) / "megatron" / "core" / "package_info.py").read_text()
    minor = re.search(r"^MINOR\s*=\s*(\d+)", info, re.M).group(1)
    path = PATCHES / f"pretrain_gpt.core_r0.{minor}.0.patch"
    if not path.exists():
        raise FileNotFoundError(f"no patch for megatron-core 0.{minor} in {PATCHES} (0.12-0.16 are provided)")
    return path

# one line of Megatron's training_log, minus timing
_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?elapsed time per iteration \(ms\): "
                  r"(\S+) .*?learning rate: (\S+) .*?lm loss: (\S+) .*?grad norm: (\S+)")


@dataclass
class JobResult:
    returncode: int
    wall_s: float
    logs: str
    report: dict[str, Any] = field(default_factory=dict)

    def iterations(self) -> dict[int, tuple[str, ...]]:
        """iteration -> (consumed samples, learning rate, lm loss, grad norm) as Megatron printed them."""
        return {int(m.group(1)): (m.group(2), *m.groups()[3:]) for m in _LOG.finditer(self.logs)}

    def iteration_ms(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(3)) for m in _LOG.finditer(self.logs)}


def _printed_ulp(text: str) -> float:
    """One unit in the last printed digit of ``5.228603E+00`` or ``1.256``."""
    mantissa, _, exponent = text.upper().partition("E")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (int(exponent or 0) - decimals)


def same_training(a: dict[int, tuple[str, ...]], b: dict[int, tuple[str, ...]]) -> bool:
    """Two runs logged the same iterations: equal consumed samples and learning rates, and losses and
    grad norms equal to within one printed digit (a different summation order may move the last one)."""
    if sorted(a) != sorted(b):
        return False
    for it in a:
        (sa, lra, la, ga), (sb, lrb, lb, gb) = a[it], b[it]
        if sa != sb or lra != lrb:
            return False
        for x, y in ((la, lb), (ga, gb)):
            if abs(float(x) - float(y)) > 1.01 * max(_printed_ulp(x), _printed_ulp(y)):
                return False
    return True


def patched_script(megatron_lm: str | Path, work: Path) -> Path:
    """``pretrain_gpt.py`` from a checkout with ``patches/pretrain_gpt.py.patch`` applied, in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    (work / "pretrain_gpt.py").write_text((Path(megatron_lm) / "pretrain_gpt.py").read_text())
    subprocess.run(["patch", "-p1", "-i", str(patch_for(megatron_lm))], cwd=work, check=True, capture_output=True)
    return work / "pretrain_gpt.py"


def job_env(megatron_lm: str | Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([str(megatron_lm), str(ROOT), os.environ.get("PYTHONPATH", "")]),
                OMP_NUM_THREADS="1", CUDA_VISIBLE_DEVICES="", CUDA_DEVICE_MAX_CONNECTIONS="1")


def run_stock(megatron_lm: str | Path, work: Path, flags: list[str], port: int, nproc: int = 4) -> JobResult:
    """Stock Megatron-LM under torchrun, no ``--odyssey``."""
    script = patched_script(megatron_lm, work)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(port), str(script), *flags],
                          env=job_env(megatron_lm), capture_output=True, text=True, timeout=900)
    return JobResult(proc.returncode, time.perf_counter() - t0, proc.stdout + proc.stderr)


def run_odyssey(megatron_lm: str | Path, work: Path, flags: list[str], port: int, nproc: int = 4,
                nodes: int = 1) -> JobResult:
    """``odyssey-launch`` on ``nodes`` launchers (each standing for a machine) with ``--odyssey``."""
    script = patched_script(megatron_lm, work)
    report = work / "report.json"
    launch = [sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", str(nproc // nodes),
              "--nnodes", str(nodes), "--master-port", str(port)]
    args = [str(script), *flags, "--odyssey", "--odyssey-report", str(report)]
    t0 = time.perf_counter()
    procs = [subprocess.Popen(launch + ["--node-rank", str(n), "--workdir", str(work / f"logs{n}")] + args,
                              env=job_env(megatron_lm), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for n in range(nodes)]
    outs = [p.communicate(timeout=900)[0] for p in procs]
    wall = time.perf_counter() - t0
    logs = "".join(outs) + "".join(p.read_text() for p in sorted(work.glob("logs*/rank*.log")))
    return JobResult(max(p.returncode for p in procs), wall, logs,
                     json.loads(report.read_text()) if report.exists() else {})
