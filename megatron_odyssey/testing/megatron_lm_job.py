"""Run Megatron-LM's ``pretrain_gpt.py`` as a user would (our patch applied, stock torchrun or
``odyssey-launch``) and read what it logged. Shared by the Megatron-LM tests and benchmarks."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from .processes import kill_all

ROOT = Path(__file__).resolve().parents[2]  # the repository (patches/ beside the package)
PATCHES = ROOT / "patches"


def patch_for(megatron_lm: str | Path) -> Path:
    """``patches/pretrain_gpt.<branch>.patch`` for the checkout's megatron-core version."""
    from ..megatron_lm.versions import KNOWN_RELEASES

    info = (Path(megatron_lm) / "megatron" / "core" / "package_info.py").read_text()
    minor = int(re.search(r"^MINOR\s*=\s*(\d+)", info, re.M).group(1))
    path = PATCHES / f"pretrain_gpt.{KNOWN_RELEASES.get(minor, f'core_r0.{minor}.0')}.patch"
    if not path.exists():
        raise FileNotFoundError(f"no patch for megatron-core 0.{minor} in {PATCHES} (see patches/README.md)")
    return path

# one line of Megatron's training_log, minus timing
_LOG = re.compile(r"iteration\s+(\d+)/\s*\d+ \| consumed samples:\s+(\d+) .*?elapsed time per iteration \(ms\): "
                  r"(\S+) .*?learning rate: (\S+) .*?lm loss: (\S+) .*?grad norm: (\S+)")

# --fp16: a logged iteration's loss scale and skipped-iteration count (--log-interval 1: this iteration's). Not the
# absence of a loss: the first iteration of a train() call (a resumed or a joining rank's) does not reset the
# loss totals, so a skipped iteration after it shows the previous loss, in stock Megatron-LM too
_LOSS_SCALE = re.compile(r"iteration\s+(\d+)/[^\n]*?\| loss scale: (\S+) [^\n]*?number of skipped iterations:\s+(\d+)")

_BATCH = re.compile(r"iteration\s+\d+/[^\n]*?global batch size:\s+(\d+)")
_ENERGY = re.compile(r"iteration\s+(\d+)/[^\n]*?energy per GPU \(J/iter/GPU\): (\S+) \|")
_TOTAL_ENERGY = re.compile(r"Total training energy \(GPU\): (\S+) MJ")
#: NVML for --log-energy on a machine without a GPU (first on PYTHONPATH): 1 MJ per GPU per iteration
NVML_STAND_IN = Path(__file__).resolve().parent / "nvml_stand_in"
#: Weights & Biases without its service (first on PYTHONPATH, $WANDB_STAND_IN_LOG a folder): notes every call
WANDB_STAND_IN = Path(__file__).resolve().parent / "wandb_stand_in"
_UNLOGGED = re.compile(r"training_log of iteration (\d+) was interrupted by a failure after other survivors had left it")

# a line of Python's warnings module ("<file>:<line>: UserWarning: ..."); its next line repeats the call
_WARNING = re.compile(r"^\S+:\d+: \w*Warning: ")

# one of evaluate_and_print_results' lines: "validation loss at iteration 4 | lm loss value: ... | lm loss PPL: ..."
_VALIDATION = re.compile(r"validation loss at (.+?) \| lm loss value: (\S+) \| lm loss PPL: (\S+)")


