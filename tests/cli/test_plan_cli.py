"""`odyssey plan` against the README's contract: JSON shape, conventions, the exhaustive search's limits.
Bad input (exit code 2, one line naming the flag) is covered by test_cli_errors.py."""
import json
import subprocess
import sys
import time

import pytest

from megatron_odyssey.cli import main

BASE = ["plan", "--nodes", "8", "--pp", "2", "--dp", "4", "--layers", "16", "--global-batch", "32", "--micro-batch", "1"]


def test_plan_json_follows_the_contract(capsys):
    assert main([*BASE, "--failed", "3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"policy", "plan", "estimates", "candidates", "search_time_s"}
    assert set(out["estimates"]) >= {"step_time_s", "transition_time_s", "throughput", "score"}
    assert {c["policy"] for c in out["candidates"]} == {"reroute", "reconfigure", "restart"}
    for c in out["candidates"]:
        assert set(c) >= {"policy", "step_time_s", "transition_time_s", "score"}
    assert out["policy"] in ("reroute", "reconfigure")
    assert out["estimates"]["throughput"] == pytest.approx(32 / out["estimates"]["step_time_s"])
    nodes = [s["node"] for p in out["plan"]["pipelines"] for s in p["stages"]]
    if out["policy"] == "reconfigure":
        assert sorted(nodes) == [0, 1, 2, 4, 5, 6, 7]
    assert sum(p["micro_batches"] for p in out["plan"]["pipelines"]) == 32


def test_plan_exhaustive_and_table(capsys):
    small = ["plan", "--nodes", "6", "--pp", "2", "--dp", "3", "--layers", "6", "--global-batch", "12", "--micro-batch", "1"]
    assert main([*small, "--failed", "3", "--search", "exhaustive"]) == 0
    assert "Recovery candidates" in capsys.readouterr().out


def test_lost_stage_returns_restart_with_reason(capsys):
    assert main([*BASE, "--failed", "0,1,2,3", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["policy"] == "restart"
    assert "no live copy" in out["reason"]


def test_unknown_profile_field_exits_2(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"name": "x", "bogus_field": 1}))
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", *BASE, "--profile", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown profile field(s) ['bogus_field']" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_plan_and_simulate_accept_the_same_builtin_names(capsys):
    from megatron_odyssey.cli import build_parser, subparser
    from megatron_odyssey.planning.models import BUILTIN_MODELS
    from megatron_odyssey.sim import SimulationConfig

    for name in BUILTIN_MODELS:
        SimulationConfig(model=name)  # simulate --model accepts it
    assert main([*BASE, "--profile", "gpt3-medium-a100", "--failed", "3", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["policy"] in ("reroute", "reconfigure")
    help_text = subparser(build_parser(), "plan").format_help()
    assert all(name in help_text for name in BUILTIN_MODELS)


def test_layer_ranges_are_half_open_in_table_and_json(capsys):
    assert main([*BASE, "--failed", "3", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)["plan"]
    assert main([*BASE, "--failed", "3"]) == 0
    table = capsys.readouterr().out
    for p in plan["pipelines"]:
        for s in p["stages"]:
            start, end = s["layers"]
            assert f"{s['node']}[{start},{end})" in table  # JSON [0, 6] <-> table 0[0,6): layers 0..5
    first = plan["pipelines"][0]["stages"]
    assert first[0]["layers"][0] == 0 and first[-1]["layers"][1] == 16  # end is exclusive: 16 layers end at 16


BIG = ["plan", "--nodes", "32", "--pp", "4", "--dp", "8", "--layers", "32", "--global-batch", "64", "--micro-batch", "1",
       "--failed", "5", "--search", "exhaustive"]


def test_exhaustive_search_that_would_run_for_hours_is_refused_at_once(capsys):
    start = time.perf_counter()
    assert main(BIG) == 2
    assert time.perf_counter() - start < 5
    err = capsys.readouterr().err.strip()
    assert err.startswith("odyssey plan: error: --search exhaustive would score 1.4e+12 layouts")
    assert "--time-limit SECONDS" in err and len(err.splitlines()) == 1


def test_time_limit_cuts_the_search_short_and_says_so(capsys):
    start = time.perf_counter()
    assert main([*BIG, "--time-limit", "1", "--json"]) == 0
    assert time.perf_counter() - start < 1 + 3  # the limit plus heuristic seed, profile and output
    out = json.loads(capsys.readouterr().out)
    search = out["search"]
    assert search["mode"] == "exhaustive" and search["cut_short"] and not search["complete"]
    assert search["time_limit_s"] == 1 and search["layouts_done"] < search["layouts_total"]
    assert search["splits_done"] > 0
    assert out["policy"] in ("reroute", "reconfigure") and out["plan"] is not None  # the best found so far
    assert main([*BIG, "--time-limit", "0.5"]) == 0
    captured = capsys.readouterr()
    assert "exhaustive search cut short at --time-limit 0.5 s" in captured.out
    assert "best found so far" in captured.out
    assert "exhaustive search: 1.4e+12 layouts" in captured.err  # the size, up front, on stderr


def test_small_exhaustive_search_runs_to_completion(capsys):
    small = ["plan", "--nodes", "6", "--pp", "2", "--dp", "3", "--layers", "6", "--global-batch", "12",
             "--micro-batch", "1", "--failed", "3"]
    assert main([*small, "--search", "exhaustive", "--json"]) == 0
    exact = json.loads(capsys.readouterr().out)
    assert exact["search"]["complete"] and not exact["search"]["cut_short"]
    assert exact["search"]["layouts_done"] == exact["search"]["layouts_total"]
    assert main([*small, "--json"]) == 0
    heuristic = json.loads(capsys.readouterr().out)
    assert heuristic["search"] == {"mode": "heuristic", "complete": True, "cut_short": False}
    # the oracle is never slower than the heuristic; tests/planning hold the heuristic within 1% of it
    assert exact["estimates"]["step_time_s"] <= heuristic["estimates"]["step_time_s"] + 1e-12


def test_plan_and_simulate_never_import_torch():
    code = ("import sys; from megatron_odyssey.cli import main; "
            "main(['plan', '--nodes', '8', '--pp', '2', '--dp', '4', '--layers', '16', '--global-batch', '32', "
            "'--micro-batch', '1', '--failed', '3', '--json']); "
            "main(['simulate', '--npus', '8', '--pp', '4', '--dp', '2', '--hours', '0.2', '--failure-rate', '0.1', "
            "'--policies', 'odyssey', '--json']); "
            "assert 'torch' not in sys.modules, 'torch was imported'")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
