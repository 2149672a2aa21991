import dataclasses
import json

import pytest

from agentenv.errors import TrajectoryError
from agentenv.trajectory import SCHEMA_VERSION, ToolCall, Trajectory, TurnStats


def make() -> Trajectory:
    t = Trajectory("p1", "env", "task/0", "task/0#g", 0, prompt_ids=[1, 2, 3])
    t.add_model([4, 5], [-0.5, -1.25], weight_version=7)
    t.add_env([6, 7, 8])
    t.add_model([9], [-0.1], weight_version=8)
    t.finish_reason = "stop"
    return t


def test_flat_arrays_are_aligned_and_derived_from_segments():
    t = make()
    t.validate()
    assert t.input_ids == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert t.loss_mask == [0, 0, 0, 1, 1, 0, 0, 0, 1]
    assert t.logprobs == [0.0, 0.0, 0.0, -0.5, -1.25, 0.0, 0.0, 0.0, -0.1]
    assert t.weight_versions == [-1, -1, -1, 7, 7, -1, -1, -1, 8]
    assert t.completion_ids == [4, 5, 6, 7, 8, 9]
    assert t.num_sampled_tokens == 3


def test_json_round_trip():
    t = make()
    d = json.loads(json.dumps(t.to_dict()))
    assert d["schema_version"] == SCHEMA_VERSION
    back = Trajectory.from_dict(d)
    assert back.input_ids == t.input_ids and back.loss_mask == t.loss_mask
    assert back.segments == t.segments


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda t: t.segments[0].logprobs.pop(), "misaligned"),
        (lambda t: setattr(t.segments[0], "logprobs", [0.5, -1.0]), "<= 0"),
        (lambda t: setattr(t.segments[1], "logprobs", [0.0, 0.0, 0.0]), "env segment"),
        (lambda t: setattr(t, "finish_reason", ""), "finish_reason"),
    ],
)
def test_validation_rejects_broken_trajectories(mutate, message):
    t = make()
    mutate(t)
    with pytest.raises(TrajectoryError, match=message):
        t.validate()


def test_from_dict_rejects_other_schema_and_tampered_arrays():
    d = make().to_dict()
    with pytest.raises(TrajectoryError, match="schema_version"):
        Trajectory.from_dict({**d, "schema_version": 99})
    with pytest.raises(TrajectoryError, match="input_ids"):
        Trajectory.from_dict({**d, "input_ids": d["input_ids"][:-1] + [0]})


# -- to_dict is dataclasses.asdict plus the derived arrays ------------------------------------
def asdict_reference(t: Trajectory) -> dict:
    """The JSONL object as ``dataclasses.asdict`` makes it (a deep copy, dataclasses inside
    turned into dicts), with the schema version and the derived flat arrays after it."""
    return {**dataclasses.asdict(t), "schema_version": SCHEMA_VERSION, "input_ids": t.input_ids,
            "loss_mask": t.loss_mask, "logprobs": t.logprobs, "weight_versions": t.weight_versions}


def containers(obj, seen: set[int] | None = None) -> set[int]:
    """The ids of every list and dict reachable from ``obj``, through dataclass fields too."""
    seen = set() if seen is None else seen
    if isinstance(obj, (list, dict, tuple)):
        if not isinstance(obj, tuple):
            seen.add(id(obj))
        for x in (obj.items() if isinstance(obj, dict) else obj):
            containers(x, seen)
    elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        for f in dataclasses.fields(obj):
            containers(getattr(obj, f.name), seen)
    return seen


def check_to_dict(t: Trajectory) -> None:
    d, ref = t.to_dict(), asdict_reference(t)
    assert d == ref
    assert json.dumps(d) == json.dumps(ref)  # the same line: the same keys in the same order
    assert not containers(d) & containers(t), "to_dict shares a list or dict with the trajectory"


@dataclasses.dataclass
class Verdict:
    score: float
    notes: list[str]


def test_to_dict_is_asdict_plus_the_derived_arrays_on_edge_cases():
    empty = Trajectory("p0", "env", "task/0", "task/0#g", 0, prompt_ids=[1, 2])  # no segments at all
    no_prompt = Trajectory("p1", "env", "task/1", "task/1#g", 1, prompt_ids=[], finish_reason="error:engine",
                           error="engine down")
    full = make()
    full.add_model([10, 11, 12], [-0.3, -0.2, -0.1], weight_version=[8, 8, 9])  # a version per token
    full.tool_calls.append(ToolCall(0, "python", {"code": "print(1)", "env": {"A": [1, 2]}}, "1\n", "ok", 0.01))
    full.tool_calls.append(ToolCall(1, "python", {}, "", "malformed", 0.0, error="no code"))
    full.turns.append(TurnStats(3, 0, 2, "stop", 0.05, 7))
    full.reward, full.reward_components = 0.5, {"correct": 1.0, "judge": 0.0}
    full.reward_details = {"judge": {"score": 0.0, "reply": "<answer>no</answer>", "failure": None,
                                     "ranks": [[1, 2], [3]]}}
    full.metadata = {"resumed": {"from_turn": 1, "turns": (1, 2)}, "verdict": Verdict(1.0, ["a"]),
                     "mixed": [1, [2, {"x": 3}], 4]}
    full.text, full.duration_s = "two", 1.5
    for t in (empty, no_prompt, full):
        check_to_dict(t)
    assert full.to_dict()["metadata"]["verdict"] == {"score": 1.0, "notes": ["a"]}  # a dict in JSON, as asdict


@pytest.mark.anyio
async def test_to_dict_is_asdict_plus_the_derived_arrays_on_a_real_rollout(engine):
    """Trajectories of retool-math on the bundled model (the embedded engine, real sandbox
    sessions): prompts, model and env segments, tool calls and turn stats as a run makes them."""
    import anyio

    from agentenv import RolloutConfig
    from agentenv.reactor import Reactor
    from agentenv.registry import make as make_env
    from agentenv.sandboxes.local import LocalSandbox

    env = make_env("retool-math")
    config = RolloutConfig(max_turns=3, max_new_tokens=192, concurrency=4)
    async with LocalSandbox() as sb:
        with anyio.fail_after(300):
            groups = await Reactor(engine, env, sb, config).collect(env.tasks(3, seed=1), 2)
    trajs = [t for g in groups for t in g.trajectories]
    assert len(trajs) == 6 and all(t.turns for t in trajs)
    assert any(t.tool_calls for t in trajs), "precondition: a program called a tool"
    assert any(s.kind == "env" for t in trajs for s in t.segments), "precondition: a tool's output was spliced in"
    for t in trajs:
        check_to_dict(t)