@dataclass
class JobResult:
    returncode: int
    wall_s: float
    logs: str
    report: dict[str, Any] = field(default_factory=dict)
    cut_off: int | None = None  # run_odyssey(cut_off=CutOff(..., power_loss=False)): that machine's own exit code
    codes: list[int] = field(default_factory=list)  # run_odyssey: each launcher's exit code (the cut-off one's aside)

    def tail(self, chars: int = 4000) -> str:
        """The end of the terminal for a failed test's message, without Python's warnings (on core_r0.12.0 a
        rebuilt rank's missing-Apex and Transformer Engine warnings filled the last 4000 characters alone)."""
        kept, lines = [], self.logs.splitlines()
        for i, line in enumerate(lines):
            if _WARNING.search(line) or (line.strip().startswith("warnings.warn(") and i and _WARNING.search(lines[i - 1])):
                continue
            kept.append(line)
        return "\n".join(kept)[-chars:]

    def iterations(self) -> dict[int, tuple[str, ...]]:
        """iteration -> (consumed samples, learning rate, lm loss, grad norm) as Megatron printed them."""
        return {int(m.group(1)): (m.group(2), *m.groups()[3:]) for m in _LOG.finditer(self.logs)}

    def loss_scales(self) -> dict[int, tuple[str, bool]]:
        """iteration -> (loss scale as Megatron printed it, whether the iteration was skipped) (``--fp16``)."""
        return {int(m.group(1)): (m.group(2), int(m.group(3)) > 0) for m in _LOSS_SCALE.finditer(self.logs)}

    def global_batch_sizes(self) -> set[int]:
        """Every global batch size Megatron logged with an iteration."""
        return {int(m.group(1)) for m in _BATCH.finditer(self.logs)}

    def validations(self) -> list[tuple[str, str, str]]:
        """(where, lm loss, perplexity) of each evaluation Megatron printed, in order."""
        return [m.groups() for m in _VALIDATION.finditer(self.logs)]

    def energy_per_gpu(self) -> dict[int, str]:
        """iteration -> energy per GPU (J/iter/GPU) as Megatron printed it (``--log-energy``)."""
        return {int(m.group(1)): m.group(2) for m in _ENERGY.finditer(self.logs)}

    def total_energy_mj(self) -> list[float]:
        """Every "Total training energy" train() printed at its end (``--log-energy``), in MJ."""
        return [float(m.group(1)) for m in _TOTAL_ENERGY.finditer(self.logs)]

    def unlogged_iterations(self) -> set[int]:
        """Iterations whose log line the logging rank gave up on: a failure in its ``training_log`` after the other
        survivors had left the call (``megatron_lm.between_steps``)."""
        return {int(m.group(1)) for m in _UNLOGGED.finditer(self.logs)}

    def iteration_ms(self) -> dict[int, float]:
        return {int(m.group(1)): float(m.group(3)) for m in _LOG.finditer(self.logs)}


def _printed_ulp(text: str) -> float:
    """One unit in the last printed digit of ``5.228603E+00`` or ``1.256``."""
    mantissa, _, exponent = text.upper().partition("E")
    decimals = len(mantissa.split(".")[1]) if "." in mantissa else 0
    return 10.0 ** (int(exponent or 0) - decimals)


def same_training(a: dict[int, tuple[str, ...]], b: dict[int, tuple[str, ...]], rel: float = 0.0) -> bool:
    """Two runs logged the same iterations: equal consumed samples and learning rates, and losses and
    grad norms equal to within one printed digit (a different summation order may move the last one), or
    within ``rel`` of each other (bf16, see the test that uses it)."""
    if sorted(a) != sorted(b):
        return False
    for it in a:
        (sa, lra, la, ga), (sb, lrb, lb, gb) = a[it], b[it]
        if sa != sb or lra != lrb:
            return False
        for x, y in ((la, lb), (ga, gb)):
            allowed = max(1.01 * max(_printed_ulp(x), _printed_ulp(y)), rel * abs(float(y)))
            if abs(float(x) - float(y)) > allowed:
                return False
    return True


def same_training_where_logged(job: JobResult, stock: dict[int, tuple[str, ...]], rel: float = 0.0) -> bool:
    """:func:`same_training` for a failure at a moment nobody chose (Megatron's fault injector's): an iteration whose
    log line was given up (:meth:`JobResult.unlogged_iterations`) may be missing, every other one is there and equal."""
    logged = job.iterations()
    missing = set(stock) - set(logged)
    return missing <= job.unlogged_iterations() and same_training(logged, {i: stock[i] for i in stock if i in logged},
                                                                  rel)


