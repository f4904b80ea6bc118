"""Every bad input of the ``odyssey`` command: exit code 2 and one line that names the user's flag.

The contract (README, ``cli.py``): stderr ends with exactly one line ``odyssey SUB: error: ...`` and
holds nothing else, except that when argparse itself rejects the command line (an unknown or missing
flag, a value of the wrong type or range) the subcommand's usage comes first. Never a traceback,
nothing on stdout.

To add a case, append ``(argv, expected substring)`` to ``CASES``; the runner is generic over
subcommands. ``{tmp}`` in an argument is a folder holding ``FILES`` (name -> contents).
"""
from __future__ import annotations

import json

import pytest

from megatron_odyssey.cli import main
from megatron_odyssey.planning.profile import builtin_profile

PLAN = ["plan", "--nodes", "8", "--pp", "2", "--dp", "4", "--layers", "16", "--global-batch", "32", "--micro-batch", "1"]
SIM = ["simulate", "--npus", "8", "--pp", "4", "--dp", "2", "--hours", "1", "--failure-rate", "0.1"]
SIM_NO_PROCESS = ["simulate", "--npus", "8", "--pp", "4", "--dp", "2", "--hours", "1"]


def _profile(**changes) -> str:
    data = builtin_profile(num_layers=16).to_dict()
    data.update(changes)
    return json.dumps(data)


FILES: dict[str, str | bytes] = {
    "truncated.json": '{"name": 1',
    "list.json": "[1, 2]",
    "unknown_field.json": json.dumps({"name": "x", "bogus_field": 1}),
    "wrong_type.json": _profile(p2p_s="fast"),
    "no_layers.json": _profile(layers=[]),
    "tp2.json": _profile(tp=2),
    "sixteen_layers.json": _profile(),
    "binary.json": b"\xff\xfe\x00\x01",
    "remove_first.csv": "0,add,node1\n0,add,node2\n5000,remove,node3\n",
    "removed_twice.csv": "0,add,node1\n0,add,node2\n5,remove,node1\n7,remove,node1\n",
    "added_twice.csv": "0,add,node1\n5,add,node1\n",
    "bad_op.csv": "0,add,node1\n1000,explode,node1\n",
    "two_fields.csv": "0,add,node1\n1000,node1\n",
    "backwards.csv": "0,add,node1\n5,add,node2\n3,remove,node1\n",
    "bad_time.csv": "0,add,node1\nsoon,remove,node1\n",
    "bad_name.csv": "0,add,gpu1\n",
    "empty.csv": "\n",
}


def plan(*changes: str) -> list[str]:
    """PLAN with ``--flag value`` pairs replaced or added (a lone ``--flag`` is appended)."""
    return _with(PLAN, changes)


def sim(*changes: str, base: list[str] = SIM) -> list[str]:
    return _with(base, changes)


def _with(base: list[str], changes: tuple[str, ...]) -> list[str]:
    argv, i = list(base), 0
    while i < len(changes):
        flag = changes[i]
        value = changes[i + 1] if i + 1 < len(changes) and not changes[i + 1].startswith("--") else None
        if value is not None and flag in argv:
            argv[argv.index(flag) + 1] = value
        else:
            argv += [flag] + ([value] if value is not None else [])
        i += 2 if value is not None else 1
    return argv


