"""``agentenv.gateway.session``: one agent program's requests, one at a time, on a real scripted
engine (``agentenv.testing.ScriptedEngine``) and a real event log: live sampling within the
program's limits, the journal's answers on a replay, a mismatch, the end of the program."""

from __future__ import annotations

import threading
from pathlib import Path

import anyio
import pytest

import agentenv.models
from agentenv import RolloutConfig
from agentenv.engines.embedded import load_tokenizer
from agentenv.engines.base import Generation
from agentenv.errors import EngineError, ProgramEndedError
from agentenv.formats import HermesFormat
from agentenv.gateway.requests import RequestError, parse_chat
from agentenv.gateway.session import (
    OFF_LOOP_CHARS,
    ProgramSession,
    ReplayMismatch,
    SessionEnded,
    generation_of,
    generation_record,
)
from agentenv.journal import Call, Journal, parse, read
from agentenv.testing import ScriptedEngine

from ..waiting import until

pytestmark = pytest.mark.anyio

HERMES = Path(agentenv.models.__file__).parent / "tiny-hermes"
ADD = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HERMES)


class Hooks:
    """The program's scheduler side (``agentenv.program.ProgramHooks``), recording each event;
    ``gate`` (when set) holds every turn until it is set, ``ended`` makes the turn refused."""

    def __init__(self) -> None:
        self.before: list[tuple[int, int]] = []
        self.after: list[int] = []
        self.gate: anyio.Event | None = None
        self.ended = False

    async def before_turn(self, tokens: int, max_tokens: int) -> int:
        self.before.append((tokens, max_tokens))
        if self.ended:
            raise ProgramEndedError("the program ended before its turn")
        if self.gate is not None:
            await self.gate.wait()
        return 7

    def after_turn(self, tokens: int, prefilled: int = 0) -> None:
        self.after.append(tokens)


class Recording(ScriptedEngine):
    """The scripted engine, keeping the sampling settings and priority of each request."""

    def __init__(self, script, tok, **kw) -> None:
        super().__init__(script, tok, **kw)
        self.asked: list = []

    async def generate_turn(self, program, prompt_ids, params, request_id, *, priority=0):
        self.asked.append((program, request_id, params, priority))
        return await super().generate_turn(program, prompt_ids, params, request_id, priority=priority)


def calculator(prompt: str, n: int) -> str:
    return "The sum is 5." if "<tool_response>" in prompt else "I will add.\n" + CALL


def session(tok, script=calculator, *, config=None, journal=None, replay=None, **engine_kw) -> ProgramSession:
    config = config or RolloutConfig(max_turns=4, max_new_tokens=256, max_tokens_per_turn=64, temperature=0.7)
    return ProgramSession(program="p1", engine=Recording(script, tok, **engine_kw), hooks=Hooks(), config=config,
                          fmt=HermesFormat(), stop_ids=(tok.eos_token_id,), journal=journal, replay=replay)


def chat(*messages, **kw):
    return parse_chat({"model": "m", "messages": list(messages), "tools": [ADD], **kw})


FIRST = ({"role": "user", "content": "What is 2 + 3?"},)


def second(answer) -> tuple:
    return (*FIRST, {"role": "assistant", "content": answer.reply.content,
                     "tool_calls": answer.reply.openai_calls()},
            {"role": "tool", "tool_call_id": "call_0_0", "content": "5"})


