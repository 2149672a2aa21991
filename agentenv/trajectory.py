"""What one rollout ("program") produced, token by token.

A trajectory is the prompt's token ids followed by *segments*. A segment is either

* ``"model"``: token ids the engine sampled, appended verbatim, each with the logprob the
  sampler gave it and the weight version of the policy that sampled it (loss mask 1); or
* ``"env"``: token ids the environment inserted (tool output, chat-format glue), loss mask 0.

The flat arrays a trainer consumes (``input_ids``, ``loss_mask``, ``logprobs``,
``weight_versions``) are *derived* from the segments, so they cannot drift apart. Positions
that were not sampled carry logprob ``0.0`` and weight version ``-1``.

The JSON form (one object per JSONL line) is documented in docs/schemas.md and
versioned by ``SCHEMA_VERSION``.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal

from .errors import TrajectoryError

SCHEMA_VERSION = 1

_SCALARS = (int, float, str, bool, type(None))


def plain(obj: Any) -> Any:
    """A copy of ``obj`` (a field of the records below) as JSON holds it: what ``asdict``
    gives, but token lists are copied whole (in C), not element by element."""
    if isinstance(obj, list):
        if not obj or isinstance(obj[0], _SCALARS) and isinstance(obj[-1], _SCALARS):
            return list(obj)
        if hasattr(obj[0], "to_dict"):
            return [x.to_dict() for x in obj]
    if isinstance(obj, _SCALARS):
        return obj
    return asdict(_Box(obj))["value"]  # asdict's own copy: a dataclass inside a dict becomes a dict too


@dataclass(slots=True)
class _Box:
    """One value, for :func:`plain` to copy it as ``asdict`` copies a field."""

    value: Any


class _Plain:
    """``to_dict``: the dataclass's fields, in order, as :func:`plain` copies them."""

    __slots__ = ()

    def to_dict(self) -> dict[str, Any]:
        return {name: plain(getattr(self, name)) for name in self.__dataclass_fields__}  # type: ignore[attr-defined]


SegmentKind = Literal["model", "env"]
ToolStatus = Literal["ok", "error", "timeout", "malformed"]
# Program-level finish reasons; "error:<type>" is added for failures recorded as data.
FINISH_REASONS = ("stop", "length", "max_turns", "context_overflow", "cancelled")


@dataclass(slots=True)
class Segment(_Plain):
    kind: SegmentKind
    token_ids: list[int]
    logprobs: list[float] | None = None
    weight_versions: list[int] | None = None

    @property
    def mask(self) -> int:
        return 1 if self.kind == "model" else 0

    def validate(self) -> None:
        n = len(self.token_ids)
        if self.kind == "model":
            if self.logprobs is None or self.weight_versions is None:
                raise TrajectoryError("a model segment needs logprobs and weight_versions")
            if len(self.logprobs) != n or len(self.weight_versions) != n:
                raise TrajectoryError(
                    f"model segment misaligned: {n} tokens, {len(self.logprobs)} logprobs, "
                    f"{len(self.weight_versions)} weight versions"
                )
            lps = self.logprobs  # checked in C (max, map): no Python frame per token
            if lps and (max(lps) > 1e-4 or any(map(math.isnan, lps))):
                raise TrajectoryError("a sampled token's logprob must be a number <= 0")
        elif self.kind == "env":
            if self.logprobs is not None or self.weight_versions is not None:
                raise TrajectoryError("an env segment carries no logprobs or weight versions")
        else:
            raise TrajectoryError(f"unknown segment kind {self.kind!r}")


@dataclass(slots=True)
class ToolCall(_Plain):
    """One tool invocation the model asked for, and what came of it."""

    turn: int
    name: str
    arguments: dict[str, Any]
    output: str
    status: ToolStatus
    duration_s: float
    error: str | None = None


@dataclass(slots=True)
class TurnStats(_Plain):
    """What the engine reported for one generation request (one turn)."""

    prompt_tokens: int
    cached_tokens: int
    new_tokens: int
    finish_reason: str
    latency_s: float
    weight_version: int


@dataclass(slots=True)
class TokenSequence(_Plain):
    """A further token sequence of one program, beside its main one (``prompt_ids`` +
    ``segments``): an agent that rewrote its history, or a role (a sub-agent, a critic) that
    sampled in a context of its own (``agentenv.gateway``). Loss mask 1 exactly on its
    sampled ids, as for the main sequence."""

    role: str
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)