CASES: list[tuple[list[str], str]] = [
    # -- plan: numbers -------------------------------------------------------------------------
    (plan("--pp", "-2"), "argument --pp: must be a positive integer, got '-2'"),
    (plan("--dp", "0"), "argument --dp: must be a positive integer"),
    (plan("--tp", "two"), "argument --tp: must be an integer, got 'two'"),
    (plan("--nodes", "-8"), "argument --nodes: must be a positive integer"),
    (plan("--layers", "0"), "argument --layers: must be a positive integer"),
    (plan("--global-batch", "0"), "argument --global-batch: must be a positive integer"),
    (plan("--micro-batch", "0"), "argument --micro-batch: must be a positive integer"),
    (plan("--mtbf-hours", "0"), "argument --mtbf-hours: must be a positive number"),
    (plan("--mtbf-hours", "nan"), "argument --mtbf-hours: must be a finite number"),
    (plan("--search", "exhaustive", "--time-limit", "-1"), "argument --time-limit: must be a positive number"),
    # -- plan: flags that contradict each other ------------------------------------------------
    (plan("--nodes", "7"), "--nodes 7 does not match --pp x --dp = 2 x 4 = 8"),
    (plan("--global-batch", "30"), "--global-batch 30 is not divisible by --micro-batch x --dp"),
    (plan("--micro-batch", "3"), "--global-batch 32 is not divisible by --micro-batch x --dp = 3 x 4"),
    (plan("--pp", "8", "--dp", "1", "--layers", "4"), "--pp 8 is greater than --layers 4"),
    (plan("--time-limit", "5"), "--time-limit bounds --search exhaustive only"),
    # -- plan: --failed --------------------------------------------------------------------------
    (plan("--failed", "3,3"), "--failed 3,3: node(s) [3] listed more than once"),
    (plan("--failed", "9"), "--failed names node(s) [9] not in the cluster: node ids are 0..7"),
    (plan("--failed", "-1"), "--failed names node(s) [-1] not in the cluster"),
    (plan("--failed", "x"), "--failed expects comma-separated node ids"),
    (plan("--failed", "0,1,2,3,4,5,6,7"), "--failed names all 8 nodes"),
    (plan("--nodes", "4", "--pp", "4", "--dp", "1", "--layers", "32", "--global-batch", "8", "--failed", "0,1,2"),
     "--failed 0,1,2: no plan can run on the 1 surviving nodes"),
    # -- plan: --profile and --search ----------------------------------------------------------
    (plan("--profile", "llama2-13b"), "--profile llama2-13b: no such file, and not a built-in model "
                                      "(built-in: llama2-7b, llama2-70b, gpt3-medium-a100)"),
    (plan("--profile", "{tmp}/truncated.json"), "truncated.json: not valid JSON"),
    (plan("--profile", "{tmp}/list.json"), "list.json: must hold a JSON object"),
    (plan("--profile", "{tmp}/unknown_field.json"), "unknown profile field(s) ['bogus_field']"),
    (plan("--profile", "{tmp}/wrong_type.json"), "wrong_type.json: field 'p2p_s' must be a non-negative number"),
    (plan("--profile", "{tmp}/no_layers.json"), "no_layers.json: field 'layers' is empty"),
    (plan("--profile", "{tmp}/tp2.json"), "tp2.json was made at TP 2, but --tp is 1"),
    (plan("--profile", "{tmp}/sixteen_layers.json", "--layers", "12"), "describes 16 layers, but --layers is 12"),
    (plan("--profile", "{tmp}/binary.json"), "binary.json: is not a text file"),
    (plan("--profile", "{tmp}"), "is a folder, not a profile JSON file"),
    (plan("--profile", "llama2-70b"), "a layout of the same 8 devices that fits: --nodes"),
    (plan("--search", "greedy"), "argument --search: invalid choice: 'greedy'"),
    (plan("--nodes", "32", "--pp", "4", "--dp", "8", "--layers", "32", "--global-batch", "64", "--failed", "5",
          "--search", "exhaustive"), "add --time-limit SECONDS"),
    # -- plan: argparse ------------------------------------------------------------------------
    (plan("--bogus"), "unrecognized arguments: --bogus"),
    (["plan", "--nodes", "8", "--pp", "2"], "the following arguments are required: --dp"),
    # -- simulate: numbers and sizes -----------------------------------------------------------
    (sim("--pp", "-2"), "argument --pp: must be a positive integer, got '-2'"),
    (sim("--npus", "0"), "argument --npus: must be a positive integer"),
    (sim("--seeds", "0"), "argument --seeds: must be a positive integer"),
    (sim("--hours", "0"), "argument --hours: must be a positive number"),
    (sim("--hours", "-3"), "argument --hours: must be a positive number"),
    (sim("--failure-rate", "-0.1"), "argument --failure-rate: must be a number >= 0"),
    (sim("--failure-rate", "inf"), "argument --failure-rate: must be a finite number"),
    (sim("--global-batch", "0"), "argument --global-batch: must be a positive integer"),
    (sim("--npus", "16"), "--npus 16 must equal --tp x --pp x --dp = 1 x 4 x 2 = 8"),
    (sim("--global-batch", "63"), "--global-batch 63 is not divisible by --micro-batch x --dp"),
    (sim("--micro-batch", "5"), "--global-batch 64 is not divisible by --micro-batch x --dp = 5 x 2"),
    (sim("--npus", "64", "--pp", "64", "--dp", "1"), "--pp 64 is greater than the 32 layers of --model llama2-7b"),
    (sim("--npus", "8", "--pp", "2", "--dp", "4"), "a layout of the same 8 devices that fits: --npus 8 --tp 1 --pp 4"),
    (sim("--model", "llama2-70b"), "no layout of 8 devices fits; the smallest that does: --npus"),
    # -- simulate: the failure process ---------------------------------------------------------
    (SIM_NO_PROCESS, "one of the arguments --failure-rate --trace is required"),
    (sim("--trace", "{tmp}/bad_op.csv"), "argument --trace: not allowed with argument --failure-rate"),
    (sim("--trace", "{tmp}/remove_first.csv", base=SIM_NO_PROCESS),
     "--trace {tmp}/remove_first.csv:3: at 5000 ms node3 is removed, but it was never added; the cluster is built "
     "by the events at time 0"),
    (sim("--trace", "{tmp}/removed_twice.csv", base=SIM_NO_PROCESS), "removed_twice.csv:4: at 7 ms node1 is removed, "
                                                                     "but it already left the cluster at 5 ms (line 3)"),
    (sim("--trace", "{tmp}/added_twice.csv", base=SIM_NO_PROCESS), "added_twice.csv:2: at 5 ms node1 is added, but it is "
                                                                   "already in the cluster"),
    (sim("--trace", "{tmp}/bad_op.csv", base=SIM_NO_PROCESS), "bad_op.csv:2: event 'explode' is neither"),
    (sim("--trace", "{tmp}/two_fields.csv", base=SIM_NO_PROCESS), "two_fields.csv:2: 2 comma-separated fields"),
    (sim("--trace", "{tmp}/backwards.csv", base=SIM_NO_PROCESS), "backwards.csv:3: time 3 ms goes back"),
    (sim("--trace", "{tmp}/bad_time.csv", base=SIM_NO_PROCESS), "bad_time.csv:2: time 'soon' is not an integer"),
    (sim("--trace", "{tmp}/bad_name.csv", base=SIM_NO_PROCESS), "bad_name.csv:1: node name 'gpu1'"),
    (sim("--trace", "{tmp}/empty.csv", base=SIM_NO_PROCESS), "--trace {tmp}/empty.csv: the trace has no events"),
    (sim("--trace", "{tmp}/missing.csv", base=SIM_NO_PROCESS), "--trace {tmp}/missing.csv: file does not exist"),
    (sim("--trace", "{tmp}", base=SIM_NO_PROCESS), "is a folder, not a trace file"),
    # -- simulate: names, files, output --------------------------------------------------------
    (sim("--policies", "odyssey,bamboo"), "--policies: unknown 'bamboo'; choose from odyssey, oobleck"),
    (sim("--policies", "odyssey,odyssey"), "--policies lists odyssey more than once"),
    (sim("--policies", ","), "--policies names no policy"),
    (sim("--npus", "4", "--pp", "4", "--dp", "1"), "--policies oobleck needs"),
    (sim("--model", "llama2-13b"), "--model llama2-13b: not a built-in model; choose one of llama2-7b, llama2-70b, "
                                   "gpt3-medium-a100"),
    (sim("--profile", "llama2-13b"), "--profile llama2-13b: no such file, and not a built-in model"),
    (sim("--profile", "{tmp}/truncated.json"), "--profile {tmp}/truncated.json: not valid JSON"),
    (sim("--profile", "{tmp}/sixteen_layers.json", "--pp", "32", "--dp", "1", "--npus", "32"),
     "--pp 32 is greater than the 16 layers of --profile"),
    (sim("--model", "llama2-7b", "--profile", "llama2-7b"), "give --model or --profile, not both"),
    (sim("--out", "{tmp}/truncated.json"), "--out {tmp}/truncated.json is a file"),
    (sim("--bogus"), "unrecognized arguments: --bogus"),
    # -- train and demo: refused before any process starts -------------------------------------
    (["train", "--plan", "{tmp}/missing.json"], "--plan {tmp}/missing.json: file does not exist"),
    (["train", "--plan", "{tmp}/truncated.json"], "--plan {tmp}/truncated.json: not JSON"),
    (["train", "--plan", "{tmp}/list.json"], "--plan {tmp}/list.json: expected a JSON object"),
    (["train", "--plan", "{tmp}/unknown_field.json"], "--plan: not an execution plan"),
    (["train", "--pp", "-2"], "--pp must be >= 1, got -2"),
    (["train", "--nproc", "0"], "--nproc must be >= 1"),
    (["train", "--layers", "1"], "--pp 2 is greater than --layers 1"),
    (["train", "--global-batch", "7"], "--global-batch 7"),
    (["train", "--fail", "step=1,rank=9"], "--fail 'step=1,rank=9': rank 9 does not exist"),
    (["train", "--fail", "step=1,rank=1,phase=bogus"], "--fail 'step=1,rank=1,phase=bogus': phase must be one of"),
    (["train", "--fail", "step=1,rank=1", "--fail", "step=1,rank=1,kind=hang"], "rank 1 already fails in step 1"),
    (["train", "--fail", "step=1,rank=1,phase=grad-sync,kind=slow", "--fail", "step=1,rank=1,phase=forward"],
     "or a kind=slow at an earlier phase first"),
    (["train", "--fail", "rank=1"], "--fail 'rank=1': missing step"),
    (["train", "--fail", "step=1,rank=1,kind=exit"], "kind=exit needs code=C, an exit code from 1 to 255"),
    (["train", "--fail", "step=1,rank=1,kind=exit,code=0"], "kind=exit needs code=C, an exit code from 1 to 255"),
    (["train", "--fail", "step=1,rank=1,code=16"], "code= applies to kind=exit only"),
    (["train", "--fail", "step=1,rank=1,kind=kill-writer"], "kind=kill-writer kills the checkpoint writers of a "
                                                            "save: use phase=save"),
    (["train", "--fail", "step=1,rank=1,phase=save,kind=kill-writer", "--checkpoint-interval", "1"],
     "odyssey train's save forks none (use kind=kill at phase=save)"),
    (["train", "--fail", "step=1,rank=1,kind=deadline"], "kind=deadline reaches Megatron-LM's --exit-duration-in-mins; "
                                                         "odyssey train has no time limit (use --steps)"),
    (["train", "--heartbeat-timeout", "0"], "--heartbeat-timeout must be longer than"),
    (["train", "--checkpoint-interval", "-1"], "--checkpoint-interval must be >= 0"),
    (["train", "--mtbf-hours", "-1"], "--mtbf-hours must be positive"),
    (["train", "--data-path", "{tmp}/nothing"], "--data-path {tmp}/nothing: no {tmp}/nothing.bin or"),
    (["train", "--save-params", "{tmp}/no/such/p.pt"], "--save-params {tmp}/no/such/p.pt: folder"),
    (["train", "--report", "{tmp}/no/such/r.json"], "--report {tmp}/no/such/r.json: folder"),
    (["train", "--workdir", "{tmp}/truncated.json/run"], "--workdir {tmp}/truncated.json/run: cannot create the folder"),
    (["train", "--policy", "sideways"], "argument --policy: invalid choice: 'sideways'"),
    (["train", "--bogus"], "unrecognized arguments: --bogus"),
    (["demo", "--out", "{tmp}/d", "--fail", "step=40,rank=1"], "--fail 'step=40,rank=1': step 40 is past the last step"),
    (["demo", "--out", "{tmp}/d", "--nproc", "4"], "--fail 'step=3,rank=5,phase=backward,kind=kill': rank 5 does "),
    (["demo", "--out", "{tmp}/truncated.json"], "--out {tmp}/truncated.json is a file; give a folder"),
    (["demo", "--out", "{tmp}/d", "--report", "{tmp}/no/r.json"], "--report {tmp}/no/r.json: folder"),
]


