"""Kill real ranks mid-step; training must finish on the survivors with exactly the parameters of a
fault-free run (issue 5 acceptance). Every case trains 6 ranks (PP=2 x DP=3, or TP=2) for 4 steps
and compares the saved parameters with an independent single-process reference."""
from __future__ import annotations

import time

import pytest

from recovery_job import assert_exact, failure_story, reference_run, run


@pytest.fixture
def reference(fault_free_reference):
    return reference_run(fault_free_reference)


@pytest.mark.parametrize("phase", ["forward", "backward", "grad-sync", "optimizer"])
def test_kill_in_every_phase(reference, tmp_path, phase):
    params, report = run(tmp_path, [f"step=1,rank=4,phase={phase},kind=kill"])
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["ranks"] == [4] and failure["policy"] in ("reroute", "reconfigure")
    assert failure["recovery_s"] < 30, failure  # nobody waited out a timeout (120 s)
    assert report["steps"][-1]["alive"] == 5
    # a failure before commit redoes step 1 on the new plan; after commit (optimizer) it does not
    assert report["steps"][1]["policy"] == ("initial" if phase == "optimizer" else failure["policy"])


@pytest.mark.parametrize("phase, rank", [("forward", 1), ("grad-sync", 4)])
def test_stall_inside_a_collective_is_fenced_by_progress(reference, tmp_path, phase, rank):
    """The rank's main thread stops inside a barrier no peer joins while its process and heartbeat live on:
    only its lack of progress gives it away. It is the first to stop (its pipeline peers then wait on it), so
    it alone is fenced at the hard timeout, and training goes on exactly."""
    params, report = run(tmp_path, [f"step=1,rank={rank},phase={phase},kind=stall"], soft_timeout_s=3.0,
                         hard_timeout_s=8.0)
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["ranks"] == [rank]
    assert 8.0 <= failure["detection_s"] < 25, failure
    # C4D: it stopped inside a collective its peers never entered (and they wait on it)
    (diagnosis,) = report["diagnoses"]
    assert (diagnosis["kind"], diagnosis["ranks"], diagnosis["action"]) == ("comm-hang", [rank], "drop")


def test_stall_in_the_first_step_is_fenced_once_the_first_step_timeout_has_passed(reference, tmp_path):
    """A generation's first step is not judged by progress while it may still be connecting and compiling, but
    not forever: a rank stalled in the job's very first step (as a data loader that deadlocks at its fork) is
    named and fenced once --first-step-timeout has passed, and training goes on exactly."""
    params, report = run(tmp_path, ["step=0,rank=1,phase=forward,kind=stall"], soft_timeout_s=3.0, hard_timeout_s=6.0,
                         first_step_timeout_s=12.0)
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["ranks"] == [1] and failure["step"] == 0
    # judged from the first-step timeout on (12 s after the ranks started), fenced a hard timeout later
    assert 6.0 <= failure["detection_s"] < 40, failure


def test_a_rank_blocked_between_steps_is_fenced_at_the_hard_timeout(reference, tmp_path):
    """Rank 4's main thread blocks in its own work after step 1 (kind=block: a write to a hung file system) while
    its process and heartbeat live on; the others go on into step 2 and wait for it there. It is behind every other
    rank while none of them moves, so it is fenced after the hard timeout (before: only after --first-step-timeout,
    600 s here), with the stack it stopped in on the terminal, and training goes on exactly."""
    params, report = run(tmp_path, ["step=1,rank=4,phase=between,kind=block"], soft_timeout_s=3.0, hard_timeout_s=8.0)
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["ranks"] == [4] and failure["step"] == 2
    assert 8.0 <= failure["detection_s"] < 25, failure
    assert failure["ended"]["4"].startswith("was fenced (SIGKILL): stopped for ")
    assert "at between after step 1 while ranks [0, 1, 2, 3, 5] wait further on" in failure["ended"]["4"]
    (diagnosis,) = report["diagnoses"]
    assert (diagnosis["kind"], diagnosis["ranks"], diagnosis["action"]) == ("comm-hang", [4], "drop")


def test_hang_is_fenced_and_training_goes_on(reference, tmp_path):
    params, report = run(tmp_path, ["step=1,rank=2,phase=backward,kind=hang"])
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["ranks"] == [2]
    assert failure["detection_s"] >= 4.0  # caught by the heartbeat timeout (5 s), not by an error
    (diagnosis,) = report["diagnoses"]
    assert (diagnosis["kind"], diagnosis["ranks"], diagnosis["action"]) == ("hang", [2], "drop")


def test_two_nodes_of_different_stages_at_once(reference, tmp_path):
    params, report = run(tmp_path, ["step=2,rank=0,phase=forward,kind=kill", "step=2,rank=4,phase=forward,kind=kill"])
    assert_exact(reference, params, report)
    assert sorted(r for f in report["failures"] for r in f["ranks"]) == [0, 4]
    assert report["steps"][-1]["alive"] == 4