@dataclass(slots=True)
class Trajectory(_Plain):
    id: str
    env: str
    task_id: str
    group_id: str
    sample_index: int
    prompt_ids: list[int]
    segments: list[Segment] = field(default_factory=list)
    tool_calls: list[ToolCall] = field(default_factory=list)
    turns: list[TurnStats] = field(default_factory=list)
    reward: float | None = None
    reward_components: dict[str, float] = field(default_factory=dict)
    finish_reason: str = ""
    error: str | None = None
    text: str | None = None
    duration_s: float = 0.0
    metadata: dict[str, Any] = field(default_factory=dict)
    #: What stands behind a reward component, by its name (a judge's verdict: score, reply,
    #: latency, failure kind); empty for plain components.
    reward_details: dict[str, dict[str, Any]] = field(default_factory=dict)
    #: The program's further token sequences (an agent's branches and roles); empty for a
    #: program the reactor ran turn by turn.
    branches: list[TokenSequence] = field(default_factory=list)

    # -- building -------------------------------------------------------------------------
    def add_model(self, token_ids: list[int], logprobs: list[float], weight_version: int | list[int]) -> None:
        """Sampled tokens; ``weight_version`` is one version for all, or one per token."""
        if token_ids:
            versions = [weight_version] * len(token_ids) if isinstance(weight_version, int) else list(weight_version)
            self.segments.append(Segment("model", list(token_ids), list(logprobs), versions))

    def add_env(self, token_ids: list[int]) -> None:
        if token_ids:
            self.segments.append(Segment("env", list(token_ids)))

    # -- derived flat arrays --------------------------------------------------------------
    @property
    def input_ids(self) -> list[int]:
        out = list(self.prompt_ids)
        for s in self.segments:
            out.extend(s.token_ids)
        return out

    @property
    def loss_mask(self) -> list[int]:
        out = [0] * len(self.prompt_ids)
        for s in self.segments:
            out.extend([s.mask] * len(s.token_ids))
        return out

    @property
    def logprobs(self) -> list[float]:
        out = [0.0] * len(self.prompt_ids)
        for s in self.segments:
            out.extend(s.logprobs if s.kind == "model" else [0.0] * len(s.token_ids))
        return out

    @property
    def weight_versions(self) -> list[int]:
        out = [-1] * len(self.prompt_ids)
        for s in self.segments:
            out.extend(s.weight_versions if s.kind == "model" else [-1] * len(s.token_ids))
        return out

    @property
    def completion_ids(self) -> list[int]:
        return self.input_ids[len(self.prompt_ids) :]

    @property
    def num_sampled_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.segments if s.kind == "model")

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + sum(len(s.token_ids) for s in self.segments)

    def sequences(self) -> list["Trajectory"]:
        """Each token sequence as a trajectory of its own (the main one first, then each
        branch, same reward and finish reason), leaving out empty ones: the rows a trainer
        takes from this program."""
        out = [self] if self.num_tokens else []
        for i, b in enumerate(self.branches):
            t = Trajectory(f"{self.id}.{i + 1}", self.env, self.task_id, self.group_id, self.sample_index,
                           b.prompt_ids, b.segments, reward=self.reward, finish_reason=self.finish_reason,
                           metadata={"role": b.role})
            if t.num_tokens:
                out.append(t)
        return out

    # -- validation and (de)serialisation ---------------------------------------------------
    def validate(self) -> None:
        for s in self.segments:
            s.validate()
        for b in self.branches:
            for s in b.segments:
                s.validate()
        n = self.num_tokens
        for name in ("loss_mask", "logprobs", "weight_versions"):
            if len(getattr(self, name)) != n:
                raise TrajectoryError(f"{name} has {len(getattr(self, name))} entries, want {n}")
        if not self.finish_reason:
            raise TrajectoryError("trajectory has no finish_reason")

    def to_dict(self) -> dict[str, Any]:
        """The JSONL object: the segments plus the derived flat arrays, for convenience."""
        d = _Plain.to_dict(self)
        d["schema_version"] = SCHEMA_VERSION
        d["input_ids"] = self.input_ids
        d["loss_mask"] = self.loss_mask
        d["logprobs"] = self.logprobs
        d["weight_versions"] = self.weight_versions
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Trajectory":
        if d.get("schema_version") != SCHEMA_VERSION:
            raise TrajectoryError(f"unsupported schema_version {d.get('schema_version')!r}")
        fields = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        fields["segments"] = [Segment(**s) for s in d.get("segments", [])]
        fields["tool_calls"] = [ToolCall(**t) for t in d.get("tool_calls", [])]
        fields["turns"] = [TurnStats(**t) for t in d.get("turns", [])]
        fields["branches"] = [TokenSequence(b["role"], b["prompt_ids"], [Segment(**s) for s in b.get("segments", [])])
                              for b in d.get("branches", [])]
        traj = cls(**fields)
        traj.validate()
        if traj.input_ids != d.get("input_ids", traj.input_ids):
            raise TrajectoryError("input_ids disagree with the segments")
        return traj
