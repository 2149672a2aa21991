import json

import pytest

from agentenv.errors import TrajectoryError
from agentenv.trajectory import SCHEMA_VERSION, Trajectory


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