def same_evaluations(a: list[tuple[str, str, str]], b: list[tuple[str, str, str]]) -> bool:
    """Two runs printed the same evaluations (where, lm loss, perplexity): in the same places, with losses equal
    to within one printed digit (a model trained through a failure may differ from stock's in its last bits) and
    perplexities exp(loss) as close as those losses allow (printed to more digits than a loss's fp32 ulp moves)."""
    def close(x: str, y: str, rel: float = 0.0) -> bool:
        return abs(float(x) - float(y)) <= 1.01 * max(_printed_ulp(x), _printed_ulp(y)) + rel * abs(float(x))

    return len(a) == len(b) and all(wa == wb and close(la, lb) and close(pa, pb, rel=1.01 * _printed_ulp(la))
                                    for (wa, la, pa), (wb, lb, pb) in zip(a, b))


def with_evaluation(flags: list[str], iters: int, interval: int) -> list[str]:
    """``flags`` evaluating ``iters`` iterations every ``interval`` (and at the end, on validation and test)."""
    out = list(flags)
    out[out.index("--eval-iters") + 1], out[out.index("--eval-interval") + 1] = str(iters), str(interval)
    return out


def patched_script(megatron_lm: str | Path, work: Path) -> Path:
    """``pretrain_gpt.py`` from a checkout with ``patches/pretrain_gpt.py.patch`` applied, in ``work``."""
    work.mkdir(parents=True, exist_ok=True)
    source = (Path(megatron_lm) / "pretrain_gpt.py").read_text()
    (work / "pretrain_gpt.py").write_text(source)
    if "megatron_odyssey.megatron_adaptor" not in source:  # a checkout the user already patched is taken as is
        subprocess.run(["patch", "-p1", "-i", str(patch_for(megatron_lm))], cwd=work, check=True, capture_output=True)
    return work / "pretrain_gpt.py"


def job_env(megatron_lm: str | Path, gpu: bool = False, shared: str = "") -> dict[str, str]:
    """The jobs' environment: the checkout and this project importable; the CPU unless ``gpu``; ``shared``: the
    ranks share one device (``ODYSSEY_SHARED_DEVICE``, see :func:`shared_device_flags`)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(megatron_lm), str(ROOT), os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", CUDA_DEVICE_MAX_CONNECTIONS="1")
    if not gpu:
        env["CUDA_VISIBLE_DEVICES"] = ""
    if shared:
        env["ODYSSEY_SHARED_DEVICE"] = shared
    return env


def release_minor(megatron_lm: str | Path) -> int:
    """The megatron-core minor version of a Megatron-LM checkout (16 for core_r0.16.0)."""
    info = (Path(megatron_lm) / "megatron" / "core" / "package_info.py").read_text()
    return int(next(line.split("=")[1] for line in info.splitlines() if line.startswith("MINOR")))


def tiny_gpt_flags_for(megatron_lm: str | Path, train_iters: int) -> list[str]:
    """:func:`~megatron_odyssey.megatron_lm.cpu_mode.tiny_gpt_flags` with a vocabulary this checkout's mock data
    fits: megatron-core 0.12-0.15's mock documents hold tokens up to 4095 (reduced modulo the vocabulary from 0.16
    on; with 128 an older release's embedding fails on "index out of range")."""
    from ..megatron_lm.cpu_mode import tiny_gpt_flags

    return tiny_gpt_flags(train_iters, vocab_size=4096 if release_minor(megatron_lm) <= 15 else 128)


def with_batch_ramp(flags: list[str], minor: int, samples: int = 52) -> list[str]:
    """``flags`` with a global batch growing 4, 4, 6, 6, then 8 from iteration 5 (``--rampup-batch-size 4 2 16`` to
    core_r0.17; core_r0.18 replaced it with ``--step-batch-size-schedule``, thresholds in tokens of 32, and ignores
    the old flag), in sample-based training, where alone Megatron ramps (52 samples: 8 iterations)."""
    at = flags.index("--train-iters")
    flags = [*flags[:at], "--train-samples", str(samples), *flags[at + 2:]]
    if minor >= 18:
        at = flags.index("--global-batch-size")
        return [*flags[:at], *flags[at + 2:], "--step-batch-size-schedule", "0:4 256:6 640:8"]
    return [*flags, "--rampup-batch-size", "4", "2", "16"]


def shared_device_flags(flags: list[str]) -> list[str]:
    """``flags`` for ranks sharing one GPU (``ODYSSEY_SHARED_DEVICE=1``, ``runtime.host_staging``): gloo, which
    takes several ranks on one device where NCCL refuses them."""
    out = list(flags)
    if "--distributed-backend" in out:
        out[out.index("--distributed-backend") + 1] = "gloo"
    else:
        out += ["--distributed-backend", "gloo"]
    return out


