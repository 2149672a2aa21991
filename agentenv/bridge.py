"""``check_tokenizer``: is the token bridge exact for your model's tokenizer and tool format?

    from agentenv import check_tokenizer
    report = check_tokenizer(AutoTokenizer.from_pretrained("path/to/model"), "hermes")
    print(report)            # what holds, what breaks, where, and what to do
    assert report.exact

It plays a multi-turn tool conversation through the same functions the reactor uses
(:func:`agentenv.program.render_prompt`, :func:`agentenv.program.observation_ids`): a prompt
rendered by the chat template, model turns encoded as a model would sample them (a reasoning
block first where the vocabulary has ``<think>``), tool results spliced as environment tokens,
and a final answer. The bridge is **exact** when

1. the engine can stop where a turn ends: EOS exists and is what ends an assistant turn in the
   template, and every end-of-call string of the format is one token;
2. the format parses its own call back from the decoded sampled tokens;
3. every environment segment round-trips (``decode(encode(text)) == text``);
4. the prompt and every environment segment equal what the chat template renders for that
   part of the conversation (the assistant turns stand in as markers, so this checks the glue,
   not how the template re-renders a reply), and ``decode(input_ids)`` is the transcript.

Notes (not failures, since agentenv never re-tokenizes or re-renders): where a re-tokenized
transcript would split differently from the spliced ids, and where the template rewrites
earlier turns once the conversation goes on (Qwen3 drops earlier ``<think>`` blocks): a
trainer that rebuilds sequences from messages would train on tokens the model never sampled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .formats import HermesFormat, ToolFormat, ToolRequest, get_format
from .program import observation_ids, render_prompt

_SYSTEM = "Solve the problem. Use the python tool when it helps."
_QUESTION = "What is 17 * 23, and how many letters are in 'agentenv'?"
_CALLS = [("print(17 * 23)", "391\n"), ("print(len('agentenv'))", "8")]
_FINAL = "17 * 23 = 391 and 'agentenv' has 8 letters: \\boxed{391}."
_THINK = "<think>\nI should compute this with the tool.\n</think>\n\n"


@dataclass
class BridgeReport:
    tokenizer: str
    tool_format: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    checks: dict[str, bool] = field(default_factory=dict)
    #: Why this format: "given", or the model's own and what said so.
    format_source: str = "given"

    @property
    def exact(self) -> bool:
        return not self.problems

    def __bool__(self) -> bool:
        return self.exact

    def __str__(self) -> str:
        why = "" if self.format_source == "given" else f" ({self.format_source})"
        head = (f"{self.tokenizer} with the {self.tool_format!r} format{why}: the token bridge is "
                f"{'EXACT' if self.exact else 'NOT exact'}")
        lines = [head] + [f"  [{'ok' if ok else 'FAIL'}] {name}" for name, ok in self.checks.items()]
        lines += [f"  problem: {p}" for p in self.problems] + [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def record(self, label: str, ok: bool, problem: str | None = None) -> bool:
        """Record check ``label``'s outcome, and ``problem`` (what breaks, what to do) when it
        fails; returns ``ok``."""
        self.checks[label] = ok
        if not ok and problem:
            self.problems.append(problem)
        return ok


def _where(a: str, b: str) -> tuple[int, str, str]:
    i = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
    return i, a[max(0, i - 30): i + 30], b[max(0, i - 30): i + 30]


def check_tokenizer(tokenizer: Any, tool_format: str | ToolFormat | None = None) -> BridgeReport:
    """Check the token bridge for ``tokenizer`` (a transformers tokenizer with a chat
    template) and ``tool_format`` (``"retool"``, ``"hermes"``, ``"llama3-json"`` or a
    :class:`ToolFormat`; None: the model's own, :mod:`agentenv.models.native`, and Hermes when
    it cannot be told); see the module docstring for what is checked."""
    source = "given"
    if tool_format is None:
        from .models.native import native_format

        native = native_format(tokenizer)
        tool_format = native.name or "hermes"
        source = f"the model's own: {native.source}" if native.name else f"hermes: {native.source}"
    fmt = get_format(tool_format)
    name = getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__
    rep = BridgeReport(str(name), fmt.name, format_source=source)
    if not _check_turn_ends(tokenizer, fmt, rep):
        return rep
    conv = _play(tokenizer, fmt, rep)
    if conv is None:
        return rep
    _check_played(tokenizer, fmt, rep, conv)
    _check_template(tokenizer, fmt, rep, conv)
    _note_rebuilding(tokenizer, fmt, rep, conv)
    return rep


@dataclass
class _Conversation:
    """The conversation the bridge played, as ids and as the texts it is checked against."""

    think: str  # the reasoning block each reply starts with ("" without ``<think>`` in the vocabulary)
    templated: bool  # tool results are chat-template messages (not the format's own text)
    messages: list[dict[str, Any]]  # the prompt's messages
    ids: list[int]  # prompt, sampled and spliced ids, as a trajectory holds them
    transcript: str  # the decoded text of each part, joined
    expected: str  # the template's text with markers for the replies, as the bridge built it
    marked: list[dict[str, Any]]  # the messages that render to ``expected`` (templated formats)
    retool_content: str = ""  # the one assistant message of a non-templated format, tool results included
    parsed_ok: bool = True
    round_trip_ok: bool = True


def _check_turn_ends(tokenizer: Any, fmt: ToolFormat, rep: BridgeReport) -> bool:
    """1. The engine can stop where a turn ends. False when nothing further can be checked."""
    eos, eos_id = getattr(tokenizer, "eos_token", None), getattr(tokenizer, "eos_token_id", None)
    if not rep.record("EOS token", eos_id is not None,
                     "the tokenizer has no eos_token: set it to the token that ends an assistant turn"):
        return False
    try:
        closed = tokenizer.apply_chat_template([{"role": "user", "content": "q"}, {"role": "assistant",
                                                "content": "\x00REPLY\x00"}], tokenize=False)
    except Exception as exc:  # noqa: BLE001 - a template that cannot render is the finding
        rep.record("chat template renders", False, f"the chat template cannot render a conversation: {exc}")
        return False
    after = closed.split("\x00REPLY\x00", 1)[-1]
    rep.record("EOS ends an assistant turn", after.startswith(eos),
              f"eos_token {eos!r} is not what ends an assistant turn: the template writes {after[:20]!r} after a "
              "reply, so the engine would not stop at the end of a turn. Set tokenizer.eos_token (and the "
              "model's generation_config eos_token_id) to the template's end-of-turn token")
    for s in fmt.stop_strings:
        n = len(tokenizer.encode(s, add_special_tokens=False))
        rep.record(f"{s!r} is one token", n == 1,
                  f"{s!r} is {n} tokens: the engine stops on token ids, so a call would run on past it. Add it "
                  "to the vocabulary (tokenizer.add_tokens([...]) and model.resize_token_embeddings) or use a "
                  "format whose end-of-call tag is one token")
    return True


def _play(tokenizer: Any, fmt: ToolFormat, rep: BridgeReport) -> _Conversation | None:
    """A tool conversation through the reactor's own functions: the prompt, each call as the
    model would sample it, its result spliced as environment tokens, and a final answer.
    None (with the finding on ``rep``) when the template cannot render the prompt."""
    eos, eos_id = tokenizer.eos_token, tokenizer.eos_token_id
    think = _THINK if len(tokenizer.encode("<think>", add_special_tokens=False)) == 1 else ""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _SYSTEM}, {"role": "user", "content": _QUESTION}]
    try:
        ids = render_prompt(tokenizer, messages)
    except Exception as exc:  # noqa: BLE001
        rep.record("chat template renders", False, f"the chat template cannot render the prompt: {exc}")
        return None
    prompt_text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    templated = isinstance(fmt, HermesFormat)  # tool results rendered by the chat template
    conv = _Conversation(think, templated, messages, ids, prompt_text, prompt_text, list(messages))
    for i, (code, output) in enumerate(_CALLS):
        # A templated format starts a new assistant message each turn (each may reason first);
        # retool's turns all continue one assistant message, which reasons once, at its start.
        turn = (think if templated or i == 0 else "") + fmt.example_call("python", {"code": code})
        sampled = tokenizer.encode(turn, add_special_tokens=False)
        ends_with_eos = not fmt.stop_strings
        if ends_with_eos:
            sampled.append(eos_id)
        text = tokenizer.decode(sampled, skip_special_tokens=False)
        conv.parsed_ok &= fmt.parse(text, ["python"]) == [ToolRequest("python", {"code": code})]
        env = observation_ids(fmt, tokenizer, [output], ends_with_eos)
        env_text = fmt.observation([output], tokenizer, ends_with_eos)
        conv.round_trip_ok &= tokenizer.decode(env, skip_special_tokens=False) == env_text
        conv.ids += sampled + env
        conv.transcript += text + env_text
        marker = f"\x00TURN{i}\x00"
        if templated:
            conv.expected += think + marker + (eos if ends_with_eos else "") + env_text
            conv.marked += [{"role": "assistant", "content": think + marker}, {"role": "tool", "content": output}]
        else:
            conv.retool_content += turn + env_text
    final = tokenizer.encode((think if templated else "") + _FINAL, add_special_tokens=False) + [eos_id]
    conv.ids += final
    conv.transcript += tokenizer.decode(final, skip_special_tokens=False)
    return conv


def _check_played(tokenizer: Any, fmt: ToolFormat, rep: BridgeReport, conv: _Conversation) -> None:
    """2-3. The format parses its own calls back; tool text and the whole sequence round-trip."""
    rep.record("the format parses its own calls after the tokenizer", conv.parsed_ok,
              f"the {fmt.name} format does not parse its example call back from the decoded tokens: the tokenizer "
              "changes the text (normalisation, added spaces); check its normalizer and decoder")
    rep.record("environment text round-trips", conv.round_trip_ok,
              "decode(encode(tool text)) differs from the tool text: the tokenizer adds or drops characters when a "
              "segment is encoded on its own (e.g. a SentencePiece prefix space: load it with legacy=False / "
              "add_prefix_space=False)")
    rep.record("decode(input_ids) is the transcript",
              tokenizer.decode(conv.ids, skip_special_tokens=False) == conv.transcript,
              "decoding the trajectory's ids does not give back the text of its parts")


def _check_template(tokenizer: Any, fmt: ToolFormat, rep: BridgeReport, conv: _Conversation) -> None:
    """4. The prompt and every environment segment are what the chat template renders."""
    final_marker = "\x00FINAL\x00"  # retool: the whole reply, tool results included, is one assistant turn
    marked = conv.marked + [{"role": "assistant", "content": conv.think + final_marker}]
    expected = conv.expected + conv.think + final_marker
    rendered = tokenizer.apply_chat_template(marked, tokenize=False)
    rendered = rendered[: rendered.find(final_marker) + len(final_marker)] if final_marker in rendered else rendered
    i, ours, theirs = _where(expected, rendered)
    rep.record("prompt and tool results are what the template renders", expected == rendered,
              f"at character {i} the bridge's text {ours!r} differs from the chat template's {theirs!r}: "
              + ("the tool results are not spliced as the template renders tool messages" if conv.templated else
                 "the prompt or the assistant turn is not rendered as the template renders it"))
    if not conv.templated:
        rep.notes.append(f"the {fmt.name} format's tool results are its own text inside the assistant turn "
                         "(not chat-template messages)")


def _note_rebuilding(tokenizer: Any, fmt: ToolFormat, rep: BridgeReport, conv: _Conversation) -> None:
    """Notes on re-tokenization and re-rendering, which agentenv never does but a trainer that
    rebuilds sequences from messages would."""
    if conv.templated:
        real = conv.messages + _real_messages(fmt, conv.think)
    else:
        real = conv.messages + [{"role": "assistant", "content": conv.retool_content + _FINAL}]
    full_text = tokenizer.apply_chat_template(real, tokenize=False)
    retok, ids = tokenizer.encode(full_text, add_special_tokens=False), conv.ids
    if retok[: len(ids)] != ids:
        k = next((j for j, (a, b) in enumerate(zip(ids, retok)) if a != b), min(len(ids), len(retok)))
        rep.notes.append(
            f"re-tokenizing the rendered conversation gives other ids from token {k} on "
            f"({tokenizer.decode(ids[k:k + 3])!r} sampled/spliced vs {tokenizer.decode(retok[k:k + 3])!r}): a trainer "
            "that re-tokenizes text would train on tokens the model did not sample; agentenv keeps the ids")
    more = real + [{"role": "user", "content": "And 2 + 2?"}]
    again = tokenizer.apply_chat_template(more, tokenize=False)
    if not again.startswith(full_text):
        j, before, later = _where(full_text, again)
        rep.notes.append(
            f"the template rewrites earlier turns when the conversation goes on (at character {j}: {before!r} "
            f"becomes {later!r}; e.g. reasoning dropped from earlier replies): agentenv never re-renders history, "
            "so its trajectories stay exact, but sequences rebuilt from messages would differ")


def _real_messages(fmt: ToolFormat, think: str) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, (code, output) in enumerate(_CALLS):
        out += [{"role": "assistant", "content": think + fmt.example_call("python", {"code": code})},
                {"role": "tool", "content": output}]
    return out + [{"role": "assistant", "content": think + _FINAL}]