def test_second_failure_during_recovery(reference, tmp_path):
    params, report = run(tmp_path, ["step=1,rank=5,phase=backward,kind=kill", "step=1,rank=1,phase=recovery,kind=kill"])
    assert_exact(reference, params, report)
    assert sorted(r for f in report["failures"] for r in f["ranks"]) == [1, 5]
    assert report["steps"][-1]["alive"] == 4


def test_a_rank_stuck_in_its_recovery_is_fenced_once_every_other_has_joined(reference, tmp_path):
    """Rank 1 registers for the recovery from rank 5's death, then stops for good, its heartbeat beating on (its main
    thread blocks; seen on Megatron-LM core_r0.14.0 as a rank that said "recovering" and never joined). Every other
    member joins the next generation and waits for it to start. Before, nothing judged a rank inside a recovery: the
    others waited out their own wait for the start (--timeout), each then failed with "generation 1 never started"
    as if on an error of its own, and the job stopped as on a deterministic error. Now the agent names rank 1 at the
    soft timeout, fences it at the hard one, and the job recovers without it, exactly."""
    started = time.monotonic()
    fail = ["step=1,rank=5,phase=backward,kind=kill", "step=1,rank=1,phase=recovery,kind=block"]
    params, report = run(tmp_path, fail, soft_timeout_s=3.0, hard_timeout_s=6.0)
    assert_exact(reference, params, report)
    assert sorted(r for f in report["failures"] for r in f["ranks"]) == [1, 5], failure_story(report)
    (stuck,) = [d for d in report["diagnoses"] if d["ranks"] == [1]]
    assert stuck["kind"] == "hang" and "has not joined generation 1, which every other member has joined" in \
        stuck["evidence"], stuck
    assert report["steps"][-1]["alive"] == 4
    assert time.monotonic() - started < 100  # (not the ranks' 120 s wait for the start)


def test_death_of_global_rank_0(reference, tmp_path):
    params, report = run(tmp_path, ["step=2,rank=0,phase=backward,kind=kill"])
    assert_exact(reference, params, report)  # parameters saved by the lowest *surviving* rank


@pytest.mark.parametrize("policy", ["reroute", "reconfigure"])
def test_forced_policy_on_the_same_failure(reference, tmp_path, policy):
    params, report = run(tmp_path, ["step=1,rank=3,phase=backward,kind=kill"], policy=policy)
    assert_exact(reference, params, report)
    assert report["failures"][0]["policy"] == policy
    if policy == "reconfigure":
        assert report["final_plan"]["failed"] == []  # survivors re-arranged, no dead node in the layout
    else:
        assert report["final_plan"]["failed"] == [3] and report["final_plan"]["reroutes"]


def test_filled_reroute_trains_exactly(reference, tmp_path):
    """The planner's bubble-filling reroute, forced: stage 1 of every pipeline runs B then a deferred W."""
    params, report = run(tmp_path, ["step=1,rank=3,phase=backward,kind=kill"], policy="fill")
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["policy"] == "reroute" and failure["fill"] is True
    assert report["final_plan"]["fill"] is True and report["final_plan"]["failed"] == [3]


@pytest.mark.parametrize("policy", ["reconfigure", "fill"])
def test_overlapped_gradient_reduction_after_a_failure_trains_exactly(reference, tmp_path, policy):
    """--overlap-grad-reduce: each layer's all-reduce starts inside the step's last backward. In the filled
    reroute the ranks of stage 1 end on a deferred W and reduce after it; stage 0 overlaps. A second
    failure lands in the gradient sync, while overlapped all-reduces are in flight."""
    params, report = run(tmp_path, ["step=1,rank=3,phase=backward,kind=kill", "step=2,rank=1,phase=grad-sync,kind=kill"],
                         policy=policy, overlap_grad_reduce=True)
    assert_exact(reference, params, report)
    assert [f["ranks"] for f in report["failures"]] == [[3], [1]]
    first = report["failures"][0]
    assert first["fill"] is (policy == "fill")
    # every rank overlaps, but in the filled reroute those of stage 1 (nodes 4 and 5) end the step on a W
    assert first["overlapped"] == ([0, 1, 2] if policy == "fill" else [0, 1, 2, 4, 5])


def test_second_failure_inside_a_deferred_weight_gradient(reference, tmp_path):
    """Rank 5 (stage 1, a peer adopting rank 3's micro-batches) dies between a B and its W of step 2:
    its half-accumulated gradients die with it, step 2 is redone on the next plan, nothing is lost."""
    params, report = run(tmp_path, ["step=1,rank=3,phase=backward,kind=kill", "step=2,rank=5,phase=weight-grad,kind=kill"],
                         policy="fill")
    assert_exact(reference, params, report)
    assert [f["ranks"] for f in report["failures"]] == [[3], [5]]
    assert report["failures"][1]["step"] == 2 and report["steps"][-1]["alive"] == 4