def gpu_gpt_flags(train_iters: int, layers: int = 8, hidden: int = 2048, heads: int = 16, seq: int = 2048,
                  micro_batch: int = 2, global_batch: int = 16, pipeline_parallel: int = 1) -> list[str]:
    """A Llama-style GPT in bf16 on GPUs with NCCL, with the fused kernels that need Apex or Transformer
    Engine (absent on our GPU machine) switched off; mock data."""
    return [
        "--num-layers", str(layers), "--hidden-size", str(hidden), "--num-attention-heads", str(heads),
        "--seq-length", str(seq), "--max-position-embeddings", str(seq), "--micro-batch-size", str(micro_batch),
        "--global-batch-size", str(global_batch), "--train-iters", str(train_iters), "--lr", "1e-4",
        "--min-lr", "1e-5", "--lr-decay-style", "cosine", "--clip-grad", "1.0", "--weight-decay", "0.01",
        "--seed", "1234", "--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", "32000",
        "--bf16", "--transformer-impl", "local", "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion",
        "--no-bias-swiglu-fusion", "--no-bias-dropout-fusion", "--no-rope-fusion", "--no-persist-layer-norm",
        "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu",
        "--untie-embeddings-and-output-weights", "--disable-bias-linear", "--attention-dropout", "0",
        "--hidden-dropout", "0", "--pipeline-model-parallel-size", str(pipeline_parallel), "--log-interval", "1",
        "--eval-iters", "0", "--eval-interval", "100000",
    ]


def skip_where_stock_cannot_save(megatron_lm: str | Path, flags: list[str]) -> None:
    """Skip the test when ``flags`` save and this checkout's own save cannot work beside the numpy and torch
    installed (``versions.stock_save_blocker``): stock would fail at its first save and ``--odyssey`` refuses at
    start-up, so there is nothing to compare (``test_megatron_lm_versions`` checks the refusal)."""
    from ..megatron_lm.versions import stock_save_blocker

    if "--save" in flags and (why := stock_save_blocker(release_minor(megatron_lm))):
        import pytest

        pytest.skip(f"stock Megatron-LM cannot save here: {why}")


def run_stock(megatron_lm: str | Path, work: Path, flags: list[str], port: int, nproc: int = 4,
              gpu: bool = False, shared: str = "") -> JobResult:
    """Stock Megatron-LM under torchrun, no ``--odyssey``; a test that saves where stock cannot is skipped."""
    skip_where_stock_cannot_save(megatron_lm, flags)
    script = patched_script(megatron_lm, work)
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(nproc),
                           "--master-port", str(port), str(script), *flags],
                          env=job_env(megatron_lm, gpu, shared), capture_output=True, text=True, timeout=900)
    return JobResult(proc.returncode, time.perf_counter() - t0, proc.stdout + proc.stderr)


def _until_logged(console: Path, iteration: int, running: Callable[[], bool], deadline: float) -> bool:
    """Whether Megatron logged ``iteration`` on ``console`` (looked for until it does, ``running`` turns false, or
    ``deadline`` passes)."""
    return _until_seen(lambda: [console], _logged(iteration), running, deadline)


def _logged(iteration: int) -> re.Pattern:
    return re.compile(rf"iteration\s+{iteration}/")


def _until_seen(files: Callable[[], list[Path]], line: re.Pattern, running: Callable[[], bool],
                deadline: float) -> bool:
    """Whether ``line`` is in any of ``files()`` (looked for until it is, ``running`` turns false, or ``deadline``
    passes)."""
    while running() and time.monotonic() < deadline:
        if any(line.search(f.read_text(errors="replace")) for f in files() if f.exists()):
            return True
        time.sleep(0.05)
    return False


