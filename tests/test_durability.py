"""Durable rollouts: the CLI killed (SIGKILL) at seeded random points, then ``--resume``d
until done, loses and duplicates nothing; refusals; a full disk. Real CLI processes, the
bundled model on the embedded engine, the real sandbox pool."""

from __future__ import annotations

import contextlib
import json
import os
import random
import re
import signal
import subprocess
import sys
import time
import zlib
from dataclasses import asdict
from pathlib import Path

import anyio
import pytest
from transformers import AutoTokenizer

from agentenv import Reactor, RolloutConfig, inflight, journal
from agentenv.models import default_model
from agentenv.trajectory import ToolCall, Trajectory, TurnStats
from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.sandboxes.local import LocalSandbox

from .sandboxes.hostile import TEST_MOUNT
from .waiting import ended, until

TASKS, GROUP = 3, 2
ARGS = ["rollout", "--tasks", str(TASKS), "--group-size", str(GROUP), "--no-progress", "--concurrency", "4"]


def cli(out: Path, *extra: str, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentenv.cli", *ARGS, "--out", str(out), *extra],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True, **kw)


def log_records(out: Path) -> int:
    try:
        return len(journal.read(Path(f"{out}.log"))[0])
    except OSError:
        return 0


def mid_flight(out: Path) -> bool:
    """Whether the log holds a program that logged a turn and has not ended (no line in --out)."""
    text = out.read_text() if out.exists() else ""
    ended = {json.loads(line)["id"] for line in text[: text.rfind("\n") + 1].splitlines()}
    state = journal.load_state(journal.read(Path(f"{out}.log"))[0])
    return any(p.turns and p.id not in ended for p in state.partial.values())


def kill_at(proc: subprocess.Popen, out: Path, records: int, deadline: float = 300, *,
            in_flight: bool = False) -> bool:
    """SIGKILL the CLI once its event log holds ``records`` records, and with ``in_flight`` once
    a program is mid-flight too (the CLI stopped while its files are read, so they are what it
    is killed with); False if it ended first."""
    end = time.time() + deadline
    while time.time() < end and proc.poll() is None:
        if log_records(out) >= records:
            os.killpg(proc.pid, signal.SIGSTOP)
            if not in_flight or mid_flight(out):
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                return True
            os.killpg(proc.pid, signal.SIGCONT)
            if in_flight:
                continue  # look again at once: a program is mid-flight (turn logged, not done) for moments
        time.sleep(0.02)
    proc.communicate(timeout=deadline)
    return False


def summary_of(err: str) -> tuple[str, dict[str, str]]:
    """The title and the rows of the closing summary table in a run's stderr (not a terminal:
    plain lines, a row per line)."""
    title = next(line for line in err.splitlines() if re.match(r"\d+ trajectories ", line))
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in err.splitlines() if line.startswith("│")]
    return title, dict(cells)


def check_output(out: Path, tok) -> list[str]:
    lines = out.read_text().splitlines()
    keys = []
    for line in lines:
        d = json.loads(line)
        traj = Trajectory.from_dict(d)  # aligned arrays, masks, segments agree with input_ids
        assert tok.decode(traj.completion_ids, skip_special_tokens=False) == traj.text
        keys.append((traj.task_id, traj.sample_index))
    assert sorted(keys) == sorted(set(keys)), "a trajectory was written twice"
    assert len(keys) == TASKS * GROUP, f"{len(keys)} of {TASKS * GROUP} trajectories"
    return lines


