"""One agent program's side of the gateway: its key, its branches, its place in the scheduler.

Every request of the program goes through :meth:`ProgramSession.complete`, one at a time (a
program is one scheduler entry; concurrent requests of its sub-agents queue here):

    checked request ─► replay? the journal's answer while the requests match it
                    ─► Branches.plan (extend a branch: its ids as sampled + the new messages'
                       glue; or a new branch) ─► hooks.before_turn (the program scheduler)
                    ─► engine.generate_turn(branch program, ids) ─► hooks.after_turn
                    ─► Branches.record (mask 1 on the sampled ids) ─► journal ``call`` record
                    ─► the reply parsed into content and tool calls

A request that differs from the journal's on a replay sets :attr:`mismatch` and the program
runner starts the agent again, fresh. After the program ends every request gets 410.
"""

from __future__ import annotations

import secrets
import time
from dataclasses import replace
from typing import Any, Callable

import anyio
import anyio.lowlevel

from ..engines.base import Engine, Generation, SamplingParams
from ..errors import EngineError, ProgramEndedError
from ..formats import ToolFormat
from ..trajectory import ToolCall, TurnStats
from .branches import Branches
from .messages import assistant_message
from .replies import Reply, parse_reply
from .requests import ChatRequest, RequestError


class SessionEnded(Exception):
    """The program this key belonged to has ended (410)."""


class ReplayMismatch(Exception):
    """On a replay, a request differs from the one the journal logged (the agent is not
    deterministic); the program starts again fresh."""


class Answer:
    """What one request produced: the reply, the generation behind it, and the request's index
    among the program's calls (what the answer's ids are named after: the same on a replay)."""

    __slots__ = ("reply", "gen", "prompt_tokens", "replayed", "index")

    def __init__(self, reply: Reply, gen: Generation, prompt_tokens: int, replayed: bool, index: int = 0) -> None:
        self.reply, self.gen, self.prompt_tokens, self.replayed = reply, gen, prompt_tokens, replayed
        self.index = index

    def usage(self) -> dict[str, int]:
        n = len(self.gen.token_ids)
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": n, "total_tokens": self.prompt_tokens + n}


def generation_record(gen: Generation) -> dict[str, Any]:
    return {"ids": gen.token_ids, "lp": gen.logprobs, "v": gen.versions, "fin": gen.finish_reason,
            "stop": gen.stop_token_id, "pt": gen.prompt_tokens, "ct": gen.cached_tokens, "wv": gen.weight_version}


def generation_of(rec: dict[str, Any]) -> Generation:
    return Generation(list(rec["ids"]), list(rec["lp"]), rec["fin"], rec["pt"], rec["ct"], rec["wv"], rec["stop"],
                      token_versions=list(rec["v"]))