def test_staggered_optimizer_rolls_back_a_step_updated_ahead_of_a_commit_that_never_came(reference, tmp_path):
    """ReCycle's staggered optimizer, forced after rank 3 dies: each rank updates as soon as its own gradients are
    synchronised. In step 2 rank 5 (stage 1, adopting rank 3's micro-batches) is held 2 s before its deferred W's
    and then dies in the gradient sync: stage 0 (ranks 0-2) has updated step 2 ahead of its commit by then and is
    in step 3; the commit never comes, so they roll step 2 back and it is redone. Parameters equal the fault-free
    run's."""
    params, report = run(tmp_path, ["step=1,rank=3,phase=backward,kind=kill", "step=2,rank=5,phase=weight-grad,kind=slow",
                                    "step=2,rank=5,phase=grad-sync,kind=kill"], policy="stagger")
    assert_exact(reference, params, report)
    first, second = report["failures"]
    assert (first["ranks"], first["kind"], first["fill"], first["stagger"]) == ([3], "stagger", True, True)
    assert first["rolled_back"] == []  # rank 3 died in the backward of step 1: nobody had updated step 1 yet
    assert second["ranks"] == [5] and second["step"] == 2
    assert second["rolled_back"] == [0, 1, 2]
    assert [s["step"] for s in report["steps"]] == [0, 1, 2, 3]  # step 2 committed once, after its redo


def test_normalised_reroute_moves_a_node_and_trains_exactly(reference, tmp_path):
    """Ranks 3 and 5 (stage 1 of pipelines 0 and 2) die in the same step: stage 1 keeps one replica of three.
    Failure normalisation moves a stage-0 node to stage 1 (it fetches those layers from the survivor), so
    each stage carries one failure, and the dead nodes' micro-batches are rerouted."""
    params, report = run(tmp_path, ["step=1,rank=3,phase=forward,kind=kill", "step=1,rank=5,phase=forward,kind=kill"],
                         policy="normalise")
    assert_exact(reference, params, report)
    final = report["final_plan"]
    assert sorted(final["failed"]) == [3, 5] and final["reroutes"]
    dead_stages = sorted(i for p in final["pipelines"] for i, s in enumerate(p["stages"]) if s["node"] in (3, 5))
    assert dead_stages == [0, 1]  # one failure per stage after normalisation
    assert any(f["policy"] == "reconfigure" and f["transfer_s"] > 0 for f in report["failures"])


def test_lost_layer_restores_the_checkpoint_and_says_so(reference, tmp_path):
    # PP=2 x DP=3 x TP=1: nodes 3, 4, 5 hold stage 1; killing all three leaves no copy of it
    fails = [f"step=3,rank={r},phase=forward,kind=kill" for r in (3, 4, 5)]
    params, report = run(tmp_path, fails, checkpoint_interval=2)
    assert_exact(reference, params, report)
    (failure,) = report["failures"]
    assert failure["policy"] == "restart"
    assert "no live copy" in failure["reason"] and "checkpoint" in failure["reason"]
    assert report["steps"][2].get("redone")  # step 2 came after the checkpoint of step 1: trained again


def test_a_fragile_plan_is_checkpointed_on_entry_so_a_forced_restart_loses_little(reference, tmp_path):
    """Ranks 3 and 4 die: the forced reroute leaves stage 1 on node 5 alone, a plan the next failure breaks, so
    the agent has the ranks checkpoint after its first step (step 1; the periodic checkpoint would come after
    step 3). Rank 5 then dies in step 3: the restart resumes from that checkpoint and redoes step 2 only."""
    fails = ["step=1,rank=3,phase=forward,kind=kill", "step=1,rank=4,phase=forward,kind=kill",
             "step=3,rank=5,phase=forward,kind=kill"]
    params, report = run(tmp_path, fails, policy="reroute", checkpoint_interval=4)
    assert_exact(reference, params, report)
    first, second = report["failures"]
    assert (first["policy"], first["checkpoint_on_entry"]) == ("reroute", True)
    assert (second["policy"], second["lost_steps"]) == ("restart", 1)  # without it: no checkpoint, 3 steps lost
    assert [(s["step"], bool(s.get("redone"))) for s in report["steps"]] == [(0, False), (1, False), (2, True),
                                                                              (3, False)]


def test_tensor_parallel_rank_dies(reference, tmp_path):
    params, report = run(tmp_path, ["step=1,rank=5,phase=backward,kind=kill"], nproc=8, tp=2)
    assert_exact(reference, params, report)
    assert report["failures"][0]["ranks"] == [4, 5] or report["failures"][0]["ranks"] == [5]
