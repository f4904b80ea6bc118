"""`odyssey plan` against DESIGN.md's contract: JSON shape, exit code 2 on bad input."""
import json
import subprocess
import sys

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


@pytest.mark.parametrize("args,message", [
    (["--failed", "9"], "failed node(s) [9] not in the cluster"),
    (["--global-batch", "30"], "not divisible by micro-batch x DP"),
    (["--pp", "8", "--dp", "1", "--layers", "4"], "greater than the number of layers"),
    (["--nodes", "7"], "does not match PP x DP"),
    (["--failed", "x"], "comma-separated node ids"),
    (["--mtbf-hours", "0"], "--mtbf-hours must be positive"),
])
def test_bad_input_exits_2_with_a_specific_message(args, message, capsys):
    argv = list(BASE)
    for i in range(0, len(args), 2):
        if args[i] in argv:
            argv[argv.index(args[i]) + 1] = args[i + 1]
        else:
            argv += args[i:i + 2]
    assert main(argv) == 2
    assert message in capsys.readouterr().err


def test_unknown_profile_field_exits_2(tmp_path):
    bad = tmp_path / "profile.json"
    bad.write_text(json.dumps({"name": "x", "bogus_field": 1}))
    proc = subprocess.run([sys.executable, "-m", "megatron_odyssey.cli", *BASE, "--profile", str(bad)],
                          capture_output=True, text=True)
    assert proc.returncode == 2
    assert "unknown profile field(s) ['bogus_field']" in proc.stderr
