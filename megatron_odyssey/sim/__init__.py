"""Event-driven simulation of one training job under failures, for comparing fault-tolerance
policies (Odyssey, Oobleck, ReCycle, checkpoint-restart, fault-scaled) like for like.

Public API (the ``odyssey simulate`` command uses exactly this)::

    from megatron_odyssey.sim import SimulationConfig, run_simulation, write_outputs, print_summary
    result = run_simulation(SimulationConfig(npus=32, tp=1, pp=4, dp=8, failure_rate=0.1, hours=9, seeds=20))
    print(result.to_json())          # the CLI's --json contract
    print_summary(result)            # rich table
    write_outputs(result, "out/")    # result.json, timeseries_<policy>.csv, devices.png, throughput.png

Never imports torch.
"""
from .config import DEFAULT_POLICIES, POLICY_NAMES, SimulationConfig, parse_policies
from .errors import SimulationError, TraceFormatError
from .failslow import FAIL_SLOW_PRESETS, SlowClass
from .report import print_summary, summary_table, write_outputs
from .result import SimulationResult
from .runner import run_simulation
from .traces import load_trace

__all__ = [
    "DEFAULT_POLICIES", "FAIL_SLOW_PRESETS", "POLICY_NAMES", "SimulationConfig", "SimulationError", "SimulationResult",
    "SlowClass", "TraceFormatError", "load_trace", "parse_policies", "print_summary", "run_simulation", "summary_table", "write_outputs",
]
