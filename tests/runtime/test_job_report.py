"""The report's failure and takeover entries, and its write, from the agent's records."""
from __future__ import annotations

import json

from megatron_odyssey.runtime.job_report import FailureRecord, failure_entries, takeover_entries, write_report_file


def test_failures_and_takeovers_are_listed_as_the_report_reads_them(tmp_path) -> None:
    """A failure keeps its figures and gains when it happened on the job's clock (its injection, else its detection;
    none when unknown), without the agent's bookkeeping clocks; a takeover that lost no rank is a takeover only, one
    that lost a machine's ranks is both a takeover and a failure of those ranks."""
    kill = FailureRecord(ranks=[3], phase="backward", policy="reroute", step=4, detection_s=0.5, recovery_s=2.0,
                         started=1012.5, sealed_at=1013.0, published_at=1013.2, joined_at=1014.0, generation=1)
    unknown = FailureRecord(ranks=[5], step=6, generation=2)
    lost_launcher = FailureRecord(ranks=[], policy="resume", step=7, detection_s=2.1, recovery_s=3.0, generation=3,
                                  takeover={"reason": "the agent's process was lost"})
    lost_machine = FailureRecord(ranks=[0, 1], policy="reconfigure", step=9, detection_s=2.4, recovery_s=5.5,
                                 started=1030.0, generation=4, takeover={"reason": "machine 0 stopped answering",
                                                                         "lost_as": "silent"})
    records = [kill, unknown, lost_launcher, lost_machine]

    failures = failure_entries(records, job_started=1000.0)
    assert [f["ranks"] for f in failures] == [[3], [5], [0, 1]]
    assert [f["wall_s"] for f in failures] == [12.5, None, 30.0]
    hidden = {"started", "generation", "sealed_at", "published_at", "joined_at", "takeover"}
    assert all(not hidden & set(f) for f in failures)
    assert failures[0]["phase"] == "backward" and failures[0]["recovery_s"] == 2.0
    assert takeover_entries(records) == [
        {"step": 7, "generation": 3, "reason": "the agent's process was lost", "ranks_lost": [], "lost_as": "gone",
         "policy": "resume", "detection_s": 2.1, "recovery_s": 3.0, "superseded_by": 0},
        # (above: a record from before lost_as: its process)
        {"step": 9, "generation": 4, "reason": "machine 0 stopped answering", "ranks_lost": [0, 1], "lost_as": "silent",
         "policy": "reconfigure", "detection_s": 2.4, "recovery_s": 5.5, "superseded_by": 0}]

    path = tmp_path / "report.json"
    write_report_file(path, {"ok": True, "failures": failures})
    write_report_file(path, {"ok": False, "failures": failures[:1]})  # rewritten whole, as after every failure
    assert json.loads(path.read_text()) == {"ok": False, "failures": json.loads(json.dumps(failures[:1]))}
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no partial file left beside it
