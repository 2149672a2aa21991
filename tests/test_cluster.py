"""Rollouts on a real local Ray cluster (one per test session): two rollout workers, each a Ray
actor with its own embedded engine, reactor and sandbox pool."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from agentenv import Reactor, RolloutConfig, make  # noqa: E402
from agentenv.cluster import RayRollouts  # noqa: E402
from agentenv.sandboxes.local import LocalSandbox  # noqa: E402
from agentenv.trajectory import Trajectory  # noqa: E402

from .waiting import until, until_ok  # noqa: E402

pytestmark = pytest.mark.anyio
CONFIG = RolloutConfig(concurrency=8, max_new_tokens=192)


@pytest.fixture
def cluster(ray_cluster):
    return ray_cluster


def keys(trajs) -> list[tuple[str, int]]:
    return sorted((t.task_id, t.sample_index) for t in trajs)


async def test_two_workers_produce_what_a_local_run_produces(cluster, engine, tokenizer):
    env = make("retool-math")
    tasks = env.tasks(6, seed=3)
    async with RayRollouts("retool-math", workers=2, config=CONFIG, seed=3) as c:
        async with c.rollouts(tasks, group_size=2) as received:
            groups = [g async for g in received]
        assert len(set(c.pids)) == 2 and os.getpid() not in c.pids  # two actor processes did the work
        with pytest.warns(DeprecationWarning, match="async with cluster.rollouts"):  # the former use still runs
            again = [g async for g in c.rollouts(tasks[:1], group_size=2)]
        assert [len(g.trajectories) for g in again] == [2] and again[0].task.id == tasks[0].id
        assert c.prepared > 0  # the workers started sandbox sessions while their engines loaded
    remote = [t for g in groups for t in g.trajectories]
    async with LocalSandbox() as sb, Reactor(engine, env, sb, CONFIG) as reactor:
        local = [t for g in await reactor.collect(tasks, 2) for t in g.trajectories]
    assert keys(remote) == keys(local) == sorted((t.id, i) for t in tasks for i in range(2))
    for t in remote:
        again = Trajectory.from_dict(json.loads(json.dumps(t.to_dict())))  # aligned arrays, masks, segments
        assert again.input_ids[: len(t.prompt_ids)] == t.prompt_ids
        assert tokenizer.decode(t.completion_ids, skip_special_tokens=False) == t.text
        assert t.finish_reason in ("stop", "length", "max_turns", "context_overflow")
        assert t.reward is not None
    # Groups arrive whole, as the reactor's Group objects.
    assert sorted(g.task.id for g in groups) == sorted(t.id for t in tasks)
    for g in groups:
        assert [t.sample_index for t in g.trajectories] == [0, 1] and {t.task_id for t in g.trajectories} == {g.task.id}
        assert {t.group_id for t in g.trajectories} == {g.id}


def progressed(snapshot) -> bool:
    """A snapshot with work in it: a finished program, or one past its first turn."""
    return bool(snapshot.finished) or any(p.segments for p in snapshot.partial)


@pytest.mark.slow
async def test_a_worker_killed_mid_run_loses_nothing_and_its_programs_continue(cluster):
    # Trace programs (several turns, tools of ~0.3 s), so a worker dies with programs mid-way.
    spec = {"profile": "lognormal", "mean_turns": 4.0, "turn_tokens": 16, "tool_tokens": 8, "tool_median": 0.3,
            "tool_cap": 1.2, "prompt_tokens": 32}
    env = make("trace", **spec)
    config = RolloutConfig(concurrency=8, max_new_tokens=4096, max_turns=env.max_turns, tool_timeout=env.tool_timeout)
    tasks = env.tasks(8, seed=5)
    got = []
    async with RayRollouts("trace", workers=2, env_args=spec, config=config, seed=5, groups_per_worker=2,
                           snapshot_interval=0.2) as c:
        victim = c.workers[0]

        def kill_once_progressed() -> dict:
            """Kill the victim as soon as the driver holds a snapshot of progress made on it."""
            saved = {tid: s for tid, s in c.snapshots.items() if c.placed.get(tid) is victim and progressed(s)}
            if saved:
                ray.kill(victim)  # no await since `saved` was taken: the driver holds these (or later)
            return saved

        killer = asyncio.ensure_future(until(kill_once_progressed, "a group of the victim progressed"))
        async with c.rollouts(tasks, group_size=2) as received:
            async for g in received:
                got += g.trajectories
        assert killer.done(), "the run ended before a group of the victim had progressed"
        saved = killer.result()
        assert c.replaced == 1 and c.continued >= 1 and victim not in c.workers
    assert keys(got) == sorted((t.id, i) for t in tasks for i in range(2))  # every one, exactly once
    for t in got:  # every program, continued or not, ran its whole trace
        assert t.finish_reason == "stop" and len(t.tool_calls) == env.trace_of(t.task_id, t.sample_index).turns - 1
    # The victim's groups continued where the snapshot left them: finished programs as they
    # were, running ones from their last completed turn, their logged segments kept verbatim.
    by_key = {(t.task_id, t.sample_index): t.to_dict() for t in got}
    kept = 0
    for snap in saved.values():
        for d in snap.finished:
            assert by_key[(d["task_id"], d["sample_index"])]["segments"] == d["segments"]
            kept += 1
        for p in snap.partial:
            assert by_key[(p.task_id, p.sample_index)]["segments"][: len(p.segments)] == p.segments
            kept += bool(p.segments)
    assert kept >= 1


@pytest.mark.slow
async def test_leaving_a_rollout_early_or_on_an_error_leaves_the_workers_running_nothing(cluster, caplog):
    """``rollouts`` owns every call it makes: left while its groups run, or failing (an
    ``on_snapshot`` that raises: raised as it is, not wrapped in an exception group), it
    cancels its groups on the workers, whose in-flight programs are then none, well before
    their tool calls (20 s each) could have ended; no asyncio task is left pending."""
    import gc

    spec = {"profile": "swe", "mean_turns": 4.0, "turn_tokens": 16, "tool_tokens": 8, "tool_median": 20.0,
            "tool_cap": 40.0, "prompt_tokens": 32}
    env = make("trace", **spec)
    config = RolloutConfig(concurrency=8, max_new_tokens=4096, max_turns=env.max_turns, tool_timeout=env.tool_timeout)
    tasks = env.tasks(8, seed=9)
    ids = [t.id for t in tasks]

    def boom(tid: str, snap) -> None:
        raise ValueError(f"on_snapshot of {tid}")

    async with RayRollouts("trace", workers=2, env_args=spec, config=config, seed=9, groups_per_worker=2,
                           snapshot_interval=0.2) as c:

        async def idle() -> bool:
            busy = [s for w in c.workers for s in (await w.snapshot.remote(ids)).values()]
            if busy:
                raise LookupError(len(busy))
            return True

        async with c.rollouts(tasks, group_size=2):
            await until(lambda: len(c.snapshots) >= 2, "the workers' programs started")
        await until_ok(idle, LookupError, "the workers cancelled the groups left behind", timeout=15)
        with pytest.raises(ValueError, match="on_snapshot of"):
            async with c.rollouts(tasks, group_size=2, on_snapshot=boom) as received:
                async for _ in received:
                    pass
        await until_ok(idle, LookupError, "the workers cancelled the groups of the failed call", timeout=15)
        assert c.replaced == 0
    gc.collect()
    assert not [r for r in caplog.records if "destroyed but it is pending" in r.getMessage()]


@pytest.mark.slow
def test_cli_rollout_on_a_ray_cluster_killed_and_resumed(tmp_path):
    """The CLI on a local cluster, SIGKILLed mid-run (a torn line added to its output, as a
    crash mid-write leaves one), then ``--resume``: every sample exactly once, the finished
    lines kept as they were, and programs that had logged turns continue from them."""
    from agentenv import journal

    out, log = tmp_path / "r.jsonl", tmp_path / "r.jsonl.log"
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}
    env.pop("RAY_ADDRESS", None)  # the CLI starts a local cluster for the run, and stops it
    spec = {"mean_turns": 4.0, "turn_tokens": 16, "tool_tokens": 8, "tool_median": 0.3, "tool_cap": 1.2,
            "prompt_tokens": 32}
    cmd = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", "trace", "--tasks", "8", "--group-size", "2",
           "--cluster", "ray", "--workers", "2", "--concurrency", "8", "--max-new-tokens", "4096", "--out", str(out),
           "--no-progress", *[a for k, v in spec.items() for a in ("--env-arg", f"{k}={v}")]]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and proc.poll() is None:  # kill once a line and a logged turn exist
        logged = log.read_bytes() if log.exists() else b""
        if b'"e":"turn"' in logged and b'"e":"done"' in logged:
            proc.kill()
            break
        time.sleep(0.05)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, f"the run ended before it could be killed: {err.decode()[-2000:]}"
    before = out.read_text().splitlines(keepends=True)
    with out.open("a") as f:
        f.write('{"task_id": "torn')
    records, _ = journal.read(log)
    logged = journal.load_state(records).partial  # what the log says is in flight, before the resume
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "resuming:" in r.stderr and "workers replaced" in r.stderr
    lines = out.read_text().splitlines()
    trace = make("trace", **spec)
    got = [Trajectory.from_dict(json.loads(x)) for x in lines]
    assert keys(got) == sorted((t.id, i) for t in trace.tasks(8, seed=0) for i in range(2))  # each exactly once
    assert [x + "\n" for x in lines[: len(before)]] == before  # the finished lines, as they were
    for t in got:  # every program ran its whole trace, continued or not
        assert t.finish_reason == "stop" and len(t.tool_calls) == trace.trace_of(t.task_id, t.sample_index).turns - 1
    by_key = {(t.task_id, t.sample_index): t for t in got}
    written = {(d["task_id"], d["sample_index"]) for d in map(json.loads, before)}
    continued = [p for p in logged.values() if p.segments and (p.task_id, p.sample_index) not in written]
    assert continued, "no program had a logged turn when the run was killed"
    for p in continued:
        t = by_key[(p.task_id, p.sample_index)]
        assert t.segments[: len(p.segments)] == p.segments  # its logged turns, verbatim
        assert t.metadata["resumed"]["from_turn"] >= 1


@pytest.mark.slow
async def test_workers_share_engine_actors_and_a_killed_engine_loses_nothing(cluster):
    """Two rollout workers, two engine actors serving both (every worker routes over both by
    KV room); one engine actor is killed mid-run: Ray restarts it, the requests it had are
    served again by the other, and every program runs its whole trace exactly once."""
    spec = {"profile": "lognormal", "mean_turns": 4.0, "turn_tokens": 16, "tool_tokens": 8, "tool_median": 0.3,
            "tool_cap": 1.2, "prompt_tokens": 32}
    env = make("trace", **spec)
    config = RolloutConfig(concurrency=8, max_new_tokens=4096, max_turns=env.max_turns, tool_timeout=env.tool_timeout)
    tasks = env.tasks(8, seed=7)
    half = {"num_cpus": 0.5}  # 2 workers + 2 engines on the session's 2 CPUs
    got = []
    async with RayRollouts("trace", workers=2, engines=2, env_args=spec, config=config, seed=7, groups_per_worker=2,
                           worker_options=half, engine_options=half) as c:
        victim = c.engine_actors[0]
        before = await victim.info.remote()

        async def kill_once_serving() -> int:
            async def served() -> int:
                n = (await victim.info.remote())["served"]
                if n < 4:
                    raise LookupError(n)
                return n

            n = await until_ok(served, LookupError, "the engine actor served 4 requests", interval=0.025)
            ray.kill(victim, no_restart=False)  # Ray restarts it (max_restarts)
            return n

        killer = asyncio.ensure_future(kill_once_serving())
        async with c.rollouts(tasks, group_size=2) as received:
            async for g in received:
                got += g.trajectories
        assert killer.done(), "the run ended before the engine actor served 4 requests"
        assert killer.result() >= 4
        assert c.replaced == 0  # no rollout worker died: the engine's loss was absorbed below them
        infos = await until_ok(lambda: asyncio.gather(*(a.info.remote() for a in c.engine_actors)),
                               ray.exceptions.RayActorError, "the killed engine actor restarted")
        assert infos[0]["pid"] != before["pid"]  # restarted
        assert infos[1]["served"] > 0  # the other engine served too
    assert keys(got) == sorted((t.id, i) for t in tasks for i in range(2))  # every one, exactly once
    for t in got:  # every program ran its whole trace
        assert t.finish_reason == "stop" and len(t.tool_calls) == env.trace_of(t.task_id, t.sample_index).turns - 1


# -- agent environments: the gateway inside each worker ------------------------------------
def three_calls_seen(tok, traj, question: str) -> list[dict]:
    """What the gateway answered a ``ThreeCalls`` program (``tests/agent_envs.py``), in the
    form ``test_agent_frameworks.check_token_exact`` checks a row against: the messages the
    agent sends each call (its replies are put in by the check, as sampled), and each call's
    sampled ids and logprobs (the row's mask-1 ids, cut by each turn's new tokens)."""
    row = traj.sequences()[0]
    ids = [i for i, m in zip(row.input_ids, row.loss_mask) if m]
    lps = [lp for lp, m in zip(row.logprobs, row.loss_mask) if m]
    calls, at, messages = [], 0, [{"role": "user", "content": question}]
    for k, turn in enumerate(traj.turns):
        mine = ids[at: at + turn.new_tokens]
        calls.append({"branch": 0, "messages": list(messages), "tools": None, "ids": mine,
                      "lp": lps[at: at + turn.new_tokens], "eos": bool(mine) and mine[-1] == tok.eos_token_id})
        messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": f"Go on ({k})."}]
        at += turn.new_tokens
    assert at == len(ids)
    return calls


def check_three_calls(tok, trajs, tasks, replayed_ids: dict) -> None:
    """Every program made its three calls, its row token-exact; those in ``replayed_ids``
    (program id -> the ids its first call sampled before the loss) had that call answered
    from the snapshot or log, the very ids, and none started again."""
    from .test_agent_frameworks import check_token_exact

    question = {t.id: t.question for t in tasks}
    for t in trajs:
        g = t.metadata["gateway"]
        assert t.finish_reason == "stop" and (g["calls"], g["restarts"]) == (3, 0), g
        assert g["replayed"] == (1 if t.id in replayed_ids else 0), (t.id, g)
        check_token_exact(tok, t, three_calls_seen(tok, t, question[t.task_id]))
        if t.id in replayed_ids:
            first = next(s for s in t.segments if s.kind == "model")
            assert first.token_ids == replayed_ids[t.id], "the replayed call's ids are not the ones sampled before"


@pytest.mark.slow
async def test_an_agent_environment_on_workers_a_killed_worker_replays_its_agents(cluster, tmp_path):
    """An ``AgentEnvironment`` on two workers, each serving its programs' calls from its own
    gateway. Every agent waits after its first call (until the file ``go`` exists); once the
    driver holds a snapshot of the victim's programs with that call, the victim is killed: its
    groups continue on the live workers, each agent replayed from its snapshotted call (the
    ids sampled on the victim) then live. Every program exactly once, every row token-exact."""
    from transformers import AutoTokenizer

    from .agent_envs import ThreeCalls
    from .test_gateway import HERMES

    go, env = tmp_path / "go", ThreeCalls()
    tasks = env.tasks(4, seed=1)
    got = []
    async with RayRollouts(env, workers=2, model=str(HERMES), config=RolloutConfig(concurrency=8),
                           groups_per_worker=2, snapshot_interval=0.2,
                           worker_options={"runtime_env": {"env_vars": {"AGENTENV_TEST_GO": str(go)}}}) as c:
        victim = c.workers[0]

        def kill_once_called() -> dict:
            """The victim's two groups, each of whose programs the driver holds with a call."""
            saved = {tid: s for tid, s in c.snapshots.items() if c.placed.get(tid) is victim
                     and len(s.partial) == 2 and all(p.calls for p in s.partial)}
            if len(saved) < 2:
                return {}
            ray.kill(victim)  # no await since `saved` was taken: the driver holds these
            go.touch()
            return saved

        killer = asyncio.ensure_future(until(kill_once_called, "the victim's agents made their first calls"))
        async with c.rollouts(tasks, group_size=2) as received:
            async for g in received:
                got += g.trajectories
        saved = killer.result()
        assert c.replaced == 1 and c.rerun == c.continued == 2 and victim not in c.workers
    assert keys(got) == sorted((t.id, i) for t in tasks for i in range(2))  # every one, exactly once
    before = {p.key: p.calls[0]["g"]["ids"] for s in saved.values() for p in s.partial}
    assert len(before) == 4
    check_three_calls(AutoTokenizer.from_pretrained(HERMES), got, tasks, before)


