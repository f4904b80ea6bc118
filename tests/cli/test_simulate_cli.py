"""`odyssey simulate` against DESIGN.md's contract."""
import json

from megatron_odyssey.cli import main


def test_simulate_json_contract_and_outputs(tmp_path, capsys):
    argv = ["simulate", "--npus", "8", "--pp", "4", "--dp", "2", "--failure-rate", "0.05", "--hours", "2",
            "--seeds", "2", "--policies", "odyssey,oobleck,recycle,checkpoint,fault-scaled", "--out", str(tmp_path),
            "--json", "--global-batch", "16"]
    assert main(argv) == 0
    out = json.loads(capsys.readouterr().out)
    assert set(out) >= {"config", "policies", "ratios"}
    assert set(out["policies"]) == {"odyssey", "oobleck", "recycle", "checkpoint", "fault-scaled"}
    for stats in out["policies"].values():
        assert set(stats) >= {"avg_throughput", "samples", "downtime_s", "reconfigurations"}
    assert set(out["ratios"]) >= {"odyssey/oobleck", "odyssey/recycle", "odyssey/fault-scaled"}
    assert (tmp_path / "throughput.png").exists() and (tmp_path / "devices.png").exists()
    assert list(tmp_path.glob("timeseries_*.csv"))


def test_malformed_trace_line_is_reported_with_its_line_number(tmp_path, capsys):
    trace = tmp_path / "t.csv"
    trace.write_text("0,add,node1\n0,add,node2\n1000,explode,node1\n")
    assert main(["simulate", "--npus", "2", "--pp", "1", "--dp", "2", "--hours", "1", "--trace", str(trace)]) == 2
    err = capsys.readouterr().err
    assert f"{trace}:3:" in err