@dataclass(frozen=True)
class CutOff:
    """A machine of a :func:`run_odyssey` job that goes silent once the last machine logged ``iteration``: machine
    ``node`` runs in ``space`` (a ``testing.network_namespace.NetworkNamespace``), whose link is then cut. With
    ``power_loss`` its processes are frozen as well (nothing it does reaches anyone any more); without, they run on,
    cut off (a partition), and the job's result holds that machine's own exit code (``JobResult.cut_off``)."""

    space: Any
    iteration: int
    node: int = 0
    power_loss: bool = True


@dataclass(frozen=True)
class Partition:
    """Machines of a :func:`run_odyssey` job behind a router (``testing.network_namespace.RoutedMachines``): machine
    (node rank) ``n`` runs in ``routed.machines[place[n]]``, the others on this host (machine 0 among them: every
    machine reaches it there). Once the last machine logged ``iteration``, the network between the machines
    ``between`` is cut, while each still reaches every other machine (a partition that is not transitive; a machine
    on this host stands for all of them there); ``rejecting``: the cut resets every connection between the two, as a
    firewall that rejects does, instead of dropping the packets."""

    routed: Any
    place: dict[int, int]
    iteration: int
    between: tuple[int, int]
    rejecting: bool = False


@dataclass(frozen=True)
class Freeze:
    """Every machine of a :func:`run_odyssey` job runs in ``space`` (a ``testing.network_namespace.Loopback``: one
    loopback, its sockets' buffers smaller than the tiny model's messages where the test asks). ``after_s`` after
    ``line`` (a regular expression) appears on any machine's terminal or rank log, every process of machine ``node``
    (its launcher and ranks) is stopped, SIGSTOP, for the rest of the job, while its kernel still holds its
    connections open: a machine whose processes hang whole, which neither its launcher nor anything else of its own
    can end. A peer sending to it stops inside the send, its message in flight; the harness kills the frozen
    processes at the end. ``thaw_after``: they go on instead (SIGCONT) once another machine logged that iteration (a
    VM paused by its host and resumed), and the job's code counts that machine's launcher too (where the job ends
    before, they are killed, as without)."""

    space: Any
    node: int
    line: str
    after_s: float = 0.0
    thaw_after: int | None = None


