"""``dataset``: tasks from your data, a JSONL file or a Hugging Face ``datasets`` dataset.

    agentenv rollout --env dataset --env-arg source=problems.jsonl --env-arg answer=solution
    DatasetEnv("openai/gsm8k", config="main", answer_regex=r"####\\s*(.+)$")   # (hub, where reachable)
    DatasetEnv(my_datasets_dataset, question="problem")                        # an object

Each row is a task: the prompt is ``prompt_template`` filled with the row's columns (default
just the ``question`` column), the expected answer is the ``answer`` column (optionally cut
out of a worked solution by ``answer_regex``), and every other column is kept in
``task.data``. Task ids are stable: ``<name>/<row index in the source>`` or, with
``id_column``, ``<name>/<that column's value>``; the seed only chooses the order. Asked for
more tasks than there are rows, it starts another seeded pass and marks those ids ``@1``,
``@2``..., so ids stay unique within a run.

Reward: :func:`agentenv.rewards.correct_answer` on the model's final words (numbers exactly,
anything else by math-verify when installed), plus ``has_answer`` with ``format_weight``
(default 0: reported, not added) and ``tool_ran`` (reported).
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Any, Sequence

from agentenv.env import Environment, Task
from agentenv.errors import ConfigError
from agentenv.rewards import Rubric, correct_answer, has_answer, tool_ran
from agentenv.tools import Tool
from agentenv.trajectory import Trajectory

from .retool_math import SYSTEM_PROMPT as TOOL_SYSTEM_PROMPT

NO_TOOL_SYSTEM_PROMPT = "Solve the problem. Give the final answer as \\boxed{answer}."


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    rows = []
    with path.open(encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ConfigError(f"{path}:{n}: not a JSON line ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ConfigError(f"{path}:{n}: each line must be a JSON object, got {type(row).__name__}")
            rows.append(row)
    return rows


def load_rows(source: Any, split: str = "train", config: str | None = None) -> tuple[Sequence[dict], str]:
    """The rows of ``source`` (indexable, each a dict) and a short name for task ids."""
    if isinstance(source, list):
        return source, "rows"
    if not isinstance(source, (str, Path)):  # a datasets.Dataset / DatasetDict (a dict of splits)
        if isinstance(source, dict):
            source = _split(source, split, "the dataset")
        if not (hasattr(source, "__len__") and hasattr(source, "__getitem__")):
            raise ConfigError(f"source must be a path, a dataset name, a datasets.Dataset or a list of dicts, "
                              f"got {type(source).__name__}")
        return source, str(getattr(getattr(source, "info", None), "dataset_name", None) or "dataset")
    path = Path(source).expanduser()
    if path.suffix == ".jsonl" or (path.is_file() and path.suffix == ".json" and _is_jsonl(path)):
        if not path.is_file():
            raise ConfigError(f"no such file: {source}")
        return _read_jsonl(path), path.stem
    from ..extras import require

    require("datasets", extra="datasets", what=f"loading {source!r}", note="a .jsonl file needs none")
    import datasets
    kinds = {".json": "json", ".parquet": "parquet", ".csv": "csv", ".arrow": "arrow"}
    try:
        if path.is_file() and path.suffix in kinds:
            ds, name = datasets.load_dataset(kinds[path.suffix], data_files=str(path), split="train"), path.stem
        elif path.is_dir() and ((path / "dataset_info.json").exists() or (path / "dataset_dict.json").exists()):
            ds, name = datasets.load_from_disk(str(path)), path.name  # saved with save_to_disk
        elif path.exists():  # a folder of data files (or a loading script)
            ds, name = datasets.load_dataset(str(path), config, split=split), path.name
        elif str(source).startswith((".", "/", "~")):
            raise ConfigError(f"no such file or directory: {source}")
        else:  # a dataset name on the hub (or in the datasets cache)
            ds, name = datasets.load_dataset(str(source), config, split=split), str(source).rsplit("/", 1)[-1]
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - datasets raises many kinds; one clear line
        raise ConfigError(f"cannot load dataset {source!r}: {type(exc).__name__}: {exc}") from None
    return (_split(ds, split, repr(source)) if isinstance(ds, dict) else ds), name  # DatasetDict: a dict


def _split(splits: dict, split: str, what: str) -> Any:
    if split not in splits:
        raise ConfigError(f"{what} has no split {split!r}; it has {', '.join(splits)}")
    return splits[split]


def _is_jsonl(path: Path) -> bool:
    with path.open(encoding="utf-8") as f:
        first = f.readline().strip()
    return first.startswith("{") and first.endswith("}")


class DatasetEnv(Environment):
    """Tasks from a JSONL file or a Hugging Face dataset (columns mapped to prompt, answer and
    metadata), solved with Python; reward 1 for the right final answer in \\boxed{}.

    ``source``: a .jsonl/.json/.parquet/.csv file, a directory saved with save_to_disk, or a
    dataset name for datasets.load_dataset (or, in Python, a Dataset or a list of dicts)."""

    id = "dataset"
    tool_format = "retool"
    max_turns = 4
    tool_timeout = 5.0

    def __init__(self, source: str, question: str = "question", answer: str = "answer",
                 id_column: str | None = None, split: str = "train", config: str | None = None,
                 prompt_template: str | None = None, answer_regex: str | None = None,
                 system_prompt: str | None = None, tools: bool = True, shuffle: bool = True,
                 symbolic: bool = True, format_weight: float = 0.0, max_turns: int = 4) -> None:
        super().__init__()
        self.rows, self.name = load_rows(source, split, config)
        if len(self.rows) == 0:
            raise ConfigError(f"dataset {source!r} has no rows")
        first = self.rows[0]
        columns = list(first.keys())
        for role, col in (("question", question), ("answer", answer), ("id_column", id_column)):
            if col is not None and col not in first:
                raise ConfigError(f"dataset {source!r} has no column {col!r} (for {role}); "
                                  f"its columns: {', '.join(columns)}")
        self.question, self.answer, self.id_column = question, answer, id_column
        self.prompt_template = prompt_template or "{" + question + "}"
        try:
            self.prompt_template.format_map(first)
        except (KeyError, IndexError, ValueError) as exc:
            raise ConfigError(f"prompt_template {self.prompt_template!r} does not fit the columns "
                              f"({', '.join(columns)}): {exc!r}") from None
        self.answer_regex = re.compile(answer_regex, re.S | re.M) if answer_regex else None
        self.use_tools, self.shuffle = tools, shuffle
        self.system_prompt = system_prompt or (TOOL_SYSTEM_PROMPT if tools else NO_TOOL_SYSTEM_PROMPT)
        if max_turns < 1:
            raise ValueError("max_turns must be >= 1")
        self.max_turns = max_turns
        self.rubric = Rubric(correct_answer(symbolic=symbolic), (has_answer, format_weight), (tool_ran, 0.0))

    def _expected(self, row: dict) -> Any:
        value = row[self.answer]
        if self.answer_regex is not None and isinstance(value, str):
            hits = self.answer_regex.findall(value)
            value = hits[-1] if hits else None
            if isinstance(value, tuple):
                value = next((v for v in value if v), None)
        return value.strip() if isinstance(value, str) else value

    def task_at(self, index: int, epoch: int = 0) -> Task:
        row = dict(self.rows[index])
        key = row[self.id_column] if self.id_column else index
        tid = f"{self.name}/{key}" + (f"@{epoch}" if epoch else "")
        data = {k: v for k, v in row.items() if k not in (self.question, self.answer)}
        data["row"] = index
        return Task(tid, self.prompt_template.format_map(row), self._expected(row), data)

    def tasks(self, n: int, seed: int = 0) -> list[Task]:
        out: list[Task] = []
        size, epoch = len(self.rows), 0
        while len(out) < n:
            k = min(n - len(out), size)
            # A seeded sample, not a shuffle of every row: a trainer asks for a few tasks at a time.
            order = random.Random(f"dataset:{seed}:{epoch}").sample(range(size), k) if self.shuffle else range(k)
            out.extend(self.task_at(i, epoch) for i in order)
            epoch += 1
        return out

    def tools(self) -> list[Tool]:
        return super().tools() if self.use_tools else []

    async def reward(self, task: Task, trajectory: Trajectory) -> dict[str, float]:
        return await self.rubric(task, trajectory)