@pytest.mark.timeout(1500)
@pytest.mark.slow
def test_killed_at_random_points_and_resumed_loses_nothing(tmp_path):
    tok = AutoTokenizer.from_pretrained(str(default_model()))
    rng = random.Random(0)
    resumed_programs = 0
    for trial in range(6):
        out = tmp_path / f"run{trial}.jsonl"
        # Header + starts + turns + dones of a run this size: roughly 3 records per program.
        kills = [rng.randint(2, 3 * TASKS * GROUP)]
        if trial % 3 == 0:
            kills.append(rng.randint(1, 6))  # and kill the first resume too
        # Two runs killed once are killed early, with a program mid-flight: on a busy machine a
        # kill at a record count alone may land only between programs in every trial.
        in_flight = trial in (1, 4)
        if in_flight:
            kills = [min(kills[0], 4)]
        proc, done_before, partial_before, resumed = cli(out), b"", {}, False
        for k, at in enumerate(kills):
            if not kill_at(proc, out, at if k == 0 else log_records(out) + at, in_flight=in_flight):
                break
            done_before = out.read_bytes() if out.exists() else b""
            state = journal.load_state(journal.read(Path(f"{out}.log"))[0])
            partial_before = {p.id: p for p in state.partial.values()}
            proc, resumed = cli(out, "--resume"), True
        _, err = ended(proc, "the run ended", timeout=600)
        assert proc.returncode == 0, err[-2000:]
        lines = check_output(out, tok)
        # Lines complete before the last kill are byte-identical after it (a torn last line,
        # if any, is dropped and its program redone).
        complete_before = done_before[: done_before.rfind(b"\n") + 1]
        assert out.read_bytes().startswith(complete_before)
        # The closing summary describes the whole file, the lines from before the resume included.
        title, table = summary_of(err)
        scored = [r for r in (json.loads(line)["reward"] for line in lines) if r is not None]
        assert table["programs"] == str(len(lines)), (title, table)
        assert table["mean reward"] == str(round(sum(scored) / len(scored), 4) if scored else None), table
        if resumed and "nothing to resume" in err:  # the kill came after the last line: the file's figures alone
            assert title.startswith(f"{len(lines)} trajectories (0 this run, {len(lines)} from before the resume)"), (
                title
            )
        elif resumed:
            before = len(complete_before.splitlines())
            assert title.startswith(f"{len(lines)} trajectories ({len(lines) - before} this run, {before} from "
                                    "before the resume) -> "), title
            assert "tokens/s (this run)" in table and "wall time (this run)" in table
        # Programs in flight at the kill continued token-exact from their last logged turn.
        # (A program whose line reached --out while its log's "done" record was still in the
        # log's buffer looks in flight to the log alone: its line is what counts.)
        finished_before = {json.loads(line)["id"] for line in complete_before.decode().splitlines()}
        for line in lines:
            d = json.loads(line)
            p = partial_before.get(d["id"])
            if p is None or not p.turns or d["id"] in finished_before:
                continue
            resumed_programs += 1
            assert d["metadata"]["resumed"]["from_turn"] >= len(p.turns)
            assert d["segments"][: len(p.segments)] == [asdict(s) for s in p.segments]
            assert d["prompt_ids"] == p.prompt_ids
    assert resumed_programs > 0, "no trial caught a program mid-flight"


def test_a_version_1_log_reads_and_the_typed_records_write_it_byte_for_byte(tmp_path):
    """The on-disk format is as documented: a version-1 log framed by hand (CRC-32, a space,
    compact JSON in the documented key order; one ``start`` without a ``group``, as a log may
    hold) loads into the state it describes (its header through the upgrade), and the typed
    records written for the same events are the same bytes, under a version-2 header."""
    t = Trajectory(id="k0", env="e", task_id="t", group_id="t#g", sample_index=0, prompt_ids=[1, 2])
    t.add_model([3, 4], [-0.5, -0.25], 0)
    t.tool_calls.append(ToolCall(0, "python", {"code": "1"}, "1", "ok", 0.5))
    t.add_env([5])
    t.turns.append(TurnStats(2, 0, 2, "stop", 0.1, 0))
    seg = ('[{"kind":"model","token_ids":[3,4],"logprobs":[-0.5,-0.25],"weight_versions":[0,0]},'
           '{"kind":"env","token_ids":[5],"logprobs":null,"weight_versions":null}]')
    bodies = ['{"e":"header","v":1,"settings":{"seed":3}}',
              '{"e":"start","k":"k0","task":"t","sample":0,"group":"t#g","prompt":[1,2]}',
              '{"e":"turn","k":"k0","turn":1,"segments":' + seg + ','
              '"tools":[{"turn":0,"name":"python","arguments":{"code":"1"},"output":"1","status":"ok",'
              '"duration_s":0.5,"error":null}],"stats":[{"prompt_tokens":2,"cached_tokens":0,"new_tokens":2,'
              '"finish_reason":"stop","latency_s":0.1,"weight_version":0}]}',
              '{"e":"start","k":"k1","task":"t","sample":1,"prompt":[1,2]}',
              '{"e":"done","k":"k1","task":"t","sample":1}']
    framed = b"".join(b"%08x %s\n" % (zlib.crc32(b.encode()), b.encode()) for b in bodies)
    old = tmp_path / "old.log"
    old.write_bytes(framed)
    state = journal.load_state(journal.read(old)[0])
    assert state.settings == {**journal.V1_IMPLIED_SETTINGS, "seed": 3}
    assert state.done == {("t", 1)} and state.groups == {"t": "t#g"}
    p = state.partial[("t", 0)]
    assert (p.id, p.prompt_ids, p.segments, p.tool_calls, p.turns) == ("k0", [1, 2], t.segments, t.tool_calls, t.turns)
    new = journal.Journal.create(tmp_path / "new.log", {"seed": 3})
    new.start(t)
    new.turn(t, [0, 0, 0])
    new.write(journal.Start("k1", "t", 1, "", [1, 2]))
    new.done(Trajectory(id="k1", env="e", task_id="t", group_id="", sample_index=1, prompt_ids=[1, 2]))
    new.close()
    written = new.path.read_bytes().splitlines(keepends=True)
    assert written[0] == journal.encode(json.loads('{"e":"header","v":2,"settings":{"seed":3}}'))
    assert written[1:3] + written[4:] == framed.splitlines(keepends=True)[1:3] + framed.splitlines(keepends=True)[4:]
    assert [journal.parse(json.loads(line[9:])) for line in written[1:]] == \
        [journal.parse(json.loads(b)) for b in bodies[1:]]  # the start without a group reads as group ""