def _process_tree(pid: int) -> list[int]:
    """``pid`` and every process under it (ranks lead process groups of their own: a group signal would miss them)."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [pid, *(child.pid for child in root.children(recursive=True))]
    except psutil.NoSuchProcess:
        return []


def run_odyssey(megatron_lm: str | Path, work: Path, flags: list[str], port: int, nproc: int = 4,
                nodes: int = 1, gpu: bool = False, join: tuple[int, ...] = (),
                sigterm_after_iteration: int | None = None, shared: str = "",
                refusal_expected: bool = False, launcher_flags: tuple[str, ...] = (),
                cut_off: CutOff | None = None, partition: Partition | None = None,
                freeze: Freeze | None = None) -> JobResult:
    """``odyssey-launch`` on ``nodes`` launchers (each standing for a machine) with ``--odyssey``; ``join``:
    machines (by node rank) that come back, each a launcher with ``--join``, started once the job trains
    (it then sets itself up; when it asks to join is the job's ``--odyssey-rejoin``); ``sigterm_after_iteration``:
    SIGTERM to every launcher once Megatron logged that iteration (a scheduler stopping the job); ``shared``: as
    :func:`job_env`; ``launcher_flags``: more of odyssey-launch's own; ``cut_off``: a machine that goes silent
    (:class:`CutOff`); the job's code is then the other machines'; ``partition``: two machines that stop reaching
    each other (:class:`Partition`); ``freeze``: a machine whose processes all stop (:class:`Freeze`), the job's
    code then the other machines'. A test that saves where stock cannot is skipped,
    unless it expects that refusal."""
    if not refusal_expected:
        skip_where_stock_cannot_save(megatron_lm, flags)
    script = patched_script(megatron_lm, work)
    report = work / "report.json"
    launch = [sys.executable, "-m", "megatron_odyssey.launch", "--nproc-per-node", str(nproc // nodes),
              "--nnodes", str(nodes), "--master-port", str(port), *launcher_flags]
    args = [str(script), *flags, "--odyssey", "--odyssey-report", str(report)]
    t0 = time.perf_counter()
    # each launcher's terminal goes to a file: a pipe read after another launcher's end fills up and blocks the
    # launcher (and its rank's prints) while the job waits for that rank
    consoles: list[Path] = []

    space = cut_off.space if cut_off is not None else None
    if space is not None:  # (machine 0's address, as every machine reaches it)
        launch += ["--master-addr", space.ip if cut_off.node == 0 else space.host_ip]
    routed = partition.routed if partition is not None else None
    if routed is not None:
        assert 0 not in partition.place, "machine 0 runs on this host, which every routed machine reaches"
        launch += ["--master-addr", routed.machines[0].host_ip]

    def start(argv: list[str], console: Path, node: int | None = None) -> subprocess.Popen:
        consoles.append(console)
        env = job_env(megatron_lm, gpu, shared)
        if space is not None:  # (gloo finds its address from the interface: the namespace's, or ours towards it)
            inside = node == cut_off.node
            env["GLOO_SOCKET_IFNAME"] = space.link if inside else space.host_link
            argv = ["ip", "netns", "exec", space.name, *argv] if inside else argv
        if routed is not None:
            machine = routed.machines[partition.place[node]] if node in partition.place else None
            env["GLOO_SOCKET_IFNAME"] = machine.link if machine else routed.machines[0].host_link
            argv = ["ip", "netns", "exec", machine.name, *argv] if machine else argv
        if freeze is not None:  # (every machine on the namespace's loopback)
            env["GLOO_SOCKET_IFNAME"] = "lo"
            argv = freeze.space.argv(argv)
        with console.open("w") as out:
            return subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)

    procs = [start(launch + ["--node-rank", str(n), "--workdir", str(work / f"logs{n}")] + args,
                   work / f"console{n}.txt", n) for n in range(nodes)]
    address = work / "logs0" / "agent.address"  # written by machine 0's launcher once training began
    while join and not address.exists() and procs[0].poll() is None:
        time.sleep(0.2)
    procs += [start(launch + ["--node-rank", str(n), "--workdir", str(work / f"logs_join{n}"), "--join",
                              address.read_text().strip()] + args, work / f"console_join{n}.txt")
              for n in join if address.exists()]
    deadline, timed_out = time.monotonic() + 900, False
    if space is not None:
        if _until_logged(consoles[nodes - 1], cut_off.iteration, lambda: all(p.poll() is None for p in procs),
                         deadline):
            space.cut()
            for pid in space.pids() if cut_off.power_loss else []:
                os.kill(pid, signal.SIGSTOP)
        lost = procs.pop(cut_off.node)
    if routed is not None and _until_logged(consoles[nodes - 1], partition.iteration,
                                            lambda: all(p.poll() is None for p in procs), deadline):
        routed.cut(*(partition.place.get(n) for n in partition.between), rejecting=partition.rejecting)
    frozen: list[int] = []
    thawed = False
    if freeze is not None:
        def logs(but: int | None = None) -> list[Path]:  # (the last rank logs to its rank log after a failure)
            return [*(c for n, c in enumerate(consoles) if n != but),
                    *(f for n in range(nodes) if n != but for f in (work / f"logs{n}").glob("rank*.log"))]

        if _until_seen(logs, re.compile(freeze.line), lambda: all(p.poll() is None for p in procs), deadline):
            time.sleep(freeze.after_s)
            frozen = _process_tree(procs[freeze.node].pid)
            for pid in frozen:
                os.kill(pid, signal.SIGSTOP)
        thawed = bool(freeze.thaw_after is not None and frozen and
                      _until_seen(lambda: logs(but=freeze.node), _logged(freeze.thaw_after),
                                  lambda: procs[0].poll() is None, deadline))
        for pid in frozen if thawed else []:
            os.kill(pid, signal.SIGCONT)
        if not thawed:
            lost = procs.pop(freeze.node)
    if sigterm_after_iteration is not None and _until_logged(consoles[0], sigterm_after_iteration,
                                                             lambda: procs[0].poll() is None, deadline):
        for p in procs:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            timed_out = True
    if timed_out:  # every launcher and its ranks (each launcher leads its own process group)
        for p in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
    cut_off_code = None
    if space is not None:
        if not cut_off.power_loss:  # (what it does on its own is the test's: 120 s more than the others took)
            try:
                lost.wait(min(120.0, max(1.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                pass
            cut_off_code = lost.poll()  # (None: still running)
        kill_all(space.pids())  # the cut-off machine, frozen since it went silent (or still running)
        lost.wait(30)
    if freeze is not None and not thawed:
        kill_all(frozen or _process_tree(lost.pid))
        lost.wait(30)
    wall = time.perf_counter() - t0
    logs = "".join(c.read_text(errors="replace") for c in consoles)
    logs += "".join(p.read_text() for p in sorted(work.glob("logs*/rank*.log")))
    if timed_out:
        logs += "\n[run_odyssey] the job did not end in 900 s: killed\n"
    return JobResult(124 if timed_out else max(p.returncode for p in procs), wall, logs,
                     json.loads(report.read_text()) if report.exists() else {},
                     cut_off=cut_off_code, codes=[p.returncode for p in procs])


def tensorboard_scalars(log_dir: str | Path) -> dict[str, dict[int, float]]:
    """tag -> step -> value, from every event file in ``log_dir`` (as TensorBoard reads them: all writers'; a
    step written again keeps its last value). Needs the ``tensorboard`` package."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    out: dict[str, dict[int, float]] = {}
    for events in sorted(Path(log_dir).glob("events.out.tfevents.*"), key=lambda p: p.stat().st_mtime):
        accumulator = EventAccumulator(str(events))
        accumulator.Reload()
        for tag in accumulator.Tags()["scalars"]:
            out.setdefault(tag, {}).update({e.step: e.value for e in accumulator.Scalars(tag)})
    return out


def wandb_runs(log_dir: str | Path) -> list[dict[str, Any]]:
    """What the W&B stand-in noted, one entry per ``init``: its name, project, id and resume mode, the scalars
    logged to that run (key -> step -> value), and when it was opened and finished (``time.time()``; None: never,
    its process died), ordered by the first iteration each logged."""
    runs: list[dict[str, Any]] = []
    for notes in Path(log_dir).glob("*.jsonl"):
        run: dict[str, Any] | None = None  # this process's current run
        for line in notes.read_text().splitlines():
            record = json.loads(line)
            if record["call"] == "init":
                run = {"name": record["name"], "project": record["project"], "id": record["id"],
                       "resume": record["resume"], "scalars": {}, "opened": record["t"], "finished": None}
                runs.append(run)
            elif record["call"] == "log":
                assert run is not None, f"{notes}: logged before wandb.init"
                for key, value in record["data"].items():
                    run["scalars"].setdefault(key, {})[record["step"]] = value
            elif record["call"] == "finish" and run is not None:
                run["finished"] = record["t"]
    return sorted(runs, key=lambda run: min(run["scalars"].get("lm loss", {}) or [float("inf")]))


def read_torch_dist(checkpoint: str | Path) -> dict[str, Any]:
    """A torch_dist checkpoint directory (``iter_0000006``) as one flat dict, read without a process
    group: every tensor at its global shape (layers stacked), whichever ranks wrote it. Every other item (a
    pickled Python object: RNG states, the rerun state machine's, extra states) is there by name only, as None:
    unpickling one needs the writer's megatron-core, and a checkpoint core_r0.19.0 wrote names classes that the
    megatron-core installed beside the tests (0.16.1) does not have."""
    import torch
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    from ..megatron_lm.checkpoint import load_in_one_process

    reader = dcp.FileSystemReader(str(checkpoint))
    items = reader.read_metadata().state_dict_metadata
    tensors = {key: torch.empty(item.size, dtype=item.properties.dtype) for key, item in items.items()
               if isinstance(item, TensorStorageMetadata)}
    load_in_one_process(tensors, checkpoint)
    return {**dict.fromkeys(items), **tensors}


def max_tensor_difference(a: dict[str, Any], b: dict[str, Any]) -> float:
    """Largest absolute difference between the tensors of two checkpoints (inf when their keys differ)."""
    import torch

    if set(a) != set(b):
        return float("inf")
    diffs = [(a[k].float() - b[k].float()).abs().max().item() for k in a
             if isinstance(a[k], torch.Tensor) and a[k].numel()]
    return max(diffs, default=0.0)
