"""Every Megatron-LM release the adaptor knows, each with its own megatron.core: stock ``pretrain_gpt.py``
(no ``--odyssey``) is the reference, and the same job under ``odyssey-launch`` with one rank SIGKILLed
mid-iteration trains exactly as it (loss and grad norm to the printed digit, learning rate, samples), also
when the lost machine comes back (`odyssey-launch --join`), with --dataloader-type cyclic, and with the
distributed optimizer (also with both overlaps) through two kills, evaluating during training, and with tied
embeddings, and in fp16 with a dynamic loss scale (through a kill, and taking back a machine).

Needs checkouts: ``MEGATRON_LM_CHECKOUTS=/path/core_r0.12.0:/path/core_r0.19.0:...`` (``os.pathsep``
separated; ``git archive`` of each branch is enough), plus Megatron-LM's own requirements (``einops``
for core_r0.12.0). Skipped otherwise. About 80 s per checkout and policy on 2 cores.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from megatron_odyssey.megatron_lm.versions import KNOWN_RELEASES, stock_save_blocker
from megatron_odyssey.testing.ports import job_port
from megatron_odyssey.testing.megatron_lm_job import (NVML_STAND_IN, job_env, release_minor, run_odyssey, run_stock,
                                                      same_evaluations, same_training, same_training_where_logged,
                                                      tiny_gpt_flags_for, with_batch_ramp, with_evaluation)

CHECKOUTS = [p for p in os.environ.get("MEGATRON_LM_CHECKOUTS", "").split(os.pathsep) if p]

pytestmark = pytest.mark.skipif(not CHECKOUTS, reason="set MEGATRON_LM_CHECKOUTS to Megatron-LM checkouts")

ITERS = 5


def _flags(checkout: str) -> list[str]:
    return tiny_gpt_flags_for(checkout, ITERS)


def _minor(checkout: str) -> int:
    return release_minor(checkout)


def _port(checkout: str, offset: int) -> int:
    # (consecutive releases' runs of one test, one after the other on a worker, take different halves of its block)
    return job_port(1000 * (_minor(checkout) % 2) + offset)


@pytest.fixture(scope="module")
def references() -> dict[str, dict]:
    """checkout -> stock Megatron-LM's logged iterations (run once per checkout)."""
    return {}


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_every_patch_of_the_release_applies(checkout: str) -> None:
    """The adaptor's registry finds every target this release's code has, with the checkout's own megatron.core."""
    probe = ("import megatron_odyssey.megatron_adaptor as a; from megatron_odyssey.megatron_lm import patches as p; "
             "v = p.installed_version(); assert v.known, v; print(repr(p.missing_patches(v.minor)))")
    out = subprocess.run([sys.executable, "-c", probe], env=job_env(checkout), capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "{}", out.stdout


def _stock(checkout: str, references: dict, tmp: pytest.TempPathFactory) -> dict:
    if checkout not in references:
        job = run_stock(checkout, tmp.mktemp("stock"), _flags(checkout), _port(checkout, 0))
        assert job.returncode == 0, job.tail()
        references[checkout] = job.iterations()
        assert sorted(references[checkout]) == list(range(1, ITERS + 1))
    return references[checkout]


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_trains_as_stock_through_a_kill(checkout: str, policy: str, references: dict,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    assert _minor(checkout) in KNOWN_RELEASES, f"{checkout} is not a release the adaptor knows"
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp(policy), [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", policy,
        "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(checkout, 10 if policy == "reroute" else 20))
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["policy"] == policy
    assert same_training(job.iterations(), stock), (job.iterations(), stock)


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_fences_a_rank_blocked_in_training_log(checkout: str, references: dict,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 blocks in its own work in this release's training_log (kind=block) while the others wait in its
    first collective: the only rank at that stop outside the collective, it is fenced after the hard timeout, and
    the job trains as stock."""
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp("blocked"), [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10", "--odyssey-soft-timeout", "5",
        "--odyssey-hard-timeout", "10", "--odyssey-inject-fault", "step=2,rank=1,phase=log,kind=block"],
        _port(checkout, 660))
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and 10.0 <= failure["detection_s"] < 20, failure
    assert "wait in a collective there that it has not entered" in failure["ended"]["1"]
    assert same_training(job.iterations(), stock), (job.iterations(), stock)


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_writes_the_final_checkpoint_through_a_kill_after_the_last_iteration(
        checkout: str, references: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 killed once this release's train() has returned, at pretrain's barrier (print_datetime) before the
    final save: the survivors recover there and write iteration 5's checkpoint, which --save-interval 2 leaves to
    that save. (Where this release's own save cannot work beside the numpy and torch installed - core_r0.12-0.15
    under numpy 2, core_r0.12 under a torch whose checkpoint writer needs serialization_format - stock cannot save,
    and the job ends without --save, the barrier alone.)"""
    stock = _stock(checkout, references, tmp_path_factory)
    work = tmp_path_factory.mktemp("end")
    saves = stock_save_blocker(_minor(checkout)) is None
    job = run_odyssey(checkout, work, [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10",
        *(["--save", str(work / "ckpt"), "--save-interval", "2"] if saves else []),
        "--odyssey-inject-fault", f"step={ITERS - 1},rank=1,phase=end,kind=kill"], _port(checkout, 690))
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["step"] == ITERS, failure
    assert "print_datetime's barrier of iteration 5 was interrupted by a failure" in job.logs
    assert same_training(job.iterations(), stock), (job.iterations(), stock)
    if saves:
        assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_writes_again_a_checkpoint_a_kill_interrupted(checkout: str, references: dict,
                                                              tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 1 killed inside iteration 2's interval save (--save-interval 2): the survivors recover and write it
    again in the new layout, through this release's save_checkpoint_and_time (from core_r0.19.0 on it passes the
    process groups it reads off the model: the redo must read them again, not reuse generation 0's), then train
    on as stock and write the final checkpoint. (Skipped where stock cannot save, see above.)"""
    stock = _stock(checkout, references, tmp_path_factory)
    work = tmp_path_factory.mktemp("save")
    job = run_odyssey(checkout, work, [*_flags(checkout), "--save", str(work / "ckpt"), "--save-interval", "2",
                                       "--odyssey-inject-fault", "step=1,rank=1,phase=save,kind=kill"],
                      _port(checkout, 760))
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1], failure
    assert "the checkpoint save of iteration 2 was interrupted by a failure; the survivors run it again" in job.logs
    assert same_training(job.iterations(), stock), (job.iterations(), stock)
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == str(ITERS)
    assert (work / "ckpt" / "iter_0000002").is_dir() and (work / "ckpt" / "iter_0000004").is_dir()


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_refuses_at_start_up_a_save_it_cannot_write_here(checkout: str,
                                                                  tmp_path_factory: pytest.TempPathFactory) -> None:
    """Where this release's own torch_dist save cannot work beside the numpy and torch installed (core_r0.12-0.15
    under numpy 2: numpy.product; core_r0.12 under a torch whose writer needs serialization_format), stock trains
    until its first save and dies there, losing every iteration before it. --odyssey refuses --save at start-up
    instead, on the terminal, naming the cause and the way out, before any rank trains."""
    why = stock_save_blocker(_minor(checkout))
    if why is None:
        pytest.skip("this release saves beside the numpy and torch installed")
    work = tmp_path_factory.mktemp("unsaveable")
    job = run_odyssey(checkout, work, [*_flags(checkout), "--save", str(work / "ckpt"), "--save-interval", "2"],
                      _port(checkout, 780), refusal_expected=True)
    terminal = (work / "console0.txt").read_text()
    assert job.returncode != 0 and "--save cannot work in this environment" in terminal, job.tail()
    assert why.split(":")[0] in terminal and "leave out --save" in terminal
    assert job.iterations() == {} and not (work / "ckpt").exists()


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_exits_with_its_exit_code_through_a_kill_in_the_barrier_before_exiting(
        checkout: str, references: dict, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--exit-interval 3: the exit check saves iteration 3 and decides to exit; from 0.18 on train() then passes a
    world barrier before sys.exit, where rank 1 is killed. Unguarded, the survivors would leave with its error
    (exit 1) instead of the job's exit code; now they recover there, pass it again, and leave with 0, the exit's
    checkpoint the latest."""
    if _minor(checkout) < 18:
        pytest.skip("train() passes no barrier before exiting before core_r0.18.0")
    stock = _stock(checkout, references, tmp_path_factory)
    work = tmp_path_factory.mktemp("exit")
    job = run_odyssey(checkout, work, [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10", "--exit-interval", "3",
        "--save", str(work / "ckpt"), "--save-interval", "2",
        "--odyssey-inject-fault", "step=2,rank=1,phase=end,kind=kill"], _port(checkout, 710))
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["step"] == 3, failure
    assert "the barrier before exiting of iteration 3 was interrupted by a failure; the survivors run it" in job.logs
    assert same_training(job.iterations(), {i: stock[i] for i in range(1, 4)})
    assert (work / "ckpt" / "latest_checkpointed_iteration.txt").read_text().strip() == "3"


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_log_energy_through_kills(checkout: str, tmp_path_factory: pytest.TempPathFactory,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """--log-energy with NVML's stand-in (megatron.core.energy_monitor, 0.13+): a kill in iteration 3's backward and
    one in train()'s closing energy lap. Every iteration prints stock's energy per GPU, and the closing total is
    that of the two GPUs alive at the end: 2/4 of stock's."""
    if _minor(checkout) < 13:
        pytest.skip("--log-energy came with core_r0.13.0")
    monkeypatch.setenv("PYTHONPATH", str(NVML_STAND_IN))
    flags = [*_flags(checkout), "--log-energy"]
    reference = run_stock(checkout, tmp_path_factory.mktemp("energy_stock"), flags, _port(checkout, 720))
    assert reference.returncode == 0, reference.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("energy"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill",
        "--odyssey-inject-fault", f"step={ITERS - 1},rank=2,phase=end,kind=kill"], _port(checkout, 730))
    assert job.returncode == 0, job.tail()
    assert [f["ranks"] for f in job.report["failures"]] == [[1], [2]]
    assert sorted(reference.energy_per_gpu()) == list(range(1, ITERS + 1))
    assert job.energy_per_gpu() == reference.energy_per_gpu()
    (stock_total,) = reference.total_energy_mj()
    assert stock_total > 0 and job.total_energy_mj() == [stock_total * 2 / 4]
    assert same_training(job.iterations(), reference.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_staged_through_host_copies_trains_as_stock(checkout: str, references: dict,
                                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """This release's schedule, DDP and timers with every torch.distributed operation on a host copy (what ranks
    sharing one GPU run, ODYSSEY_SHARED_DEVICE; stage-all: host tensors too), through a kill: equal to stock run
    without staging."""
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp("staged"), [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10",
        "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(checkout, 700), shared="stage-all")
    assert job.returncode == 0, job.tail()
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1]
    assert same_training(job.iterations(), stock), (job.iterations(), stock)


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_logs_params_norm_as_stock_through_a_kill(checkout: str, tmp_path_factory: pytest.TempPathFactory
                                                          ) -> None:
    """--log-params-norm with this release's calc_params_l2_norm before the failure and the plan's norm after a
    reroute: every iteration's params norm, and everything else logged, equals stock's; the failure at the norm
    itself (phase=between: just before it) is recovered from and the norm computed in the new layout."""
    import re

    norms = re.compile(r"iteration\s+(\d+)/.*?params norm: ([0-9.E+-]+)")
    flags = [*_flags(checkout), "--log-params-norm"]
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_params_norm"), flags, _port(checkout, 670))
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("params_norm"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reroute",
        "--odyssey-inject-fault", "step=1,rank=1,phase=between,kind=kill"], _port(checkout, 680))
    assert job.returncode == 0, job.tail()
    expected = dict(norms.findall(stock.logs))
    assert sorted(expected) == [str(i) for i in range(1, ITERS + 1)]
    assert dict(norms.findall(job.logs)) == expected
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_takes_back_a_machine_that_comes_back(checkout: str, references: dict,
                                                      tmp_path_factory: pytest.TempPathFactory) -> None:
    """Four machines of one rank; machine 3 is lost in iteration 2 and comes back (``odyssey-launch --join``)
    after iteration 3: set up in a private world with this release's start-up, admitted, and equal to stock."""
    stock = _stock(checkout, references, tmp_path_factory)
    job = _machine_3_lost_and_back(checkout, _flags(checkout), tmp_path_factory.mktemp("join"), _port(checkout, 30))
    assert same_training(job.iterations(), stock), (job.iterations(), stock)


def _machine_3_lost_and_back(checkout: str, flags: list[str], work: Path, port: int) -> Any:
    """The job on four machines of one rank, machine 3 lost in iteration 2 and back after iteration 3: it ran to
    the end, and the machine was admitted before iteration 5 with the job's micro-batch calculator."""
    job = run_odyssey(checkout, work, [*flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault",
                                       "step=1,rank=3,phase=forward,kind=kill-machine", "--odyssey-rejoin", "3@2"],
                      port, nodes=4, join=(3,))
    assert job.returncode == 0, job.tail()
    (joined,) = job.report["joins"]
    assert joined["ranks"] == [3] and joined["step"] == 4
    assert job.global_batch_sizes() == {8}  # the joined rank logs the job's global batch
    return job


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_cyclic_data_loader_through_a_kill(checkout: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """--dataloader-type cyclic: the survivors read the dead rank's shuffled stream as this release's own sampler
    (megatron.legacy.data to core_r0.15.0, megatron.training.datasets after) gives it (testing.cyclic_check):
    equal to stock."""
    check = subprocess.run([sys.executable, "-m", "megatron_odyssey.testing.cyclic_check"], env=job_env(checkout),
                           capture_output=True, text=True, timeout=300)
    assert check.returncode == 0 and check.stdout.strip() == "ok", check.stdout + check.stderr[-3000:]
    flags = [*_flags(checkout), "--dataloader-type", "cyclic"]
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_cyclic"), flags, _port(checkout, 80))
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("cyclic"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reroute",
        "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(checkout, 90))
    assert job.returncode == 0, job.tail()
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_evaluates_as_stock_through_a_kill(checkout: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Evaluation every 2 iterations: rank 1 dies as the evaluation after iteration 2 begins; the survivors run it
    again over the new plan, forward-only, and answer this release's evaluate() in its own format (core_r0.12: a
    pair per micro-batch; later: one total), so it prints exactly stock's figures; the later evaluations, on a
    model trained through the failure, equal stock's to the printed digit."""
    flags = with_evaluation(_flags(checkout), 2, 2)
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_eval"), flags, _port(checkout, 100))
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("eval"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault", "step=1,rank=1,phase=eval,kind=kill"],
        _port(checkout, 110))
    assert job.returncode == 0, job.tail()
    assert len(stock.validations()) == 4 and job.validations()[0] == stock.validations()[0]
    assert same_evaluations(job.validations(), stock.validations()), (job.validations(), stock.validations())
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("optimizer", ["plain", "distributed"])
@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_tied_embeddings_through_a_kill(checkout: str, optimizer: str,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """Tied embeddings (Megatron's default for GPT): rank 3 (stage 1) dies and the survivors are re-arranged;
    the pair's copies are summed over every holder, and the release's own set-up of a rebuilt stage's copy
    (0.14+ asserts a last stage is not the first, which every stage is under our parallel_state) is replaced by
    marks only. With the distributed optimizer (two instances) the shared weight's state is then sharded over
    the three holders of either end (0.15+; the plain optimizer before), and a second kill (rank 2) reassembles
    it. Equal to stock."""
    flags = [f for f in _flags(checkout) if f != "--untie-embeddings-and-output-weights"]
    faults = ["step=1,rank=3,phase=backward,kind=kill"]
    if optimizer == "distributed" and _minor(checkout) == 12:
        # that release's distributed optimizer in two instances gives the pair another gradient than its plain
        # optimizer (norm 1.41x at the first iteration; docs/benchmarks.md): refused at start-up instead
        job = run_odyssey(checkout, tmp_path_factory.mktemp("tied"), [*flags, *DISTOPT], _port(checkout, 430))
        assert job.returncode != 0 and "core_r0.12.0's distributed optimizer in several instances" in job.logs
        return
    if optimizer == "distributed":
        flags, faults = [*flags, *DISTOPT], [*faults, "step=3,rank=2,phase=forward,kind=kill"]
    offset = 0 if optimizer == "plain" else 300
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_tied"), flags, _port(checkout, 120 + offset))
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("tied"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reconfigure",
        *[x for f in faults for x in ("--odyssey-inject-fault", f)]], _port(checkout, 130 + offset))
    assert job.returncode == 0, job.tail()
    assert [f["policy"] for f in job.report["failures"]] == ["reconfigure"] * len(faults)
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_batch_size_ramp_through_a_kill(checkout: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """A global batch growing 4, 4, 6, 6, then 8 from iteration 5 (--rampup-batch-size 4 2 16 to core_r0.17;
    core_r0.18 replaced it with --step-batch-size-schedule, thresholds in tokens of 32, and ignores the old flag):
    rank 1 dies in iteration 6, past the ramp, and the plan reads from where Megatron's own calculator says the
    ramp ended. Equal to stock."""
    flags = with_batch_ramp(_flags(checkout), _minor(checkout))
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_ramp"), flags, _port(checkout, 440))
    assert stock.returncode == 0, stock.tail()
    assert [stock.iterations()[i][0] for i in range(1, 7)] == ["4", "8", "14", "20", "28", "36"]
    job = run_odyssey(checkout, tmp_path_factory.mktemp("ramp"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault", "step=5,rank=1,phase=backward,kind=kill"],
        _port(checkout, 450))
    assert job.returncode == 0, job.tail()
    assert [f["ranks"] for f in job.report["failures"]] == [[1]]
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_ignores_the_old_ramp_flag_as_stock(checkout: str, references: dict,
                                                    tmp_path_factory: pytest.TempPathFactory) -> None:
    """core_r0.18.0 on ignore --rampup-batch-size (the global batch stays 8): so does --odyssey, through a kill.
    Before, every rank failed at start-up reading the ramp's end off Megatron's constant calculator."""
    if _minor(checkout) < 18:
        pytest.skip("up to core_r0.17 --rampup-batch-size ramps (test_release_batch_size_ramp_through_a_kill)")
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp("old_ramp"), [
        *_flags(checkout), "--rampup-batch-size", "4", "2", "16", "--odyssey-heartbeat-timeout", "10",
        "--odyssey-inject-fault", "step=2,rank=1,phase=backward,kind=kill"], _port(checkout, 770))
    assert job.returncode == 0, job.tail()
    assert job.global_batch_sizes() == {8}
    assert same_training(job.iterations(), stock), (job.iterations(), stock)


DISTOPT = ["--use-distributed-optimizer", "--num-distributed-optimizer-instances", "2"]


OVERLAPPED = ["--overlap-grad-reduce", "--overlap-param-gather"]


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_distributed_optimizer_through_two_kills(checkout: str, overlap: bool,
                                                         tmp_path_factory: pytest.TempPathFactory) -> None:
    """Eight ranks (PP=2 x DP=4) on this release's distributed optimizer in two instances: rank 1 killed (the
    survivors reassemble generation 0's shards and cut this release's optimizer down to replicated shards;
    before megatron-core 0.15, which has no layout-free checkpoint format for them, the plain optimizer takes
    over), then rank 5 (stage 1 reassembled from those): equal to this release's stock job. ``overlapped``: with
    --overlap-grad-reduce and --overlap-param-gather too, rank 5 dying in the forward that finishes the deferred
    weight all-gather; stock runs with --no-align-grad-reduce, without which it reduces each step's gradients
    twice (test_megatron_lm.py; Odyssey reduces them once)."""
    if _minor(checkout) == 12:
        pytest.skip("stock core_r0.12.0's distributed optimizer in two instances clips by sqrt(2) x the gradient norm "
                    "(each shard counted once per instance: 1.380 against the plain optimizer's 0.976 at iteration 1 "
                    "of this job), fixed in 0.13; after a failure Odyssey clips by the true norm, so the two differ")
    flags = [*_flags(checkout), *DISTOPT, *(OVERLAPPED if overlap else [])]
    stock = run_stock(checkout, tmp_path_factory.mktemp("stock_distopt"),
                      [*flags, *(["--no-align-grad-reduce"] if overlap else [])], _port(checkout, 60 if overlap else 40),
                      nproc=8)
    assert stock.returncode == 0, stock.tail()
    job = run_odyssey(checkout, tmp_path_factory.mktemp("distopt"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault", "step=1,rank=1,phase=backward,kind=kill",
        "--odyssey-inject-fault", "step=3,rank=5,phase=forward,kind=kill"], _port(checkout, 70 if overlap else 50),
        nproc=8)
    assert job.returncode == 0, job.tail()
    assert [f["ranks"] for f in job.report["failures"]] == [[1], [5]]
    shares = job.report["failures"][1]["optimizer_shares"]
    if _minor(checkout) >= 15:
        assert len(shares) == 6 and all(0 < v < 0.7 for v in shares.values()), shares
    else:
        assert shares == {}
    assert same_training(job.iterations(), stock.iterations()), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_fp16_loss_scale_through_a_kill(checkout: str, fp16_references: dict,
                                                tmp_path_factory: pytest.TempPathFactory) -> None:
    """--fp16 with a loss scale that overflows every third iteration; rank 1 is killed inside an overflowing
    iteration (logged iteration k is the fault's step k - 1): every iteration's loss scale and skip equal this
    release's stock job, losses and norms to 5
    significant digits (test_megatron_lm.test_fp16_loss_scale_skips_and_grows_as_stock)."""
    flags, stock = _fp16_stock(checkout, fp16_references, tmp_path_factory)
    scales = stock.loss_scales()
    overflows = [it for it, (_, skipped) in scales.items() if skipped]
    assert len(scales) == 8 and overflows, scales
    job = run_odyssey(checkout, tmp_path_factory.mktemp("fp16"), [
        *flags, "--odyssey-heartbeat-timeout", "10", "--odyssey-policy", "reroute",
        "--odyssey-inject-fault", f"step={overflows[-1] - 1},rank=1,phase=backward,kind=kill"], _port(checkout, 310))
    assert job.returncode == 0, job.tail()
    assert job.loss_scales() == scales
    assert same_training(job.iterations(), stock.iterations(), rel=1e-5), (job.iterations(), stock.iterations())


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_fp16_takes_back_a_machine(checkout: str, fp16_references: dict,
                                            tmp_path_factory: pytest.TempPathFactory) -> None:
    """--fp16: machine 3 is lost in iteration 2 and comes back after iteration 3; the admitted rank takes the loss
    scale and the schedule's step count from a rank that trained (loss_scale.hand_over) with this release's
    scaler and scheduler: every iteration's loss scale, skip and learning rate equal stock's."""
    flags, stock = _fp16_stock(checkout, fp16_references, tmp_path_factory)
    job = _machine_3_lost_and_back(checkout, flags, tmp_path_factory.mktemp("fp16_join"), _port(checkout, 320))
    assert job.loss_scales() == stock.loss_scales()
    assert same_training(job.iterations(), stock.iterations(), rel=1e-5), (job.iterations(), stock.iterations())


@pytest.fixture(scope="module")
def fp16_references() -> dict[str, Any]:
    """checkout -> (flags, stock job) of the fp16 cases (run once per checkout)."""
    return {}


def _fp16_stock(checkout: str, references: dict, tmp_path_factory: pytest.TempPathFactory) -> tuple[list[str], Any]:
    """The tiny job with a loss scale that overflows every few iterations, and this release's stock run of it."""
    from megatron_odyssey.megatron_lm.cpu_mode import with_fp16_loss_scaling

    if checkout not in references:
        flags = with_fp16_loss_scaling(tiny_gpt_flags_for(checkout, 8))
        stock = run_stock(checkout, tmp_path_factory.mktemp("stock_fp16"), flags, _port(checkout, 300))
        assert stock.returncode == 0, stock.tail()
        references[checkout] = (flags, stock)
    return references[checkout]


# -- Megatron's own fault injector (--fault-injector-*, core_r0.18.0 on; megatron_lm.fault_injection) -----------

#: Megatron's fault -> what the agent may tell of the rank's end: how its process ended ("was killed by SIGSEGV"; a
#: rank that stopped answering is fenced), or "error: T" (its own error record: an exception of type T caught where
#: Odyssey guards the call); an exception raised at a random moment may land inside or outside those
_FENCED = "was fenced (SIGKILL): missed heartbeats for 10.0 s"
MEGATRON_FAULTS = {
    "sigkill": {"was killed by SIGKILL"}, "sigterm": {"was killed by SIGTERM"}, "sigint": {"was killed by SIGINT"},
    "sigstop": {_FENCED}, "segfault": {"was killed by SIGSEGV"}, "os_abort": {"was killed by SIGABRT"},
    # (the GIL held by a thread burning CPU: the process runs, so its silence gets a second heartbeat timeout)
    "lock_gil": {_FENCED.replace("10.0 s", "20.0 s")}, "workload_exc": {"exited with code 1"},
    "async_exc": {"exited with code 1", "error: InjectedException"},
    "signal_exc": {"exited with code 1", "error: InjectedException"},
}


def _needs_megatron_fault_injector(checkout: str) -> None:
    if _minor(checkout) < 18:
        pytest.skip("Megatron's fault injector (megatron.core.fault_injector) is in core_r0.18.0 on")
    pytest.importorskip("nvidia_resiliency_ext.shared_utils.inject_fault",
                        reason="Megatron's fault injector needs nvidia-resiliency-ext 0.6+ (docs/benchmarks.md: how)")


def _megatron_fault(kind: str, rank: int, after_iteration: int) -> list[str]:
    """Megatron's flags: ``kind`` on ``rank`` as soon as ``after_iteration`` has ended."""
    return ["--fault-injector-ranks", str(rank), "--fault-injector-fault-types", kind, "--fault-injector-fault-delay",
            "0", "--fault-injector-delay-start-iteration", str(after_iteration)]


@pytest.mark.parametrize("fault", list(MEGATRON_FAULTS))
@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_recovers_from_megatron_fault_injector(checkout: str, fault: str, references: dict,
                                                       tmp_path_factory: pytest.TempPathFactory) -> None:
    """Megatron's injector, as it is, puts each fault a CPU can take on rank 1 after iteration 2 (signals, crashes in
    native code, the GIL held forever, exceptions in the main thread at any moment or in train()'s loop): the agent
    says on the terminal how the rank ended (or fences it for its missed heartbeats), and the survivors train equal
    to stock."""
    _needs_megatron_fault_injector(checkout)
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp(f"megatron_{fault}"), [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10", *_megatron_fault(fault, 1, 2)],
        _port(checkout, 500 + 10 * list(MEGATRON_FAULTS).index(fault)))
    assert job.returncode == 0, job.tail()
    assert f"FAULT INJECTION: Rank 1 will inject fault {fault.upper()}" in job.logs
    (failure,) = job.report["failures"]
    assert failure["ranks"] == [1] and failure["step"] >= 2, failure
    told = f"error: {failure['error']['type']}" if failure["error"] else failure["ended"].get("1")
    assert told in MEGATRON_FAULTS[fault], (told, failure)
    if told.startswith(_FENCED[:-len("10.0 s")]):
        assert f"rank 1 {told.split(': ', 1)[1]}: fencing it" in job.logs
        assert failure["detection_s"] >= 9.0, failure  # from its last heartbeat, not from when it was fenced
        # what its process was doing: stopped by SIGSTOP, or running with the GIL held
        assert f"rank 1's process: state {'T' if fault == 'sigstop' else 'R'}" in job.logs, \
            [line for line in job.logs.splitlines() if "[odyssey agent] rank 1" in line]
    elif not told.startswith("error"):
        assert failure["ended"] == {"1": told} and f"[odyssey agent] rank 1 {told}" in job.logs
    if fault in ("segfault", "os_abort"):  # faulthandler's dump, from the rank's log to the terminal
        assert "Fatal Python error: " in job.logs and "inject_fault.py" in job.logs.split(f"rank 1 {told}")[1]
    if told == "exited with code 1":
        assert "InjectedException" in job.logs.split(f"rank 1 {told}")[1]
    assert same_training_where_logged(job, stock), (job.iterations(), stock)


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_megatron_fault_injector_after_a_recovery(checkout: str, references: dict,
                                                          tmp_path_factory: pytest.TempPathFactory) -> None:
    """Rank 0 is killed in iteration 1; Megatron's injector is set up after iteration 3, on the survivors, whose
    world is renumbered 0..2: its target, launch-time rank 3, is still machine 3 (Megatron's own plan would find no
    rank 3 and fail on every rank), which it kills. Equal to stock."""
    _needs_megatron_fault_injector(checkout)
    stock = _stock(checkout, references, tmp_path_factory)
    job = run_odyssey(checkout, tmp_path_factory.mktemp("megatron_after"), [
        *_flags(checkout), "--odyssey-heartbeat-timeout", "10", "--odyssey-inject-fault",
        "step=1,rank=0,phase=backward,kind=kill", *_megatron_fault("sigkill", 3, 3)], _port(checkout, 650))
    assert job.returncode == 0, job.tail()
    first, second = job.report["failures"]
    assert first["ranks"] == [0] and first["step"] == 1
    assert second["ranks"] == [3] and second["step"] >= 3 and second["ended"] == {"3": "was killed by SIGKILL"}
    assert "fault_injection:" in job.logs and "FAULT INJECTION: Rank 3 will inject fault SIGKILL" in job.logs
    assert same_training_where_logged(job, stock), (job.iterations(), stock)


_SURVIVORS_PLAN_PROBE = """
import random
from megatron.core.fault_injector import FaultInjectorConfig
from nvidia_resiliency_ext.shared_utils.inject_fault import Fault
from megatron_odyssey.megatron_lm.fault_injection import survivors_plan

config = lambda **kw: FaultInjectorConfig(fault_injector_fault_types="sigkill,segfault",
                                          fault_injector_fault_probabilities="0,1", fault_injector_fault_delay=2.5, **kw)
# named ranks are launch-time ranks; one whose machine is gone gets nothing
assert survivors_plan(config(fault_injector_ranks="1,3"), [0, 1, 2], 4, seed=5) == (Fault.SEGFAULT, 2.5, [1])
assert survivors_plan(config(fault_injector_ranks="3"), [0, 1, 2], 4, seed=5) is None
# a number of ranks: drawn among the live ones but launch-time rank 0, the same on every survivor for one seed
want = random.Random(9).sample([2, 5, 7], k=2)
assert survivors_plan(config(fault_injector_num_ranks=2), [0, 2, 5, 7], 8, seed=9)[2] == want
assert survivors_plan(config(fault_injector_num_ranks=5), [0, 2, 5], 8, seed=9)[2] == random.Random(9).sample([2, 5], k=2)
try:
    survivors_plan(config(fault_injector_ranks="8"), [0, 1], 8, seed=1)
except ValueError as exc:
    assert "--fault-injector-ranks 8" in str(exc) and "world of 8" in str(exc), exc
else:
    raise AssertionError("a rank outside the job was accepted")
print("ok")
"""


@pytest.mark.parametrize("checkout", CHECKOUTS, ids=[Path(c).name for c in CHECKOUTS])
def test_release_survivors_draw_megatron_fault_plan_by_launch_time_rank(checkout: str) -> None:
    """The plan every survivor draws for itself after a failure (no collective a further failure could break), with
    this release's FaultInjectorConfig and get_fault / get_fault_delay."""
    _needs_megatron_fault_injector(checkout)
    out = subprocess.run([sys.executable, "-c", _SURVIVORS_PLAN_PROBE], env=job_env(checkout), capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stdout + out.stderr[-3000:]