@pytest.fixture
def tmp_files(tmp_path):
    for name, content in FILES.items():
        path = tmp_path / name
        path.write_bytes(content) if isinstance(content, bytes) else path.write_text(content)
    return tmp_path


def run_cli(argv: list[str], capsys) -> tuple[int, str, str]:
    """``main(argv)`` as the console script runs it: argparse errors exit through SystemExit."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(sub: str, err: str) -> str:
    """stderr = [the subcommand's usage, from argparse] + exactly one ``odyssey SUB: error:`` line."""
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.strip()]
    assert lines, "nothing on stderr"
    *usage, last = lines
    assert last.startswith(f"odyssey {sub}: error: "), err
    if usage:
        assert usage[0].startswith(f"usage: odyssey {sub} "), err  # the subcommand's usage, not odyssey's
        assert not any("error" in line for line in usage), err
    return last


@pytest.mark.parametrize("argv,expected", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_exits_2_with_one_line_naming_the_flag(argv, expected, tmp_files, capsys):
    argv = [a.format(tmp=tmp_files) for a in argv]
    code, out, err = run_cli(argv, capsys)
    assert code == 2, (code, err)
    assert out == "", out
    line = assert_one_line_error(argv[0], err)
    assert expected.format(tmp=tmp_files) in line, line


@pytest.mark.parametrize("sub", ["plan", "simulate", "train", "demo"])
def test_unknown_flag_shows_the_subcommands_usage(sub, capsys):
    argv = {"plan": PLAN, "simulate": SIM}.get(sub, [sub]) + ["--bogus"]
    code, _, err = run_cli(argv, capsys)
    assert code == 2
    assert err.startswith(f"usage: odyssey {sub} "), err
    assert err.strip().endswith(f"odyssey {sub}: error: unrecognized arguments: --bogus")


@pytest.mark.parametrize("sub", ["plan", "simulate", "train", "demo"])
def test_every_flag_has_help(sub):
    from megatron_odyssey.cli import build_parser, subparser

    parser = subparser(build_parser(), sub)
    undocumented = [a.option_strings[0] for a in parser._actions
                    if a.option_strings and a.option_strings[0] != "-h" and not (a.help or "").strip()]
    assert undocumented == []


@pytest.mark.parametrize("argv,expected", [
    (["train", "--rejoin", "5"], "--rejoin '5': expected RANK@STEP"),
    (["train", "--nproc", "4", "--rejoin", "7@1"], "--rejoin 7@1: the rank must be one of the job's 0..3"),
    (["train", "--fail", "step=1,rank=0,kind=slow,factor=0.5"], "factor must be a number > 1"),
    (["train", "--slow-action", "maybe"], "argument --slow-action: invalid choice: 'maybe'"),
    (["join", "--workdir", "{tmp}/nowhere", "--rank", "1"], "no job address in"),
])
def test_slow_and_join_flags_exit_2_naming_the_flag(argv, expected, tmp_files, capsys):
    code, out, err = run_cli([a.format(tmp=tmp_files) for a in argv], capsys)
    assert code == 2, (code, err)
    assert expected in err, err


def test_join_at_an_address_where_nothing_listens_says_so_at_once():
    """A store client would retry a refused connection for its whole timeout (30 s): asked first, said at once."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "megatron_odyssey.runtime.joining", "--address", "127.0.0.1:1",
                          "--rank", "1"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2, out
    assert "cannot reach the job at 127.0.0.1:1: ConnectionRefusedError" in out.stderr, out.stderr