class ProgramSession:
    """The gateway's state for one run of one agent program (see the module docstring)."""

    def __init__(self, *, program: str, engine: Engine, hooks: Any, config: Any, fmt: ToolFormat,
                 stop_ids: tuple[int, ...], journal: Any = None, replay: list[dict[str, Any]] | None = None) -> None:
        self.program, self.engine, self.hooks, self.config, self.fmt = program, engine, hooks, config, fmt
        self.tokenizer = engine.tokenizer
        self.stop_ids, self.journal = stop_ids, journal
        self.key = f"ae-{secrets.token_urlsafe(24)}"
        self.branches = Branches(self.tokenizer)
        self.replay = list(replay or [])
        self.calls = self.replayed = self.sampled = 0
        self.tool_calls: list[ToolCall] = []
        self.turns: list[TurnStats] = []
        self.ended = self.mismatch = False
        self.engine_error: str | None = None
        self.on_mismatch: Callable[[], None] = lambda: None
        self._lock = anyio.Lock()
        self._scopes: set[anyio.CancelScope] = set()

    def end(self) -> None:
        """The program ended: requests in flight are cancelled, later ones get 410."""
        self.ended = True
        for scope in list(self._scopes):
            scope.cancel()

    async def complete(self, req: ChatRequest, role: str) -> Answer:
        if self.ended:
            raise SessionEnded
        with anyio.CancelScope() as scope:
            self._scopes.add(scope)
            try:
                async with self._lock:
                    if self.ended:
                        raise SessionEnded
                    return await self._complete(req, role)
            finally:
                self._scopes.discard(scope)
        raise SessionEnded  # cancelled by end()

    async def _complete(self, req: ChatRequest, role: str) -> Answer:
        large = _chars(req.messages) + _chars(req.tools) > OFF_LOOP_CHARS
        n, dig = self.calls, await _run(large, req.digest, role)
        logged = self.replay[n] if n < len(self.replay) else None
        if logged is not None and logged["d"] != dig:
            self.mismatch = True
            self.on_mismatch()
            raise ReplayMismatch(f"request {n} differs from the journal's")
        plan = await _run(large, self.branches.plan, role, req.messages, req.tools)
        if logged is not None:  # charged to the program's token budget as it was when sampled
            gen, self.replayed = generation_of(logged["g"]), self.replayed + 1
            self.sampled += len(gen.token_ids)
        else:
            gen = await self._sample(
                plan.input_ids, req, n, plan.extends.index if plan.extends else len(self.branches.all)
            )
        text, ended_with_eos = self._text(gen)
        text = _cut_at_stop(text, req.stop)
        # A reply the engine did not sample (the budget spent) cannot have ignored tool_choice.
        choice = req.tool_choice if gen.token_ids else None
        reply = parse_reply(self.fmt, text, req.tool_names, choice, call_id=f"call_{n}")
        self.branches.record(plan, gen.token_ids, gen.logprobs, gen.versions,
                             assistant_message(reply.content, reply.calls), ended_with_eos)
        self._count(n, reply, gen)
        if logged is None and self.journal is not None and hasattr(self.journal, "call"):
            self.journal.call(self.program, n, dig, role, generation_record(gen))
        self.calls += 1
        return Answer(reply, gen, len(plan.input_ids), logged is not None, n)

    async def _sample(self, ids: list[int], req: ChatRequest, n: int, branch: int) -> Generation:
        cfg, engine = self.config, self.engine
        room = engine.max_model_len - len(ids)
        if room <= 0:
            raise RequestError(f"the messages are {len(ids)} tokens, the model's context window is "
                               f"{engine.max_model_len}: shorten them", "messages", "context_length_exceeded")
        cap = min(req.max_tokens or cfg.max_tokens_per_turn, room, cfg.max_new_tokens - self.sampled)
        if cap <= 0 or n >= cfg.max_turns:  # the program's token budget or call limit is spent: an empty reply
            return Generation([], [], "length", len(ids), 0, engine.weight_version)
        temperature = cfg.temperature if req.temperature is None else req.temperature
        top_p, top_k = cfg.top_p if req.top_p is None else req.top_p, cfg.top_k
        if engine.sampling is not None:  # an engine that samples every request as it was started (embedded)
            temperature, top_p, top_k = engine.sampling
        params = SamplingParams(max_tokens=cap, temperature=temperature, top_p=top_p, top_k=top_k,
                                stop_token_ids=self.stop_ids + self._stop_ids(req.stop))
        gen = await self._turn(ids, params, branch, f"{self.program}-{n}")
        # An engine request aborted from outside (a trainer that aborts what is in flight before
        # a weight sync, as verl's does) keeps what it sampled, and the turn goes on from there,
        # as a native program's does: the agent gets a whole reply, the row every sampled id.
        # Three aborts in a row that sample nothing are the engine's failure (503; nothing of the
        # call is recorded).
        stalls, attempt = int(not gen.token_ids), 0  # aborts in a row that sampled nothing
        while gen.finish_reason == "abort":
            if stalls >= ABORTS_WITHOUT_A_TOKEN:
                self.engine_error = f"the engine aborted this request {stalls} times in a row without sampling a token"
                raise EngineError(self.engine_error)
            stopped = _stopped(self.tokenizer, gen, req.stop)
            if stopped is not gen:  # what it sampled already ends at a stop string
                gen = stopped
                break
            done = len(gen.token_ids)
            if done >= cap:
                gen.finish_reason = "length"
                break
            attempt += 1
            more = await self._turn(ids + gen.token_ids, replace(params, max_tokens=cap - done), branch,
                                    f"{self.program}-{n}.{attempt}")
            stalls = stalls + 1 if not more.token_ids else 0
            gen = _joined(gen, more)
        gen = _stopped(self.tokenizer, gen, req.stop)
        self.sampled += len(gen.token_ids)
        return gen

    async def _turn(self, ids: list[int], params: SamplingParams, branch: int, request_id: str) -> Generation:
        """One engine request of the branch, admitted by the program scheduler."""
        try:
            priority = await self.hooks.before_turn(len(ids), params.max_tokens)
        except ProgramEndedError:
            raise SessionEnded from None
        gen: Generation | None = None
        try:
            gen = await self.engine.generate_turn(f"{self.program}.{branch}", ids, params, request_id,
                                                  priority=priority)
        except Exception as exc:  # noqa: BLE001 - the engine's failure is the program's, recorded
            self.engine_error = f"{type(exc).__name__}: {exc}"
            if isinstance(exc, EngineError):
                raise
            raise EngineError(self.engine_error) from exc  # any failure of the engine is the agent's 503
        finally:
            if not self.ended:  # an ended program has left the scheduler (its slot is gone)
                self.hooks.after_turn(len(ids) + (len(gen.token_ids) if gen is not None else 0),
                                      gen.prompt_tokens - gen.cached_tokens if gen is not None else 0)
        return gen

    def _stop_ids(self, stops: list[str]) -> tuple[int, ...]:
        """A stop string that is one token stops the engine on that token."""
        out = []
        for s in stops:
            ids = self.tokenizer.encode(s, add_special_tokens=False)
            if len(ids) == 1:
                out.append(ids[0])
        return tuple(out)

    def _text(self, gen: Generation) -> tuple[str, bool]:
        """The reply's text (without the token that stopped it) and whether that was EOS."""
        ids = gen.token_ids
        eos = gen.stop_token_id is not None and gen.stop_token_id == self.tokenizer.eos_token_id
        if eos and ids and ids[-1] == gen.stop_token_id:
            ids = ids[:-1]
        return self.tokenizer.decode(ids, skip_special_tokens=False), eos

    def _count(self, n: int, reply: Reply, gen: Generation) -> None:
        self.turns.append(TurnStats(gen.prompt_tokens, gen.cached_tokens, len(gen.token_ids), gen.finish_reason,
                                    gen.latency_s, gen.weight_version))
        for call in reply.calls:
            self.tool_calls.append(ToolCall(n, call["name"], call["arguments"], "", "ok", 0.0))
        for bad in reply.malformed:
            self.tool_calls.append(ToolCall(n, bad.name, {"raw": (reply.content or "")[:200]}, "", "malformed", 0.0,
                                            bad.reason))


