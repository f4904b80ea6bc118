"""`odyssey simulate` against the README's contract: JSON, outputs, the table, the plots.
Bad input (exit code 2, one line naming the flag) is covered by test_cli_errors.py."""
import json

import pytest

from megatron_odyssey.cli import main

SMALL = ["simulate", "--npus", "8", "--pp", "4", "--dp", "2", "--hours", "2", "--global-batch", "16"]


def test_simulate_json_contract_and_outputs(tmp_path, capsys):
    argv = [*SMALL, "--failure-rate", "0.05", "--seeds", "2", "--policies", "odyssey,oobleck,recycle,checkpoint,fault-scaled",
            "--out", str(tmp_path), "--json"]
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
    assert f"--trace {trace}:3:" in err


def test_a_failure_process_must_be_given(capsys):
    with pytest.raises(SystemExit) as exc:
        main(SMALL)
    assert exc.value.code == 2
    assert "one of the arguments --failure-rate --trace is required" in capsys.readouterr().err


def test_policy_names_are_never_truncated_off_a_terminal(monkeypatch, capsys):
    """rich takes 80 columns (or $COLUMNS) when stdout is not a terminal; the names must survive."""
    monkeypatch.setenv("COLUMNS", "80")
    policies = "odyssey,recycle-nofill,fault-scaled,odyssey-f1,checkpoint"
    assert main([*SMALL, "--hours", "0.5", "--failure-rate", "0.1", "--policies", policies]) == 0
    out = capsys.readouterr().out
    for name in policies.split(","):
        assert f"│ {name} " in out, out
    assert "…" not in out


def test_policy_names_are_never_truncated_in_a_narrow_terminal():
    from io import StringIO

    from rich.console import Console

    from megatron_odyssey.sim import SimulationConfig, run_simulation, summary_table

    names = ("odyssey", "recycle-nofill", "fault-scaled", "odyssey-f1")
    result = run_simulation(SimulationConfig(npus=8, pp=4, dp=2, hours=0.5, seeds=1, global_batch=16,
                                             policies=names, progress=False))
    buf = StringIO()
    Console(file=buf, width=60, force_terminal=True, color_system=None).print(summary_table(result))
    for name in names:
        assert name in buf.getvalue(), buf.getvalue()


def test_throughput_plot_draws_odyssey_on_top_and_distinct(tmp_path):
    from matplotlib import pyplot as plt
    from matplotlib.colors import to_hex

    from megatron_odyssey.sim import SimulationConfig, plots, run_simulation

    result = run_simulation(SimulationConfig(npus=8, pp=4, dp=2, hours=1, seeds=1, global_batch=16, progress=False,
                                             policies=("odyssey", "oobleck", "recycle", "fault-scaled")))
    fig = plots.throughput_figure(result, tmp_path / "throughput.png")
    try:
        ax = fig.axes[0]
        curves = [a for a in ax.lines + list(ax.collections) if a.get_linestyle() not in (":", "dotted")]
        top = max(curves, key=lambda a: a.get_zorder())
        colour = top.get_color() if hasattr(top, "get_color") else top.get_edgecolor()
        assert to_hex(colour if isinstance(colour, str) else colour[0]) == plots.COLOURS["odyssey"]
        widest = max(curves, key=lambda a: max(a.get_linewidth()) if hasattr(a.get_linewidth(), "__len__")
                     else a.get_linewidth())
        assert widest is top  # Odyssey's levels: thickest and on top of every baseline
        labels = [t.get_text() for t in ax.get_legend().get_texts()]
        assert labels[0] == "odyssey"
    finally:
        plt.close(fig)
    assert (tmp_path / "throughput.png").stat().st_size > 10_000
