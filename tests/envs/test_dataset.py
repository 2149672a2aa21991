"""The dataset environment: JSONL and Hugging Face datasets, column mapping, stable seeded ids."""

import json

import anyio
import pytest

from agentenv import check_env, make
from agentenv.envs.dataset import DatasetEnv
from agentenv.errors import ConfigError
from agentenv.trajectory import Trajectory

ROWS = [
    {"uid": "p1", "problem": "What is 2+3?", "solution": "2+3 is 5.\n#### 5", "level": 1},
    {"uid": "p2", "problem": "What is 7*6?", "solution": "#### 42", "level": 2},
    {"uid": "p3", "problem": "Half of one?", "solution": "#### \\frac{1}{2}", "level": 3},
]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "mini.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def env_for(source, **kw):
    source = str(source) if hasattr(source, "is_file") else source  # a pathlib path as the CLI gives it
    return DatasetEnv(source, question="problem", answer="solution",
                      answer_regex=r"####\s*(.+)$", **kw)


def test_jsonl_rows_become_tasks_with_stable_ids_and_metadata(jsonl):
    env = env_for(jsonl)
    check_env(env)
    a, b = env.tasks(3, seed=0), env.tasks(3, seed=1)
    assert sorted(t.id for t in a) == ["mini/0", "mini/1", "mini/2"]
    assert {t.id: t.question for t in a} == {t.id: t.question for t in b}  # the seed orders, ids stay
    assert [t.id for t in a] == [t.id for t in env.tasks(3, seed=0)]
    task = {t.id: t for t in a}["mini/2"]
    assert task.answer == "\\frac{1}{2}" and task.data == {"uid": "p3", "level": 3, "row": 2}
    assert [t.id for t in env_for(jsonl, shuffle=False).tasks(2)] == ["mini/0", "mini/1"]
    more = env.tasks(7, seed=0)  # more tasks than rows: another seeded pass, ids still unique
    assert len({t.id for t in more}) == 7 and sum(t.id.endswith("@1") for t in more) == 3
    ids = env_for(jsonl, id_column="uid").tasks(3)
    assert sorted(t.id for t in ids) == ["mini/p1", "mini/p2", "mini/p3"]


def test_prompt_template_and_system_prompt(jsonl):
    env = env_for(jsonl, prompt_template="Level {level}: {problem}", tools=False)
    task = env.task_at(0)
    assert task.question == "Level 1: What is 2+3?"
    assert env.tools() == [] and "Python" not in env.prompt(task)[0]["content"]
    assert env_for(jsonl).tools()[0].name == "python"


def test_reward_checks_the_final_answer_numerically_and_symbolically(jsonl):
    env = env_for(jsonl)

    def score(i, text):
        t = Trajectory("t", "dataset", "x", "x#g", 0, [1])
        t.text = text
        return anyio.run(env.reward, env.task_at(i), t)

    assert score(1, r"<code>print(7*6)</code><interpreter>42</interpreter> \boxed{42}")["reward"] == 1.0
    assert score(1, r"\boxed{41}")["reward"] == 0.0
    assert score(2, r"\boxed{0.5}")["correct"] == 1.0  # \frac{1}{2} = 0.5, by math-verify
    out = DatasetEnv(str(jsonl), question="problem", answer="solution", answer_regex=r"####\s*(.+)$",
                     format_weight=0.5).reward
    t = Trajectory("t", "dataset", "x", "x#g", 0, [1])
    t.text = r"\boxed{5}"
    assert anyio.run(out, env.task_at(0), t) == {"reward": 1.5, "correct": 1.0, "has_answer": 1.0, "tool_ran": 0.0}


def test_hugging_face_datasets_saved_parquet_and_objects(tmp_path):
    datasets = pytest.importorskip("datasets")
    ds = datasets.Dataset.from_list(ROWS)
    ds.save_to_disk(str(tmp_path / "saved"))
    ds.to_parquet(str(tmp_path / "mini.parquet"))
    datasets.DatasetDict({"test": ds}).save_to_disk(str(tmp_path / "dd"))
    for source, kw in ((tmp_path / "saved", {}), (tmp_path / "mini.parquet", {}), (tmp_path / "dd", {"split": "test"})):
        env = env_for(source, **kw)
        assert sorted(t.answer for t in env.tasks(3)) == sorted(["5", "42", "\\frac{1}{2}"])
    assert len(env_for(ds).tasks(3)) == 3 and len(env_for(ROWS).tasks(2)) == 2
    with pytest.raises(ConfigError, match="has no split .validation.; it has test"):
        env_for(tmp_path / "dd", split="validation")


def test_bad_sources_and_columns_are_clear_errors(tmp_path, jsonl):
    with pytest.raises(ConfigError, match="no column 'question'.*its columns: uid, problem, solution, level"):
        DatasetEnv(str(jsonl))
    with pytest.raises(ConfigError, match="no such file"):
        DatasetEnv(str(tmp_path / "missing.jsonl"))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "q", "answer": 1}\nnot json\n')
    with pytest.raises(ConfigError, match="bad.jsonl:2: not a JSON line"):
        DatasetEnv(str(bad))
    with pytest.raises(ConfigError, match="prompt_template"):
        env_for(jsonl, prompt_template="{nosuch}")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match="no rows"):
        DatasetEnv(str(empty))


def test_make_and_env_args_by_id(jsonl):
    env = make("dataset", source=str(jsonl), question="problem", answer="solution")
    assert env.id == "dataset" and len(env.tasks(2)) == 2