#: Engine requests in a row that may end aborted with no token sampled before the call fails
#: (503): an engine that aborts everything must not keep a call going.
ABORTS_WITHOUT_A_TOKEN = 3

#: A request whose messages and tools hold more characters than this is hashed, rendered and
#: tokenized on a worker thread: that work grows with the whole history the request carries
#: (seconds for a few MiB), and on the event loop it would hold every other program's call.
OFF_LOOP_CHARS = 64 * 1024


def _chars(value: Any) -> int:
    """The characters of the strings in ``value`` (a request's messages or tools, as JSON)."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(_chars(v) for v in value.values())
    if isinstance(value, list):
        return sum(_chars(v) for v in value)
    return 0


async def _run(off_loop: bool, fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, on a worker thread when ``off_loop`` (the session's lock keeps its own
    state to one request at a time; ``fn`` only reads it, and the tokenizer). A call cancelled
    meanwhile (the program ended, the client left) ends here: the thread is left to finish
    and its result dropped, and a cancellation that came as it finished is raised, not carried
    into the scheduler past a program's end."""
    if not off_loop:
        return fn(*args)
    out = await anyio.to_thread.run_sync(fn, *args, abandon_on_cancel=True)
    await anyio.lowlevel.checkpoint_if_cancelled()
    return out


def _cut_at_stop(text: str, stops: list[str]) -> str:
    """The visible text ends before the first stop string."""
    cuts = [text.find(s) for s in stops if s in text]
    return text[: min(cuts)] if cuts else text


def _joined(first: Generation, then: Generation) -> Generation:
    """One turn sampled in two engine requests (the first aborted): every id, logprob and
    version of both; the second's end; the first's prompt, cache and admission version."""
    return Generation(first.token_ids + then.token_ids, first.logprobs + then.logprobs, then.finish_reason,
                      first.prompt_tokens, first.cached_tokens, first.weight_version, then.stop_token_id,
                      first.latency_s + then.latency_s, token_versions=first.versions + then.versions)


def _stopped(tokenizer: Any, gen: Generation, stops: list[str]) -> Generation:
    """``gen`` ended at the token that completes its first stop string, as an engine that
    stops on strings would have ended it (finish ``stop``). The engines stop on token ids only,
    so a stop string of several tokens is found here: what was sampled past it is dropped, not
    recorded, since the agent never sees it and nothing after the stop was conditioned on it."""
    ids = gen.token_ids
    if not stops or not ids or not any(s in tokenizer.decode(ids, skip_special_tokens=False) for s in stops):
        return gen

    def holds(k: int) -> bool:
        text = tokenizer.decode(ids[:k], skip_special_tokens=False)
        return any(s in text for s in stops)

    lo, hi = 1, len(ids)  # the shortest prefix that holds a stop string: holds(hi), and not holds(lo - 1)
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid + 1, hi)
    if hi == len(ids) and gen.finish_reason == "stop":
        return gen  # the engine stopped there itself (a one-token stop string)
    return Generation(ids[:hi], gen.logprobs[:hi], "stop", gen.prompt_tokens, gen.cached_tokens, gen.weight_version,
                      None, gen.latency_s, gen.extra, gen.versions[:hi])