@pytest.mark.slow
def test_cli_agent_rollout_on_ray_killed_and_resumed_replays_from_the_log(tmp_path):
    """``agentenv rollout --cluster ray`` of an agent environment, its driver SIGKILLed while
    every agent waits after its first call (logged from the workers' snapshots), then
    ``--resume``: each agent replayed from the logged call, the very ids, then live; every
    sample exactly once, every row token-exact."""
    from transformers import AutoTokenizer

    from agentenv import journal

    from .agent_envs import ThreeCalls
    from .test_durability import summary_of
    from .test_gateway import HERMES
    from .waiting import wait_for

    out, go = tmp_path / "agents.jsonl", tmp_path / "go"
    log = Path(f"{out}.log")
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0", "AGENTENV_TEST_GO": str(go)}
    env.pop("RAY_ADDRESS", None)  # the CLI starts a local cluster for the run, and stops it
    cmd = [sys.executable, "-m", "agentenv.cli", "rollout", "--env", str(Path(__file__).parent / "agent_envs.py")
           + ":ThreeCalls", "--model", str(HERMES), "--tasks", "2", "--group-size", "2", "--cluster", "ray",
           "--workers", "2", "--no-progress", "--out", str(out)]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)

    def calls() -> list[dict]:
        return [r for r in journal.read(log)[0] if r.get("e") == "call"] if log.exists() else []

    wait_for(lambda: len(calls()) >= 4, "every program's first call in the driver's log",
             timeout=300, unless=lambda: proc.poll() is not None)
    proc.kill()
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == -9, f"the run ended before it could be killed: {err.decode()[-2000:]}"
    before = {r["k"]: r["g"]["ids"] for r in calls()}
    assert len(before) == 4 and not out.read_text()
    go.touch()
    r = subprocess.run(cmd + ["--resume"], capture_output=True, text=True, env=env, timeout=600, check=False)
    assert r.returncode == 0, r.stderr[-3000:]
    _, rows = summary_of(r.stderr)
    assert rows["gateway calls (extended / branched / from the journal)"] == "12 (8 / 4 / 4)", rows
    assert rows["agent programs restarted (replay mismatch) / malformed tool calls"] == "0 / 0", rows
    got = [Trajectory.from_dict(json.loads(x)) for x in out.read_text().splitlines()]
    tasks = ThreeCalls().tasks(2)
    assert keys(got) == sorted((t.id, i) for t in tasks for i in range(2))  # each exactly once
    check_three_calls(AutoTokenizer.from_pretrained(HERMES), got, tasks, before)