async def test_a_live_request_is_sampled_within_its_limits_and_recorded(tok):
    s = session(tok)
    answer = await s.complete(chat(*FIRST, temperature=0.2), "main")
    assert answer.reply.content == "I will add." and answer.reply.calls == [
        {"id": "call_0_0", "name": "add", "arguments": {"a": 2, "b": 3}}]
    assert (answer.index, answer.replayed, answer.gen.finish_reason) == (0, False, "stop")
    n_in = answer.prompt_tokens
    assert answer.usage() == {"prompt_tokens": n_in, "completion_tokens": len(answer.gen.token_ids),
                              "total_tokens": n_in + len(answer.gen.token_ids)}
    program, request_id, params, priority = s.engine.asked[0]
    assert (program, request_id, priority) == ("p1.0", "p1-0", 7)  # branch 0 of p1, its call 0, the hooks' rank
    assert (params.max_tokens, params.temperature, params.top_p) == (64, 0.2, 1.0)  # the request's over the run's
    assert params.stop_token_ids == (tok.eos_token_id,)
    assert s.hooks.before == [(n_in, 64)] and s.hooks.after == [n_in + len(answer.gen.token_ids)]
    assert [(c.name, c.arguments, c.status) for c in s.tool_calls] == [("add", {"a": 2, "b": 3}, "ok")]
    assert len(s.turns) == 1 and (s.calls, s.sampled) == (1, len(answer.gen.token_ids))
    then = await s.complete(chat(*second(answer)), "main")
    assert then.reply.content == "The sum is 5." and then.index == 1
    assert s.engine.asked[1][:2] == ("p1.0", "p1-1") and s.branches.extended == 1  # it extended branch 0
    assert s.engine.asked[1][2].temperature == 0.7  # the run's when the request names none


async def test_a_program_that_spent_its_turns_or_tokens_gets_empty_replies_without_sampling(tok):
    s = session(tok, config=RolloutConfig(max_turns=1, max_new_tokens=256))
    await s.complete(chat(*FIRST), "main")
    empty = await s.complete(chat(*FIRST, temperature=1.0), "main")  # call 1 of at most 1
    assert (empty.reply.content, empty.gen.token_ids, empty.gen.finish_reason) == ("", [], "length")
    assert len(s.engine.asked) == 1 and len(s.hooks.before) == 1  # neither the engine nor the scheduler asked
    assert len(s.branches.all) == 1  # the empty reply to a request that did not extend a branch starts none
    s = session(tok, lambda p, n: "word " * 40, config=RolloutConfig(max_turns=8, max_new_tokens=30))
    first = await s.complete(chat(*FIRST), "main")
    assert len(first.gen.token_ids) == 30 and first.gen.finish_reason == "length"  # cut at the program's budget
    assert (await s.complete(chat(*FIRST, seed=1), "main")).gen.token_ids == [] and len(s.engine.asked) == 1
    # A reply the engine did not sample did not ignore tool_choice: it is no malformed call.
    s = session(tok, config=RolloutConfig(max_turns=1, max_new_tokens=256))
    await s.complete(chat(*FIRST), "main")
    await s.complete(chat(*FIRST, tool_choice="required"), "main")
    assert [c.status for c in s.tool_calls] == ["ok"]


class Watched:
    """The tokenizer, its encode of a text over ``OFF_LOOP_CHARS`` waiting (5 s at most) for
    the event loop to run meanwhile: it can only if that encode is off the loop's thread."""

    def __init__(self, tok) -> None:
        self.tok, self.encoding, self.loop_ran, self.saw = tok, threading.Event(), threading.Event(), None

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def encode(self, text, **kw):
        if len(text) > OFF_LOOP_CHARS:
            self.encoding.set()
            self.saw = self.loop_ran.wait(5)
        else:
            self.small_on = threading.current_thread()
        return self.tok.encode(text, **kw)