def test_existing_output_is_refused_without_resume_or_overwrite(tmp_path):
    out = tmp_path / "r.jsonl"
    out.write_text('{"x": 1}\n')
    r = subprocess.run([sys.executable, "-m", "agentenv.cli", *ARGS, "--out", str(out)], capture_output=True, text=True)
    assert r.returncode == 2 and "--resume" in r.stderr and "--overwrite" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and out.read_text() == '{"x": 1}\n'


def test_resume_with_different_settings_is_refused(tmp_path):
    out = tmp_path / "r.jsonl"
    settings = {"env": "retool-math", "tasks": TASKS}
    journal.Journal.create(Path(f"{out}.log"), settings).close()
    r = subprocess.run([sys.executable, "-m", "agentenv.cli", *ARGS, "--seed", "7", "--out", str(out), "--resume"],
                       capture_output=True, text=True)
    assert r.returncode == 2 and "cannot resume with different settings" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a small tmpfs needs root")
@pytest.mark.slow
def test_a_full_disk_is_a_clear_error_and_earlier_lines_survive(tmp_path):
    mnt = tmp_path / "small"
    mnt.mkdir()
    # Named so that the host-state check of a run beside this one knows it (tests/sandboxes/hostile.py).
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=40k", TEST_MOUNT, str(mnt)], check=True)
    try:
        out = mnt / "r.jsonl"
        r = subprocess.run([sys.executable, "-m", "agentenv.cli", *ARGS, "--out", str(out)],
                           capture_output=True, text=True, timeout=600)
        assert r.returncode == 2, r.stderr[-1000:]
        assert "No space left on device" in r.stderr and "Traceback" not in r.stderr
        lines = out.read_text().splitlines()
        for line in lines[:-1]:
            Trajectory.from_dict(json.loads(line))
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False)


class SlowPrint(RetoolMathEnv):
    """print() takes 0.3 s, so sandbox calls are long enough to be killed in the middle."""

    def sandbox_setup(self):
        return ("import builtins, time\n_p = builtins.print\n"
                "builtins.print = lambda *a, **k: (time.sleep(0.3), _p(*a, **k))[1]")


