"""The CLI as a user runs it: the bundled model, real sandboxes. Runs go through a real
subprocess (the console script's exit status, signals, its stdout and stderr); argument and
input errors are checked in this process (``cli.main``), as they need no model."""

import json
import os
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from agentenv.cli import main
from agentenv.envs.retool_math import RetoolMathEnv

from .waiting import DEADLINE_S, ended, wait_for

CPUS = os.cpu_count() or 1


def agentenv(*args, timeout=300, cwd=None, env=None):
    env = {**os.environ, "COLUMNS": "120", **(env or {})}
    return subprocess.run([sys.executable, "-m", "agentenv.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=cwd)


def test_rollout_writes_jsonl_that_datasets_loads(tmp_path, model_dir):
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", "--tasks", "3", "--group-size", "2", "--out", str(out), "--model", model_dir,
                 "--no-progress", "--seed", "5")
    assert r.returncode == 0, r.stderr
    assert r.stdout == ""  # the data is in --out; what the run says to people is on stderr
    lines = out.read_text().splitlines()
    assert len(lines) == 6
    rows = [json.loads(line) for line in lines]
    assert all(len(x["input_ids"]) == len(x["loss_mask"]) == len(x["logprobs"]) for x in rows)
    for label in ("programs", "tool calls", "prefix-cache reuse", "mean reward", "finish reasons"):
        assert label in r.stderr
    # retool-math's 6 programs took sessions started while the model loaded.
    assert re.search(r"sessions prepared ahead \(model loading\)\W+6\b", r.stderr), r.stderr[-3000:]
    from datasets import load_dataset

    ds = load_dataset("json", data_files=str(out), split="train")
    assert ds.num_rows == 6 and "input_ids" in ds.column_names


def cli(capsys, *args: str) -> tuple[int, str, str]:
    """``agentenv ARGS`` in this process: (exit status, stdout, stderr)."""
    rc = main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.mark.parametrize(
    "args, message",
    [
        (["rollout", "--tasks", "0"], "argument --tasks: must be > 0, got 0"),
        (["rollout", "--tasks", "many"], "expected a number"),
        (["rollout", "--top-p", "2"], "argument --top-p: must be > 0 and <= 1, got 2"),
        (["rollout", "--top-k", "-1"], "argument --top-k: must be >= 0, got -1"),
        (["rollout", "--model", "/nonexistent/model"], "model directory not found"),
        (["rollout", "--env-arg", "extra_digits=99"], "cannot create environment"),
        (["rollout", "--env", "retool-mat"], "Did you mean 'retool-math'"),
        (["rollout", "--group_size", "2", "--max-new-token", "8"],
         "unrecognized arguments: --group_size 2 --max-new-token 8. Did you mean --group-size / --max-new-tokens?"),
        (["train", "--stepz", "3"], "unrecognized arguments: --stepz 3. Did you mean --steps?"),
        (["eval", "--k", "2", "--bogus", "1"], "unrecognized arguments: --bogus 1"),
        (["rollout", "--out", "/nonexistent/dir/r.jsonl"], "output directory does not exist"),
        (["rollout", "--out", "/proc/x.jsonl"], "cannot write /proc/x.jsonl"),
        (["rollout", "--out", "."], "is a directory"),
        (["rollout", "--out", "pyproject.toml/x.jsonl"], "is not a directory"),
        (["rollout", "--engine", "openai"], "needs --base-url"),
        (["rollout", "--engine-arg", "oops"], "KEY=VALUE"),
        (["rollout", "--env-arg", "nosuch=1"], "no argument 'nosuch'; it takes: extra_digits: int = 2"),
        (["rollout", "--env-arg", "extra_digits"], "--env-arg wants KEY=VALUE"),
        (["rollout", "--env-arg", "extra_digits=abc"], "--env-arg extra_digits='abc': not a valid int"),
        (["rollout", "--env", "./no_such_file.py:Env"], "no such file"),
        (["rollout", "--env-module", "no_such_module_xyz"], "cannot import 'no_such_module_xyz'"),
        (["rollout", "--engines", "1"], "--engines and --engine-gpus need --cluster ray"),
        (["rollout", "--workers", "3"], "--workers 3 needs --cluster ray"),
        (["rollout", "--engine", "openai", "--base-url", "notaurl"],
         "--base-url 'notaurl' is not a server URL: give http(s)://HOST[:PORT][/PATH]"),
        (["rollout", "--engine", "openai", "--base-url", "http://h:99999"], "--base-url 'http://h:99999' is not"),
        (["eval", "--judge", "embedded:/nonexistent"], "--judge embedded:/nonexistent: model directory not found"),
        (["rollout", "--judge", "vllm:/tmp"], "--judge vllm:/tmp: /tmp is not a Hugging Face model directory"),
        (["rollout", "--cluster", "ray", "--engine-gpus", "4"], "--engine-gpus 4 needs --engines N"),
        (["rollout", "--judge-weight", "2"], "--judge-weight 2 needs --judge"),
        (["rollout", "--judge-group"], "--judge-group needs --judge"),
        (["eval", "--judge-deadline", "5"], "--judge-deadline 5 needs --judge"),
        (["rollout", "--tasks", "2", "--cluster", "ray", "--workers", "1000"],
         "--workers 1000 is more than the run's 2 groups (--tasks 2): a worker runs whole groups, so give at most "
         "--workers 2"),
        (["rollout", "--tasks", "1000", "--cluster", "ray", "--workers", str(CPUS + 1)],
         f"--workers {CPUS + 1} is more than the {CPUS} CPUs of the local Ray cluster started for the run: give at "
         f"most --workers {CPUS}, or set RAY_ADDRESS"),
        (["rollout", "--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["rollout", "--resume"], "nothing to resume"),
        (["eval", "--report", "/nonexistent/dir/r.json"], "--report /nonexistent/dir/r.json: not a file"),
    ],
)
def test_bad_input_is_one_clear_line(args, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # where the default --out goes
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (tmp_path / "pyproject.toml").write_text("")
    rc, out, err = cli(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert (rc, out) == (2, "") and len(lines) == 1 and message in lines[0], err


@pytest.mark.parametrize("args, message", [
    (["rollout", "--model", "tiny-hermess"], "model directory not found: tiny-hermess. Did you mean 'tiny-hermes' "
                                             "(a bundled model)?"),
    (["eval", "--model", "tiny"], "model directory not found: tiny (the bundled models: tiny-retool, tiny-hermes)"),
    (["rollout", "--env", "goodenv:Goood"], "'goodenv' has no attribute 'Goood'. Did you mean goodenv:Good?"),
    (["rollout", "--env", "badenv:Bad"], "cannot import 'badenv': SyntaxError: invalid syntax ({dir}/badenv.py, "
                                         "line 2)"),
    (["rollout", "--env", "./badenv.py:Bad"], "cannot import ./badenv.py: SyntaxError: invalid syntax "
                                              "({dir}/badenv.py, line 2)"),
    (["rollout", "--resume", "--out", "random.txt"], "nothing to resume: random.txt is not a run's rollouts (JSON "
                                                     "lines of trajectories), and random.txt.log does not exist"),
    (["rollout", "--resume", "--out", "report.json"], "nothing to resume: report.json is an eval report, not a run's "
                                                      "rollouts, and report.json.log does not exist"),
    (["rollout", "--resume", "--out", "r.jsonl.log"], "nothing to resume: r.jsonl.log is a run's event log, not its "
                                                      "output: resume with --out r.jsonl"),
    (["eval", "--resume", "--out", "old.jsonl"], "old.jsonl holds rollouts but its event log old.jsonl.log does not "
                                                 "exist or is empty"),
    (["rollout", "--resume", "--out", "none.jsonl"], "nothing to resume: none.jsonl does not exist"),
])
def test_a_users_slip_is_one_line_naming_what_was_meant(args, message, capsys, tmp_path, monkeypatch):
    """A misspelt bundled model or class, a syntax error in the user's module (imported by
    name from beside the user, or by path: one line naming the file and line, no traceback),
    and --resume given a file that is not a run's rollouts."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.path", [p for p in sys.path if p not in ("", ".", str(tmp_path))])
    (tmp_path / "badenv.py").write_text("from agentenv import Environment\nclass Bad(Environment:\n    pass\n")
    (tmp_path / "goodenv.py").write_text("from agentenv import Environment\nclass Good(Environment):\n    pass\n")
    (tmp_path / "random.txt").write_text("hello\n")
    (tmp_path / "report.json").write_text(json.dumps({"env": "retool-math", "pass@k": {"1": 0.5}}, indent=2))
    (tmp_path / "r.jsonl.log").write_text('0badc0de {"e":"header","v":1,"settings":{}}\n')
    (tmp_path / "old.jsonl").write_text(json.dumps({"task_id": "t", "input_ids": [1, 2]}) + "\n")
    rc, out, err = cli(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert (rc, out) == (2, "") and len(lines) == 1 and message.format(dir=tmp_path) in lines[0], err


def test_the_console_script_reports_a_bad_argument_in_one_line_and_exit_2():
    script = Path(sys.executable).with_name("agentenv")
    r = subprocess.run([str(script), "rollout", "--tasks", "0"], capture_output=True, text=True, timeout=120)
    assert (r.returncode, r.stdout, r.stderr) == (2, "", "agentenv: error: argument --tasks: must be > 0, "
                                                           "got 0\n")


def test_help_exits_0_and_lists_every_option(capsys):
    rc, out, _ = cli(capsys, "rollout", "--help")
    assert rc == 0
    for flag in ("--top-k", "--max-tokens-per-turn", "--session-lookahead", "--reward-timeout", "--engine-gpus"):
        assert flag in out
    assert "--env-lookahead" not in out  # the former flag, still taken, is not offered


def test_the_former_env_lookahead_flag_still_sets_the_session_lookahead():
    from agentenv.cli import build_parser
    from agentenv.config import RolloutRunConfig
    from agentenv.options import build

    argv = ["rollout", "--env-lookahead", "3"]
    values = vars(build_parser(argv).parse_args(argv))
    values.pop("command")
    rollout = build(RolloutRunConfig, values).rollout
    assert rollout.session_lookahead == rollout.env_lookahead == 3


def test_envs_lists_the_bundled_environments():
    r = agentenv("envs")
    assert r.returncode == 0
    assert [ln.split()[0] for ln in r.stdout.splitlines() if ln and not ln.startswith(" ")] == \
        ["dataset", "retool-math", "trace", "Note:"]
    assert "Arithmetic word problems" in r.stdout and "--env-arg: extra_digits: int = 2" in r.stdout
    assert "Tasks from a JSONL file or a Hugging Face dataset" in r.stdout and "--env-arg: source: str," in r.stdout


USER_ENV = '''
from agentenv import Environment, Task, register


class DigitSum(Environment):
    """Sum the digits of a number."""

    max_turns = 2

    def __init__(self, digits: int = 3, shout: bool = False):
        super().__init__()
        self.digits, self.shout = digits, shout

    def tasks(self, n, seed=0):
        return [Task(f"ds{self.digits}/{seed}/{i}", f"Sum the digits of {10 ** (self.digits - 1) + 7 * i + seed}.",
                     sum(map(int, str(10 ** (self.digits - 1) + 7 * i + seed)))) for i in range(n)]

    async def reward(self, task, trajectory):
        return float(str(task.answer) in trajectory.text)


register("digit-sum", DigitSum)
'''


@pytest.mark.slow
def test_an_environment_from_the_users_own_file(tmp_path, model_dir):
    """A module beside the user (as `python -m` finds it), a file path, and a module that
    register()s its ids, loaded with --env-module or AGENTENV_ENV_MODULES."""
    (tmp_path / "digitsum_env.py").write_text(USER_ENV)
    r = agentenv("envs", "--env-module", "./digitsum_env.py", cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "digit-sum  (digitsum_env:DigitSum)" in r.stdout and "Sum the digits of a number." in r.stdout
    assert "--env-arg: digits: int = 3, shout: bool = False" in r.stdout
    r = agentenv("envs", cwd=tmp_path, env={"AGENTENV_ENV_MODULES": "digitsum_env"})
    assert r.returncode == 0 and "digit-sum" in r.stdout, r.stderr
    small = ["--tasks", "2", "--group-size", "1", "--max-new-tokens", "32", "--model", model_dir, "--no-progress"]
    for spec, extra in (("digitsum_env:DigitSum", []), (str(tmp_path / "digitsum_env.py") + ":DigitSum", []),
                        ("./digitsum_env.py", []),  # the one Environment subclass the file defines
                        ("digit-sum", ["--env-module", "digitsum_env"])):
        out = tmp_path / "r.jsonl"
        r = agentenv("rollout", "--env", spec, *extra, "--env-arg", "digits=4", "--env-arg", "shout=yes",
                     *small, "--out", str(out), "--overwrite", cwd=tmp_path)
        assert r.returncode == 0, (spec, r.stderr[-2000:])
        rows = [json.loads(line) for line in out.read_text().splitlines()]
        assert len(rows) == 2 and all(x["task_id"].startswith("ds4/") for x in rows)  # digits=4 reached it
    log = (tmp_path / "r.jsonl.log").read_text()
    assert '"env_args":{"digits":4,"shout":true}' in log.replace(" ", "")


GROUP_ENV = USER_ENV.replace('register("digit-sum", DigitSum)', """
class RankedDigitSum(DigitSum):
    async def group_reward(self, task, trajectories):
        return [100.0 + t.sample_index for t in trajectories]
""")


@pytest.mark.slow
def test_rollout_lines_carry_the_group_reward(tmp_path, model_dir):
    """An environment with ``group_reward``: every line is written once its group is scored,
    with the group's reward (not the per-sample one), and the summary agrees."""
    (tmp_path / "ranked_env.py").write_text(GROUP_ENV)
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", "--env", "ranked_env:RankedDigitSum", "--tasks", "3", "--group-size", "3",
                 "--max-new-tokens", "32", "--model", model_dir, "--no-progress", "--out", str(out), cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert len(rows) == 9 and {x["task_id"] for x in rows} == {"ds3/0/0", "ds3/0/1", "ds3/0/2"}
    assert all(x["reward"] == 100.0 + x["sample_index"] for x in rows)
    for i in range(0, 9, 3):  # a group's lines together, in sample order
        group = rows[i:i + 3]
        assert [x["sample_index"] for x in group] == [0, 1, 2] and len({x["group_id"] for x in group}) == 1
    assert "101.0" in r.stderr  # the summary's mean reward


WHOLE_GROUP_ENV = USER_ENV.replace('register("digit-sum", DigitSum)', """
class WholeGroupSum(DigitSum):
    async def group_reward(self, task, trajectories):
        total = sum(t.reward for t in trajectories)
        return [1000.0 * len(trajectories) + total + t.sample_index for t in trajectories]
""")


@pytest.mark.slow
def test_a_group_cut_short_mid_write_is_scored_whole_on_resume(tmp_path, model_dir):
    """A crash between a group's lines leaves part of the group in the output: --resume runs
    the rest and scores the whole group again, from its per-sample rewards, so every line
    carries the reward of the full group (not of the samples that ran again)."""
    (tmp_path / "whole_env.py").write_text(WHOLE_GROUP_ENV)
    out, log = tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"
    cmd = ["rollout", "--env", "whole_env:WholeGroupSum", "--tasks", "2", "--group-size", "3",
           "--max-new-tokens", "32", "--model", model_dir, "--no-progress", "--out", str(out)]
    r = agentenv(*cmd, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]

    def check(rows):
        assert len(rows) == 6 and sorted((x["task_id"], x["sample_index"]) for x in rows) == sorted(
            (f"ds3/0/{t}", i) for t in range(2) for i in range(3))
        for tid in {x["task_id"] for x in rows}:
            group = [x for x in rows if x["task_id"] == tid]
            total = sum(x["metadata"]["sample_reward"]["reward"] for x in group)
            assert all(x["reward"] == 3000.0 + total + x["sample_index"] for x in group), group

    lines = out.read_text().splitlines(keepends=True)
    check([json.loads(x) for x in lines])
    # The crash: the last group's first line is out, its other two (and their "done" records) are not.
    cut = [json.loads(x)["id"] for x in lines[-2:]]
    out.write_text("".join(lines[:-2]))
    records = log.read_text().splitlines(keepends=True)
    log.write_text("".join(x for x in records if not ('"e":"done"' in x and json.loads(x[9:])["k"] in cut)))
    r = agentenv(*cmd, "--resume", cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    after = out.read_text().splitlines(keepends=True)
    assert after[:4] == lines[:4]  # the lines there are kept as they were, not written twice
    check([json.loads(x) for x in after])


@pytest.mark.slow
def test_eval_on_a_dataset_file_reports_pass_at_k_consistent_with_its_trajectories(tmp_path, model_dir):
    data = tmp_path / "mini.jsonl"
    rows = [{"q": f"Compute {a} * {b}.", "a": a * b, "src": "mini"} for a, b in ((12, 34), (56, 78), (91, 23))]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "ev.jsonl"
    r = agentenv("eval", "--env", "dataset", "--env-arg", f"source={data}", "--env-arg", "question=q",
                 "--env-arg", "answer=a", "--tasks", "3", "--k", "4", "--out", str(out), "--model", model_dir,
                 "--no-progress", "--seed", "2")
    assert r.returncode == 0, r.stderr
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert sorted({x["task_id"] for x in lines}) == ["mini/0", "mini/1", "mini/2"] and len(lines) == 12
    rep = json.loads((tmp_path / "ev.report.json").read_text())
    assert rep["tasks"] == 3 and rep["samples_per_task"] == 4 and list(rep["pass@k"]) == ["1", "2", "4"]
    passed = {t: sum(x["reward"] == 1.0 for x in lines if x["task_id"] == t) for t in ("mini/0", "mini/1", "mini/2")}
    assert {t["task_id"]: t["passed"] for t in rep["per_task"]} == passed
    assert rep["pass@k"]["1"] == round(sum(passed.values()) / 12, 4)
    assert rep["pass@k"]["4"] == round(sum(c > 0 for c in passed.values()) / 3, 4)
    assert set(rep["components"]) == {"correct", "has_answer", "tool_ran"}
    assert "pass@4" in r.stderr and "mean correct" in r.stderr  # the table and the rollout summary
    # Data on stdout (one JSON line), people's text on stderr (docs/cli.md).
    assert len(r.stdout.splitlines()) == 1 and json.loads(r.stdout)["pass@k"] == rep["pass@k"]
    assert "mean has_answer (weight 0)" in r.stderr and "mean tool_ran (weight 0)" in r.stderr


def test_train_refuses_an_earlier_run_without_resume_or_overwrite(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    rc, _, err = cli(capsys, "train", "--out-dir", str(run))
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "holds an earlier run (metrics.jsonl): pass --resume" in err
    assert (run / "metrics.jsonl").read_text() == '{"step": 1}\n'


@pytest.mark.slow
def test_ctrl_c_stops_cleanly_and_keeps_what_was_written(tmp_path, model_dir):
    import signal

    import psutil

    out = tmp_path / "r.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentenv.cli", "rollout", "--tasks", "64", "--group-size", "4", "--out", str(out),
         "--model", model_dir, "--no-progress", "--concurrency", "16"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        # As from a terminal: a test run started in the background (``cmd &`` in a script)
        # ignores SIGINT, and a child would inherit that and never see the Ctrl-C.
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    log = Path(f"{out}.log")

    def mid_run() -> set[int]:
        # Programs are mid-run once the event log holds a completed turn (the model is loaded,
        # sandbox sessions are open); their sandbox workers are the CLI's descendants then.
        if b'"e":"turn"' not in (log.read_bytes() if log.exists() else b""):
            return set()
        return {c.pid for c in psutil.Process(proc.pid).children(recursive=True)}

    workers = wait_for(mid_run, "the rollout logged a turn", unless=lambda: proc.poll() is not None)
    assert workers and proc.poll() is None, f"the rollout ended before it was interrupted: {proc.communicate()[1]}"
    proc.send_signal(signal.SIGINT)
    _, err = ended(proc, "the rollout stopped after Ctrl-C")
    assert proc.returncode == 130, err
    assert "interrupted" in err

    def gone() -> bool:
        for pid in workers:
            try:
                if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                    return False
            except psutil.NoSuchProcess:
                pass
        return True

    wait_for(gone, f"the sandbox workers {sorted(workers)} exited", timeout=30)
    for line in out.read_text().splitlines():  # whatever was written is complete JSON
        json.loads(line)


def test_resuming_a_complete_run_says_so_without_opening_the_engine(capsys, tmp_path, model_dir):
    out = tmp_path / "r.jsonl"
    args = ["--tasks", "2", "--group-size", "2", "--max-new-tokens", "8", "--no-progress", "--model", model_dir,
            "--out", str(out)]
    rc, _, err = cli(capsys, "rollout", *args)
    assert rc == 0 and len(out.read_text().splitlines()) == 4, err
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    rc, _, err = cli(capsys, "rollout", *args, "--resume")
    lines = err.splitlines()  # no run header (no engine opened): the line, then the file's figures
    assert (rc, lines[0]) == (0, f"{out} is complete: 4 trajectories; nothing to resume"), err
    assert lines[1] == f"4 trajectories (0 this run, 4 from before the resume) -> {out}", err
    rows = {c[0]: c[1] for c in ([x.strip() for x in ln.split("│")[1:-1]] for ln in lines if ln.startswith("│"))}
    scored = [json.loads(ln)["reward"] for ln in out.read_text().splitlines()]
    assert rows["programs"] == "4" and rows["mean reward"] == str(round(sum(scored) / 4, 4)), err
    assert not any("this run" in k or "wall time" in k for k in rows), err  # nothing is measured now
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_resumed_run_prepares_sessions_for_the_programs_left_only(capsys, tmp_path, model_dir):
    """After a run stopped with one of its two groups written (its log: the header only), a
    --resume has 2 programs left: the sessions worth preparing ahead are those 2, not the run's 4."""
    from agentenv import journal
    from agentenv.config import OutputOptions, RolloutRunConfig, RunOptions
    from agentenv.registry import make
    from agentenv.rollout_run import RolloutJob, source_of

    out = tmp_path / "r.jsonl"
    args = ["--tasks", "2", "--group-size", "2", "--max-new-tokens", "8", "--no-progress", "--model", model_dir,
            "--out", str(out)]
    assert cli(capsys, "rollout", *args)[0] == 0
    lines = out.read_text().splitlines(keepends=True)
    first = json.loads(lines[0])["task_id"]
    out.write_text("".join(ln for ln in lines if json.loads(ln)["task_id"] == first))
    log = Path(f"{out}.log")
    settings = journal.load_state(journal.read(log)[0]).settings
    journal.Journal.create(log, settings).close()  # a log whose run logged nothing after its header

    opts = RolloutRunConfig(run=RunOptions(tasks=2, group_size=2), output=OutputOptions(out=out, resume=True))
    opts = replace(opts, engine=replace(opts.engine, model=model_dir),
                   rollout=replace(opts.rollout, max_new_tokens=8))
    job = RolloutJob.open(opts, make("retool-math"))
    try:
        assert len(job.resume.done) == 2 and source_of(job).programs == 2
    finally:
        job.log.close()


def test_train_sizes_its_evaluations_to_the_run_unless_eval_tasks_is_given():
    """``--eval-tasks 128`` is used as given even where it equals the environment's default;
    without the flag the evaluations are sized to the run (train.config.scaled_eval_tasks)."""
    from agentenv.cli import _commands

    def given(*args: str) -> bool:
        (train,) = [c for c in _commands(["train", *args]) if c.name == "train"]
        return train.run.keywords["eval_tasks_given"]

    assert given("--eval-tasks", "128") and given("--eval-tasks=128") and given("--steps", "5", "--eval-tasks", "4")
    assert not given("--steps", "5") and not given("--eval-k", "2") and not given()


@pytest.mark.slow
def test_train_then_resume_then_plot(tmp_path, model_dir):
    run = tmp_path / "run"
    common = ["--groups-per-step", "2", "--group-size", "2", "--max-new-tokens", "64", "--model", model_dir,
              "--out-dir", str(run), "--checkpoint-every", "1", "--no-progress", "--eval-every", "2",
              "--eval-tasks", "2", "--eval-k", "2"]
    r = agentenv("train", "--steps", "2", *common)
    assert r.returncode == 0, r.stderr
    # One rule for the streams: people's text on stderr, data (the summary's JSON) on stdout.
    assert "step    1/2" in r.stderr and "step    2/2" in r.stderr
    assert len(r.stdout.strip().splitlines()) == 1 and json.loads(r.stdout)["steps"] == 2
    assert "agentenv train: held-out evaluation: 2 x 2 tasks x 2 samples = 8 programs, beside the training's 8; " \
           "--eval-every 0 skips them" in r.stderr
    # retool-math's training defaults fill what the command line leaves out, and only that.
    line = next(ln for ln in r.stderr.splitlines() if "training defaults" in ln)
    assert "temperature=1.6" in line and "env_arg extra_digits=1" in line and "steps=" not in line
    config = json.loads((run / "config.json").read_text())  # by concern
    assert (config["rollout"]["temperature"], config["loss"]["aggregation"], config["env"]["env_kwargs"]) == (
        1.6,
        "sequence",
        {"extra_digits": 1},
    )
    assert (config["batch"]["groups_per_step"], config["optimiser"]["steps"], config["evaluation"]["eval_every"]) == (
        2, 2, 2)
    assert "eval after step 2 (v2)" in r.stderr
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()][-1] == 2
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["checkpoint"].endswith("step-000002")
    r = agentenv("train", "--steps", "3", "--resume", *common)
    assert r.returncode == 0, r.stderr
    assert "step    3/3" in r.stderr and "step    1/3" not in r.stderr
    assert [json.loads(x)["step"] for x in (run / "eval.jsonl").read_text().splitlines()][-1] == 3
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == [1, 2, 3]
    r = agentenv("plot", str(run))
    assert r.returncode == 0, r.stderr
    png = run / "curves.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    # A full fine-tuning checkpoint is a model directory the rollout command serves.
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", "--model", summary["checkpoint"], "--tasks", "2", "--group-size", "2",
                 "--max-new-tokens", "64", "--out", str(out), "--no-progress")
    assert r.returncode == 0, r.stderr
    assert len(out.read_text().splitlines()) == 4


@pytest.mark.parametrize(
    "args, message",
    [
        (["train", "--group-size", "1"], "group_size >= 2"),
        (["train", "--mode", "fast"], "invalid choice"),
        (["train", "--temperature", "0"], "argument --temperature: must be > 0, got 0"),
        (["train", "--env", "retool-mat"], "Did you mean 'retool-math'"),
        (["train", "--resume", "--overwrite"], "--resume and --overwrite exclude each other"),
        (["train", "--resume", "--out-dir", "/nonexistent/run"], "no checkpoint"),
        (["plot", "/nonexistent/run"], "no metrics.jsonl"),
    ],
)
def test_bad_train_and_plot_input_is_one_line_and_exit_2(args, message, capsys):
    rc, _, err = cli(capsys, *args)
    assert rc == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.parametrize("name, text, message", [
    ("rollouts.jsonl", '{"a": 1}\n', "rollouts.jsonl is not a training run's metrics.jsonl (line 1 has no 'step', "
                                     "'time_s', 'step_s', 'gen_tokens_per_s', 'gen_idle_frac')"),
    ("metrics.jsonl", '{"step": 1, "time_s": 1, "step_s": 1}\n',
     "metrics.jsonl is not a training run's metrics.jsonl (line 1 has no 'gen_tokens_per_s', 'gen_idle_frac')"),
    ("junk.txt", "hello\n", "junk.txt is not a training run's metrics.jsonl (line 1 is not JSON)"),
    ("list.jsonl", "[1, 2]\n", "list.jsonl is not a training run's metrics.jsonl (line 1 is not a JSON object)"),
])
def test_plot_of_a_file_that_is_not_a_runs_metrics_is_one_line(name, text, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path(name).write_text(text)
    rc, out, err = cli(capsys, "plot", name)
    assert (rc, out, err) == (2, "", f"agentenv: error: {message}; give an agentenv train --out-dir or its "
                                     "metrics.jsonl\n")
    assert [p.name for p in tmp_path.iterdir()] == [name]  # no curves.png


@pytest.mark.parametrize("files, path, message", [
    ({"a.jsonl": '{"a": 1}\n'}, "a.jsonl", "a.jsonl is not a rollout file, an eval report or a training run (line 1 "
                                           "is not a trajectory: no id and task_id)"),
    ({"junk.txt": "hello\n"}, "junk.txt", "junk.txt is not a rollout file, an eval report or a training run (line 1 "
                                          "is not JSON)"),
    ({"e.jsonl": ""}, "e.jsonl", "e.jsonl is not a rollout file, an eval report or a training run (it is empty, "
                                 "with no event log beside it)"),
    ({"r.jsonl": "", "r.jsonl.log": "{}\n"}, "r.jsonl.log", "r.jsonl.log is a rollout's event log: view its "
                                                            "output, r.jsonl"),
])
def test_view_of_a_file_that_is_no_run_is_one_line(files, path, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in files.items():
        Path(name).write_text(text)
    rc, out, err = cli(capsys, "view", "--no-browser", "--port", "0", path)
    assert (rc, out) == (2, "") and err.startswith(f"agentenv: error: {message}") and err.count("\n") == 1, err


class BrokenReward(RetoolMathEnv):
    async def reward(self, task, trajectory):
        raise RuntimeError("grader is down")


class HalfBrokenReward(RetoolMathEnv):
    """The reward fails for the first task's samples only."""

    async def reward(self, task, trajectory):
        if task.id == self.tasks(1, seed=0)[0].id:
            raise RuntimeError("grader is down")
        return await super().reward(task, trajectory)


@pytest.mark.slow
def test_a_reward_failing_for_every_trajectory_is_an_error_and_start_up_is_in_the_wall_time(tmp_path):
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", "--env", "tests.test_cli:BrokenReward", "--tasks", "2", "--group-size", "2",
                 "--max-new-tokens", "64", "--no-progress", "--out", str(out))
    assert r.returncode == 1, r.stderr[-2000:]  # nothing scored: a script must not go on to train on it
    text = " ".join(r.stderr.split())
    assert "error: the reward failed for 4 of 4 trajectories" in text and "grader is down" in text
    assert "nothing was scored, so the run exits 1" in text and "with start-up" in text
    assert [json.loads(line)["reward"] for line in out.read_text().splitlines()] == [None] * 4  # kept as data


@pytest.mark.slow
def test_a_reward_failing_for_some_trajectories_is_a_warning(tmp_path):
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", "--env", "tests.test_cli:HalfBrokenReward", "--tasks", "2", "--group-size", "2",
                 "--max-new-tokens", "64", "--no-progress", "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    text = " ".join(r.stderr.split())
    assert "warning: the reward failed for 2 of 4 trajectories" in text and "exits 1" not in text


@pytest.mark.parametrize("module, args, message", [
    ("httpx", ["rollout", "--engine", "openai", "--base-url", "http://127.0.0.1:9"],
     "--engine openai needs httpx: pip install 'agentenv[openai]'"),
    ("openai", ["eval", "--engine", "openai", "--base-url", "http://127.0.0.1:9"],
     "--engine openai needs openai: pip install 'agentenv[openai]'"),
    ("vllm", ["rollout", "--engine", "vllm"], "--engine vllm needs vllm: pip install 'agentenv[vllm]'"),
    ("e2b_code_interpreter", ["rollout", "--sandbox", "e2b"], "--sandbox e2b needs e2b_code_interpreter: "
                                                              "pip install 'agentenv[e2b]'"),
    ("ray", ["rollout", "--cluster", "ray"], "--cluster ray needs ray: pip install 'agentenv[ray]'"),
    ("ray", ["train", "--cluster", "ray"], "--cluster ray needs ray: pip install 'agentenv[ray]'"),
    ("wandb", ["train", "--report-to", "wandb"], "--report-to wandb needs wandb: pip install 'agentenv[tracking]'"),
    ("tiktoken", ["check-tokenizer", "--family", "qwen3"], "a family's tokenizer needs tiktoken: "
                                                            "pip install 'agentenv[families]'"),
    ("datasets", ["rollout", "--env", "dataset", "--env-arg", "source=some/hub-dataset"],
     "loading 'some/hub-dataset' needs datasets: pip install 'agentenv[datasets]'"),
])
def test_a_missing_extra_is_named_in_one_line_before_anything_is_written(module, args, message, capsys,
                                                                          tmp_path, monkeypatch):
    """The extra that installs everything the option needs (a missing httpx is never "cannot
    reach ..."), said before a file or a run directory is made."""
    from agentenv.models.families import _build

    _build.cache_clear()  # a family tokenizer built by another test would not look for its modules
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("E2B_API_KEY", "unused")
    monkeypatch.setitem(sys.modules, module, None)
    rc, _, err = cli(capsys, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert rc == 2 and message in lines[-1], err
    assert list(tmp_path.iterdir()) == []


ENV_FILES = {
    "one.py": "from agentenv.envs.retool_math import RetoolMathEnv\n\n\nclass OnlyEnv(RetoolMathEnv):\n"
              "    '''The one class.'''\n\n\ndef factory():\n    return None\n",
    "two.py": "from agentenv.envs.retool_math import RetoolMathEnv\n\n\nclass EnvA(RetoolMathEnv):\n    pass\n\n\n"
              "class EnvB(RetoolMathEnv):\n    pass\n",
    "none.py": "from agentenv.envs.retool_math import RetoolMathEnv  # imported, not defined here\n",
    "plain.py": "class Plain:\n    pass\n",
}


@pytest.mark.parametrize("env, message", [
    ("./one.py:factory", "./one.py:factory is a function, not an Environment subclass: one named as an environment "
                         "must return an Environment, and this one returned NoneType"),
    ("./two.py", "./two.py defines 2 Environment subclasses (EnvA, EnvB): add :ClassName, e.g. ./two.py:EnvA"),
    ("./none.py", "./none.py defines no Environment subclass"),
    ("./plain.py:Plain", "./plain.py:Plain is the class Plain, which does not subclass agentenv.Environment"),
    ("./one.py:OnlyEnv.tasks", "./one.py:OnlyEnv.tasks is a method (RetoolMathEnv.tasks), not an Environment class "
                               "or factory: name the class (./one.py:OnlyEnv) or a function that returns an "
                               "Environment"),
    ("dataset", "environment 'dataset' needs --env-arg source=... (source: str)"),
])
def test_env_messages_say_what_was_named_and_what_to_give(env, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name, text in ENV_FILES.items():
        (tmp_path / name).write_text(text)
    rc, out, err = cli(capsys, "rollout", "--env", env, "--out", "r.jsonl")
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert (rc, out, len(lines)) == (2, "", 1) and message in lines[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(ENV_FILES)  # no r.jsonl, no r.jsonl.log


def test_a_file_with_one_environment_class_is_that_class(tmp_path, monkeypatch):
    """``--env ./one.py`` (the rollout itself: test_an_environment_from_the_users_own_file)."""
    from agentenv.registry import env_kwargs, make

    monkeypatch.chdir(tmp_path)
    (tmp_path / "one.py").write_text(ENV_FILES["one.py"])
    assert env_kwargs("./one.py", ["extra_digits=1"]) == {"extra_digits": 1}  # --env-arg checked against it
    env = make("./one.py", extra_digits=1)
    assert type(env).__name__ == "OnlyEnv"
    assert Path(sys.modules[type(env).__module__].__file__) == tmp_path / "one.py"


def test_a_refused_run_creates_nothing(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "r.jsonl").write_text("{}\n")
    rc, _, err = cli(capsys, "rollout", "--out", "r.jsonl")
    assert rc == 2 and "r.jsonl exists and is not empty" in err
    assert [p.name for p in tmp_path.iterdir()] == ["r.jsonl"] and (tmp_path / "r.jsonl").read_text() == "{}\n"


@pytest.mark.parametrize("args", [["--env-arg", "extra_digits=abc"], ["--env", "nosuch"],
                                  ["--model", "/nonexistent/model"]])
def test_a_bad_env_or_model_leaves_no_output_or_log(args, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for command in ("rollout", "eval"):
        rc, _, err = cli(capsys, command, *args, "--out", "r.jsonl")
        assert rc == 2, err
    assert list(tmp_path.iterdir()) == []


RUN = ["--tasks", "1", "--group-size", "1", "--max-new-tokens", "8", "--no-progress"]
BAD_ENGINE = ["--engine-arg", "bogus=1"]  # the engine fails to start once the sandbox is up


def test_a_failed_engine_start_leaves_no_output_or_log(capsys, tmp_path, model_dir):
    out = tmp_path / "r.jsonl"
    rc, _, err = cli(capsys, "rollout", *RUN, *BAD_ENGINE, "--model", model_dir, "--out", str(out))
    assert rc == 2 and "bad --engine-arg for the embedded engine" in err, err[-2000:]
    assert ("unexpected keyword argument 'bogus'; the embedded engine takes max_model_len, page_size, "
            "kv_cache_tokens, max_batch_tokens" in err), err[-2000:]
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
def test_a_resumed_run_whose_engine_fails_to_start_keeps_its_files(tmp_path, model_dir):
    out = tmp_path / "r.jsonl"
    r = agentenv("rollout", *RUN, "--model", model_dir, "--out", str(out))
    assert r.returncode == 0, r.stderr[-2000:]
    # As if it had been killed before its program finished: the log's header alone, no line
    # (a complete run's --resume has nothing to do and opens no engine).
    log = Path(f"{out}.log")
    log.write_bytes(log.read_bytes().split(b"\n", 1)[0] + b"\n")
    out.write_bytes(b"")
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["r.jsonl", "r.jsonl.log"] and before["r.jsonl.log"]
    r = agentenv("rollout", *RUN, *BAD_ENGINE, "--model", model_dir, "--out", str(out), "--resume")
    assert r.returncode == 2 and "bad --engine-arg" in r.stderr, r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


@pytest.mark.slow
def test_an_eval_overwrite_whose_engine_fails_to_start_keeps_the_old_run(tmp_path, model_dir):
    """The engine of ``eval --overwrite`` (``--engine openai`` at a port nothing listens on)
    fails to start: the old output, log and report are there byte for byte, so a ``--resume``
    with the new settings is refused by the old log's header."""
    out = tmp_path / "r.jsonl"
    small = ["--tasks", "2", "--k", "2", "--max-new-tokens", "8", "--no-progress"]
    r = agentenv("eval", *small, "--model", model_dir, "--out", str(out), "--temperature", "1.0")
    assert r.returncode == 0, r.stderr[-2000:]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    assert sorted(before) == ["r.jsonl", "r.jsonl.log", "r.report.json"] and before["r.jsonl"]
    r = agentenv("eval", *small, "--model", model_dir, "--out", str(out), "--temperature", "0.5", "--overwrite",
                 "--engine", "openai", "--base-url", "http://127.0.0.1:9")
    assert r.returncode == 2 and "cannot reach http://127.0.0.1:9" in r.stderr, r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before
    r = agentenv("eval", *small, "--model", model_dir, "--out", str(out), "--temperature", "0.5", "--resume")
    assert r.returncode == 2 and "temperature was 1.0, now 0.5" in r.stderr, r.stderr[-2000:]
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_a_run_directory_without_a_step_does_not_block_the_next_train(tmp_path, capsys):
    """A start that failed before its first step left config.json and an empty metrics.jsonl:
    nothing to resume or to lose, so the next run is not refused (it fails here on its model)."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    (run / "metrics.jsonl").write_text("")
    rc, _, err = cli(capsys, "train", "--out-dir", str(run), "--model", "/nonexistent/model")
    assert rc == 2 and "model directory not found" in err and "earlier run" not in err, err


@pytest.mark.slow
def test_a_train_stopped_before_its_first_step_leaves_no_run_directory(tmp_path, model_dir):
    import signal

    run = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "agentenv.cli", "train", "--out-dir", str(run), "--model", model_dir, "--steps", "1",
         "--no-progress", "--report-to", "none"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal (see above)
    # config.json is written once the engine and the policy are up; the held-out evaluation
    # before step 1 (128 tasks x 4) is under way then.
    wait_for(
        lambda: (run / "config.json").exists(), "the run wrote config.json", unless=lambda: proc.poll() is not None
    )
    assert proc.poll() is None, proc.communicate()[1][-2000:]
    proc.send_signal(signal.SIGINT)
    _, err = ended(proc, "the training run stopped after Ctrl-C")
    assert proc.returncode == 130, err[-2000:]
    assert not run.exists()