async def test_a_large_request_is_rendered_and_tokenized_off_the_event_loop(tok):
    s = session(tok)
    s.branches.tokenizer = watched = Watched(tok)

    async def loop_runs() -> None:
        while not watched.encoding.is_set():
            await anyio.sleep(0)
        watched.loop_ran.set()

    big = {"role": "user", "content": "word " * (OFF_LOOP_CHARS // 4)}
    async with anyio.create_task_group() as tg:
        tg.start_soon(loop_runs)
        with pytest.raises(RequestError, match="context window"):  # the tiny model's is 2,048 tokens
            await s.complete(chat(big), "main")
        watched.encoding.set()  # the ticker ends either way
    assert watched.saw is True  # the loop ran while the large request was tokenized
    small = await s.complete(chat(*FIRST), "main")
    assert small.reply.calls and watched.small_on is threading.current_thread()  # a small one on the loop's


class Held(Watched):
    """The tokenizer, its encode of a text over ``OFF_LOOP_CHARS`` held until ``release``."""

    def __init__(self, tok) -> None:
        super().__init__(tok)
        self.release = threading.Event()

    def encode(self, text, **kw):
        if len(text) > OFF_LOOP_CHARS:
            self.encoding.set()
            self.release.wait(120)
        return self.tok.encode(text, **kw)


async def test_a_large_request_ended_while_it_is_tokenized_ends_at_once_and_records_nothing(tok):
    s = session(tok)
    s.branches.tokenizer = held = Held(tok)
    big = {"role": "user", "content": "word " * (OFF_LOOP_CHARS // 4)}
    ended = anyio.Event()

    async def call() -> None:
        with pytest.raises(SessionEnded):
            await s.complete(chat(big), "main")
        ended.set()

    try:
        async with anyio.create_task_group() as tg:
            tg.start_soon(call)
            await until(held.encoding.is_set, "the large request is being tokenized")
            s.end()
            with anyio.fail_after(60):  # bounds a regression's hang only
                await ended.wait()
            assert not held.release.is_set()  # the call ended while its thread was still held
    finally:
        held.release.set()
    assert (s.calls, s.branches.all, s.hooks.before, s.engine.asked) == (0, [], [], [])


async def test_a_request_past_the_context_window_is_refused_naming_it(tok):
    s = session(tok, max_model_len=20)
    with pytest.raises(RequestError, match=r"the messages are \d+ tokens, the model's context window is 20: "
                                           "shorten them") as caught:
        await s.complete(chat(*FIRST), "main")
    assert (caught.value.param, caught.value.code) == ("messages", "context_length_exceeded")
    assert s.engine.asked == [] and s.calls == 0


async def test_stop_strings_end_the_visible_text_and_a_one_token_stop_stops_the_engine(tok):
    s = session(tok, lambda p, n: "abc END def! ghi")
    answer = await s.complete(chat(*FIRST, stop=["END", "!"]), "main")
    assert answer.reply.content == "abc "  # cut before the first stop string
    assert s.engine.asked[0][2].stop_token_ids == (tok.eos_token_id, tok.encode("!", add_special_tokens=False)[0])
    # The engine stopped on "!" (one token); the turn ends at END, the first stop string sampled.
    assert tok.decode(answer.gen.token_ids) == "abc END" and answer.gen.finish_reason == "stop"
    s = session(tok, lambda p, n: "abc def! ghi")
    answer = await s.complete(chat(*FIRST, stop=["END", "!"]), "main")
    assert tok.decode(answer.gen.token_ids) == "abc def!" and answer.gen.stop_token_id is not None


REACT = "Thought: add them\nAction: add\nObservation: 42 (made up)\nFinal Answer: 42"


async def test_a_stop_string_of_several_tokens_ends_the_turn_and_nothing_past_it_is_recorded(tok):
    """The engines stop on token ids only: a ReAct agent's ``\nObservation:`` is found in what was
    sampled, and the turn ends at the token that completes it, as an engine stopping on strings
    would have ended it. The made-up observation after it is neither shown nor recorded."""
    s = session(tok, lambda p, n: REACT if n == 0 else "The sum is 5.")
    answer = await s.complete(chat(*FIRST, stop=["\nObservation:"]), "main")
    stop_at = REACT.index("\nObservation:") + len("\nObservation:")
    assert answer.reply.content == "Thought: add them\nAction: add"
    assert tok.decode(answer.gen.token_ids) == REACT[:stop_at]
    assert (answer.gen.finish_reason, answer.gen.stop_token_id) == ("stop", None)
    assert answer.usage()["completion_tokens"] == len(answer.gen.token_ids) == s.sampled
    (branch,) = s.branches.all
    assert branch.segments[-1].token_ids == answer.gen.token_ids and "made up" not in tok.decode(branch.ids)
    assert len(answer.gen.logprobs) == len(answer.gen.versions) == len(answer.gen.token_ids)
    # The agent sends back what it saw, and the observation it got: the branch goes on from the
    # stop, the template's end of turn first (the turn did not end with EOS).
    then = await s.complete(chat(*FIRST, {"role": "assistant", "content": answer.reply.content},
                                 {"role": "user", "content": "Observation: 5"}, stop=["\nObservation:"]), "main")
    assert then.reply.content == "The sum is 5." and s.branches.extended == 1
    assert tok.decode(branch.segments[-2].token_ids).startswith("<|im_end|>")


class Aborting(Recording):
    """A scripted engine whose first ``aborts`` requests are aborted after ``keep`` tokens (a
    trainer aborting what is in flight before a weight sync); the script continues the text."""

    def __init__(self, script, tok, *, aborts: int = 1, keep: int = 5, **kw) -> None:
        super().__init__(script, tok, **kw)
        self.aborts, self.keep = aborts, keep

    async def generate_turn(self, program, prompt_ids, params, request_id, *, priority=0):
        gen = await super().generate_turn(program, prompt_ids, params, request_id, priority=priority)
        if self.aborts > 0:
            self.aborts -= 1
            k = self.keep
            gen = Generation(gen.token_ids[:k], gen.logprobs[:k], "abort", gen.prompt_tokens, 0, gen.weight_version)
            await self.load_weights({})  # the sync the abort made way for
        return gen


def continued(prompt: str, n: int) -> str:
    """The calculator's first reply, from wherever the prompt's last assistant turn stopped."""
    full = "I will add.\n" + CALL
    return full[len(prompt.rsplit("<|im_start|>assistant\n", 1)[-1]):]


async def test_a_request_the_engine_aborts_goes_on_from_what_it_sampled(tok):
    s = ProgramSession(program="p1", engine=Aborting(continued, tok), hooks=Hooks(),
                       config=RolloutConfig(max_turns=4, max_new_tokens=256, max_tokens_per_turn=64),
                       fmt=HermesFormat(), stop_ids=(tok.eos_token_id,))
    answer = await s.complete(chat(*FIRST), "main")
    full = tok.encode("I will add.\n" + CALL, add_special_tokens=False) + [tok.eos_token_id]
    assert answer.gen.token_ids == full and answer.gen.finish_reason == "stop"
    assert answer.reply.content == "I will add." and [c["name"] for c in answer.reply.calls] == ["add"]
    assert [a[1] for a in s.engine.asked] == ["p1-0", "p1-0.1"]  # the second request went on from the first
    assert s.engine.asked[1][2].max_tokens == 64 - 5
    assert answer.gen.versions == [0] * 5 + [1] * (len(full) - 5)  # the tokens after the sync are version 1
    (branch,) = s.branches.all
    assert [seg.token_ids for seg in branch.segments] == [full] and s.sampled == len(full)
    assert len(s.hooks.before) == len(s.hooks.after) == 2  # each engine request was admitted and released


async def test_an_aborted_request_whose_tokens_already_hold_a_stop_string_ends_there(tok):
    s = ProgramSession(program="p1", engine=Aborting(lambda p, n: REACT, tok, keep=30), hooks=Hooks(),
                       config=RolloutConfig(max_turns=4, max_new_tokens=256, max_tokens_per_turn=64),
                       fmt=HermesFormat(), stop_ids=(tok.eos_token_id,))
    ids = tok.encode(REACT, add_special_tokens=False)
    assert "\nObservation:" in tok.decode(ids[:30])  # the abort comes after the stop string
    answer = await s.complete(chat(*FIRST, stop=["\nObservation:"]), "main")
    assert len(s.engine.asked) == 1 and answer.gen.finish_reason == "stop"  # not continued
    assert tok.decode(answer.gen.token_ids).endswith("\nObservation:")


async def test_an_engine_that_keeps_aborting_before_a_token_fails_the_call_and_records_nothing(tok):
    s = ProgramSession(program="p1", engine=Aborting(continued, tok, aborts=5, keep=0), hooks=Hooks(),
                       config=RolloutConfig(max_turns=4, max_new_tokens=256, max_tokens_per_turn=64),
                       fmt=HermesFormat(), stop_ids=(tok.eos_token_id,))
    with pytest.raises(EngineError, match="aborted this request 3 times in a row without sampling a token"):
        await s.complete(chat(*FIRST), "main")
    assert len(s.engine.asked) == 3 and s.branches.all == [] and s.calls == 0
    s.engine.aborts = 2  # two aborts, then a whole reply: the call is answered
    answer = await s.complete(chat(*FIRST), "main")
    assert answer.reply.content == "I will add." and len(s.engine.asked) == 6


async def test_a_malformed_call_is_content_and_a_recorded_tool_call(tok):
    s = session(tok, lambda p, n: "<tool_call>{oops</tool_call>")
    answer = await s.complete(chat(*FIRST), "main")
    assert answer.reply.content == "<tool_call>{oops</tool_call>" and answer.reply.calls == []
    (call,) = s.tool_calls
    assert call.status == "malformed" and call.arguments == {"raw": "<tool_call>{oops</tool_call>"}


async def test_a_call_of_a_tool_not_offered_is_recorded_with_the_name_the_model_gave(tok):
    unknown = '<tool_call>{"name": "mul", "arguments": {"a": 2, "b": 3}}</tool_call>'
    s = session(tok, lambda p, n: unknown)
    answer = await s.complete(chat(*FIRST), "main")
    assert answer.reply.content == unknown and answer.reply.calls == []
    (call,) = s.tool_calls
    assert (call.name, call.status) == ("mul", "malformed") and "unknown tool 'mul'" in call.error
    assert call.arguments == {"raw": unknown}


async def test_the_journal_logs_each_call_and_a_replay_answers_from_it_until_a_request_differs(tok, tmp_path):
    log = Journal.create(tmp_path / "events.jsonl", {})
    live = session(tok, journal=log)
    a0 = await live.complete(chat(*FIRST), "main")
    a1 = await live.complete(chat(*second(a0)), "main")
    log.close()
    calls = [r for r in map(parse, read(tmp_path / "events.jsonl")[0]) if isinstance(r, Call)]
    assert [(c.key, c.n, c.role) for c in calls] == [("p1", 0, "main"), ("p1", 1, "main")]
    assert calls[0].generation == generation_record(a0.gen)
    replay = [{"d": c.digest, "g": c.generation} for c in calls]

    again = session(tok, journal=None, replay=replay)
    r0 = await again.complete(chat(*FIRST), "main")
    r1 = await again.complete(chat(*second(r0)), "main")
    assert again.engine.asked == [] and again.hooks.before == [] and again.replayed == 2  # no engine, no scheduler
    assert (r0.replayed, r0.reply, r1.reply) == (True, a0.reply, a1.reply)
    assert again.branches.all[0].ids == live.branches.all[0].ids  # the same token sequence, as sampled

    other = session(tok, replay=replay)
    restarted = []
    other.on_mismatch = lambda: restarted.append(True)
    await other.complete(chat(*FIRST), "main")
    with pytest.raises(ReplayMismatch, match="request 1 differs from the journal's"):
        await other.complete(chat(*FIRST, temperature=0.3), "main")
    assert other.mismatch and restarted == [True] and other.engine.asked == []
    # Past the journal's calls a replayed program goes on live.
    tail = session(tok, replay=replay[:1])
    await tail.complete(chat(*FIRST), "main")
    assert (await tail.complete(chat(*second(r0)), "main")).replayed is False and len(tail.engine.asked) == 1


async def test_an_ended_program_cancels_its_request_in_flight_and_refuses_later_ones(tok):
    s = session(tok)
    s.hooks.gate = anyio.Event()  # the scheduler never grants the turn
    outcome = []

    async def ask() -> None:
        try:
            await s.complete(chat(*FIRST), "main")
        except SessionEnded:
            outcome.append("ended")

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask)
        await until(lambda: s.hooks.before, "the request waits for its turn")
        s.end()
    assert outcome == ["ended"] and s.engine.asked == [] and s.hooks.after == []
    with pytest.raises(SessionEnded):
        await s.complete(chat(*FIRST), "main")


async def test_concurrent_requests_of_one_program_are_served_one_at_a_time_in_order(tok):
    s = session(tok)
    s.hooks.gate = anyio.Event()
    answers = []

    async def ask(temperature: float) -> None:
        answers.append(await s.complete(chat(*FIRST, temperature=temperature), "main"))

    async with anyio.create_task_group() as tg:
        tg.start_soon(ask, 0.1)
        await until(lambda: s.hooks.before, "the first request waits for its turn")
        tg.start_soon(ask, 0.2)
        await anyio.wait_all_tasks_blocked()
        assert len(s.hooks.before) == 1  # the second waits for the first, not for the scheduler
        s.hooks.gate.set()
    assert [a.index for a in answers] == [0, 1] and [p.temperature for _, _, p, _ in s.engine.asked] == [0.1, 0.2]


async def test_a_turn_the_scheduler_refuses_ends_the_session_and_an_engine_failure_is_recorded(tok):
    s = session(tok)
    s.hooks.ended = True
    with pytest.raises(SessionEnded):
        await s.complete(chat(*FIRST), "main")

    def broken(prompt: str, n: int) -> str:
        raise RuntimeError("the engine lost its device")

    s = session(tok, broken)
    with pytest.raises(EngineError, match="RuntimeError: the engine lost its device"):  # the gateway's 503
        await s.complete(chat(*FIRST), "main")
    assert s.engine_error == "RuntimeError: the engine lost its device"
    assert s.hooks.after == [s.hooks.before[0][0]] and s.calls == 0  # the scheduler still hears the turn ended


def test_a_generation_record_round_trips(tok):
    from agentenv.engines.base import Generation

    gen = Generation([5, 6], [-0.1, -0.2], "stop", 10, 4, 3, 6, token_versions=[2, 3])
    back = generation_of(generation_record(gen))
    assert (back.token_ids, back.logprobs, back.finish_reason, back.prompt_tokens, back.cached_tokens,
            back.weight_version, back.stop_token_id, back.versions) == ([5, 6], [-0.1, -0.2], "stop", 10, 4, 3, 6,
                                                                        [2, 3])


async def test_replayed_calls_spend_the_programs_token_budget_as_the_live_calls_did(tok):
    """A resumed program's live calls get what the uninterrupted program had left, no more."""
    text = "The answer is forty two."
    k = len(tok.encode(text, add_special_tokens=False)) + 1  # a whole turn: its text and EOS
    config = RolloutConfig(max_turns=8, max_new_tokens=k + 3, max_tokens_per_turn=64)
    live = session(tok, lambda p, n: text, config=config)
    a0 = await live.complete(chat(*FIRST), "main")
    a1 = await live.complete(chat(*FIRST, seed=1), "main")
    assert (len(a0.gen.token_ids), len(a1.gen.token_ids)) == (k, 3)  # the second cut at the budget's rest
    replay = [{"d": chat(*FIRST).digest("main"), "g": generation_record(a0.gen)}]
    resumed = session(tok, lambda p, n: text, config=config, replay=replay)
    assert (await resumed.complete(chat(*FIRST), "main")).replayed
    b1 = await resumed.complete(chat(*FIRST, seed=1), "main")
    assert b1.gen.token_ids == a1.gen.token_ids and resumed.engine.asked[0][2].max_tokens == 3
    assert resumed.sampled == live.sampled == k + 3


async def test_an_engine_that_fixes_its_sampling_samples_each_request_as_it_was_started(tok, engine):
    """An engine whose ``sampling`` is set (the embedded engine) takes no request's own: the
    request's temperature and top_p give way to it rather than fail the program (the embedded
    engine raises on any other, which was every such request's error:engine)."""
    s = session(tok)
    s.engine.sampling = (0.6, 0.9, 5)
    await s.complete(chat(*FIRST, temperature=0.2, top_p=0.5), "main")
    params = s.engine.asked[0][2]
    assert (params.temperature, params.top_p, params.top_k) == (0.6, 0.9, 5)
    real = ProgramSession(program="p2", engine=engine, hooks=Hooks(), fmt=HermesFormat(),
                          config=RolloutConfig(max_turns=2, max_new_tokens=8, max_tokens_per_turn=4),
                          stop_ids=(engine.tokenizer.eos_token_id,))
    answer = await real.complete(chat(*FIRST, temperature=0.2, top_p=0.5), "main")
    assert answer.gen.token_ids and real.engine_error is None and engine.sampling != (0.2, 0.5, 0)