@pytest.mark.anyio
@pytest.mark.slow
async def test_sandbox_workers_and_the_fork_server_killed_mid_run_lose_nothing(engine):
    env, rng = SlowPrint(extra_digits=0), random.Random(1)
    config = RolloutConfig(max_turns=4, max_new_tokens=256, concurrency=4, tool_timeout=5)
    kills = {"workers": 0, "servers": 0}
    async with LocalSandbox(prewarm=2) as sb:

        def busy() -> list[int]:  # workers in a call (their session holds its lock)
            return sorted(sb.busy_pids)

        async def killer() -> None:
            # First the fork server (its templates and sessions die with it), as soon as the
            # first sessions exist: before the model has written any code, so the programs'
            # first calls need a new server. Then, up to six times, a worker in the middle of a
            # call: each kill crashes that call, which the program's session restores.
            await until(lambda: sb.worker_pids, "the first sandbox sessions started")
            os.kill(sb.server_pid, signal.SIGKILL)
            kills["servers"] += 1
            killed: set[int] = set()
            while kills["workers"] < 6:
                pids = await until(lambda: [p for p in busy() if p not in killed], "a sandbox call under way")
                victim = rng.choice(pids)
                killed.add(victim)
                with contextlib.suppress(ProcessLookupError):
                    os.kill(victim, signal.SIGKILL)
                    kills["workers"] += 1

        async with anyio.create_task_group() as tg:
            tg.start_soon(killer)
            with anyio.fail_after(300):
                groups = await Reactor(engine, env, sb, config).collect(env.tasks(8, seed=3), 2)
            tg.cancel_scope.cancel()
    trajs = [t for g in groups for t in g.trajectories]
    assert kills["servers"] == 1 and kills["workers"] >= 3, \
        f"precondition: the fork server and 3 workers in a call were killed {kills} " \
        f"{[(t.finish_reason, len(t.tool_calls), t.error) for t in trajs]}"
    assert sb.restarts >= 1
    assert sorted((t.task_id, t.sample_index) for t in trajs) == sorted(
        (t.id, i) for t in env.tasks(8, seed=3) for i in range(2)
    )
    assert not [t.finish_reason for t in trajs if t.finish_reason.startswith("error")], [t.error for t in trajs]
    crashed = [c for t in trajs for c in t.tool_calls if c.error == "crashed"]
    restores = [r for t in trajs for r in t.metadata.get("session_restores", [])]
    # A call the session died in tells the model how many earlier calls were run again. A
    # worker chosen while in a call can also finish that call before the kill lands (it is
    # another process): then the program's next call runs on a new worker, and is told its
    # earlier variables are lost.
    replayed = [c for t in trajs for c in t.tool_calls
                if re.search(r"\[session restarted: \d+ earlier calls? (was|were) run again\]", c.output)]
    assert crashed, "precondition: a call was killed mid-way (recorded as crashed)"
    assert len(restores) == len(replayed) >= len(crashed), [(c.status, c.error, c.output) for c in replayed]
    assert all(r["complete"] for r in restores)
    for t in trajs:  # a killed call is an ordinary tool error; what follows it ran on
        t.validate()


@pytest.mark.anyio
async def test_a_group_saved_mid_way_continues_token_exact(engine):
    """What a trainer checkpoint saves of a group in flight (``inflight.InFlight``): finished
    programs whole, running ones up to their last completed turn. A new reactor continues it
    (``Reactor.group(resume=, finished=)``): the group comes back complete, the finished
    trajectories as they were, the running ones continued from the same tokens."""
    env, task = RetoolMathEnv(extra_digits=0), RetoolMathEnv(extra_digits=0).tasks(1, seed=11)[0]
    config = RolloutConfig(max_turns=4, max_new_tokens=256, concurrency=4)
    tracker = inflight.InFlight()
    async with LocalSandbox() as sb:
        reactor = Reactor(engine, env, sb, config, journal=tracker)
        with anyio.move_on_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(reactor.group, task, 4)
                await until(
                    lambda: any(p.stats for s in tracker.snapshot({task.id}).values() for p in s.partial),
                    "a program completed a turn",
                )
                tg.cancel_scope.cancel()  # the "crash": mid-way through the group
        saved = tracker.snapshot({task.id})[task.id]
        snap = json.loads(json.dumps(saved.to_dict()))  # as the checkpoint stores it
        resume, finished = inflight.restore(inflight.read_snapshot(snap))
        mid = [p for p in resume.partial.values() if p.turns]
        assert mid, "no program had completed a turn"
        group = await Reactor(engine, env, sb, config).group(task, 4, resume=resume, finished=finished)
    assert sorted(t.sample_index for t in group.trajectories) == [0, 1, 2, 3]
    assert {t.group_id for t in group.trajectories} == {saved.partial[0].group_id}  # the group keeps its id
    by_id = {t.id: t for t in group.trajectories}
    for d in snap["finished"]:  # programs that had ended are kept, not run again
        assert {k: by_id[d["id"]].to_dict()[k] for k in ("prompt_ids", "segments", "tool_calls")} == \
            {k: d[k] for k in ("prompt_ids", "segments", "tool_calls")}
    for p in mid:
        t = by_id[p.id]
        assert t.metadata["resumed"]["from_turn"] == len(p.turns) and t.segments[: len(p.segments)] == p.segments
        assert t.reward is not None and not t.finish_reason.startswith("error")
        t.validate()
