"""Reusable contract checks, for agentenv's own tests and for users' engines and sandboxes.

Each check is an async function that raises ``AssertionError`` with a message on failure.
``engine_contract`` runs them all against any :class:`~agentenv.engines.Engine`.
:class:`InstantEngine` (``agentenv.engines.instant``) is an engine without a model, for
measuring what a rollout costs besides the engine (docs/engines.md).
"""

from __future__ import annotations

import math
from typing import Any

import anyio

from .engines.base import Engine, Generation, SamplingParams
from .engines.instant import InstantEngine
from .errors import PromptTooLongError


def chat_prompt(engine: Engine, question: str, system: str | None = None) -> list[int]:
    tok = engine.tokenizer
    msgs = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": question}]
    text = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    return tok.encode(text, add_special_tokens=False)


def _params(engine: Engine, max_tokens: int, stop: tuple[int, ...] = ()) -> SamplingParams:
    t, p, k = engine.sampling or (1.0, 1.0, 0)
    return SamplingParams(max_tokens=max_tokens, temperature=t, top_p=p, top_k=k, stop_token_ids=stop)


async def check_alignment(engine: Engine, prompt: list[int]) -> None:
    g = await engine.generate(prompt, _params(engine, 24), "contract-align")
    assert len(g.token_ids) == len(g.logprobs), "one logprob per sampled token"
    assert 0 < len(g.token_ids) <= 24, f"max_tokens respected, got {len(g.token_ids)}"
    assert all(math.isfinite(x) and x <= 1e-4 for x in g.logprobs), f"logprobs must be <= 0: {g.logprobs}"
    assert g.prompt_tokens == len(prompt)
    assert g.weight_version == engine.weight_version
    if g.finish_reason == "length":
        assert len(g.token_ids) == 24


async def check_stop_tokens(engine: Engine, prompt: list[int]) -> None:
    # Every id the tokenizer knows is a stop id, so whatever the engine samples first, at any
    # sampling settings, must end the request right there: one token, reported as the stop.
    # (Stopping on a token probed from an earlier sample depended on it being sampled again.)
    every = tuple(range(len(engine.tokenizer)))
    g = await engine.generate(prompt, _params(engine, 16, every), "contract-stop")
    assert len(g.token_ids) == 1, (
        f"generation must end at the stop token: with every token id a stop id, {len(g.token_ids)} tokens "
        f"were sampled ({g.token_ids[:8]}...), finish_reason {g.finish_reason!r}"
    )
    assert g.finish_reason == "stop", f"a request ended by a stop id must finish with 'stop', not {g.finish_reason!r}"
    assert g.stop_token_id == g.token_ids[0], f"stop_token_id must name the stop id met: {g.stop_token_id}"


async def check_prefix_cache(engine: Engine, prompt: list[int]) -> None:
    g = await engine.generate(prompt, _params(engine, 48), "contract-cache-1")
    resumed = prompt + g.token_ids + prompt[-5:]  # a resume: old sequence plus spliced tokens
    g2 = await engine.generate(resumed, _params(engine, 4), "contract-cache-2")
    assert g2.cached_tokens > 0, "a resumed request must be served from the prefix cache"
    assert g2.cached_tokens < len(resumed)


async def check_abort(engine: Engine, prompt: list[int]) -> None:
    with anyio.move_on_after(0.2) as scope:
        await engine.generate(prompt, _params(engine, 100_000 // 100), "contract-abort")
    # Either it finished quickly or it was cancelled; the engine must still serve afterwards.
    g = await engine.generate(prompt, _params(engine, 4), "contract-after-abort")
    assert len(g.token_ids) > 0, f"engine unusable after cancellation (cancelled={scope.cancelled_caught})"
    # The same id again at once, while the cancelled request may still be being removed (a
    # program resumed after a crash asks for the turn it was on): a new request, served.
    with anyio.move_on_after(0.2):
        await engine.generate(prompt, _params(engine, 100_000 // 100), "contract-reused")
    with anyio.fail_after(120):
        g = await engine.generate(prompt, _params(engine, 4), "contract-reused")
    assert len(g.token_ids) > 0, "a request id reused after its request was cancelled was not served"


async def check_concurrency(engine: Engine, prompt: list[int], n: int = 8) -> None:
    results: list[Any] = [None] * n

    async def one(i: int) -> None:
        results[i] = await engine.generate(prompt, _params(engine, 16), f"contract-conc-{i}")

    async with anyio.create_task_group() as tg:
        for i in range(n):
            tg.start_soon(one, i)
    assert all(r is not None and len(r.token_ids) == len(r.logprobs) for r in results)


async def check_too_long(engine: Engine) -> None:
    try:
        await engine.generate([0] * (engine.max_model_len + 1), _params(engine, 4), "contract-too-long")
    except PromptTooLongError:
        return
    raise AssertionError("an over-long prompt must raise PromptTooLongError")


async def check_weight_update(engine: Engine, prompt: list[int], weights: dict[str, Any]) -> None:
    before = engine.weight_version
    v = await engine.load_weights(weights)
    assert v == before + 1 == engine.weight_version, "load_weights bumps the version"
    g = await engine.generate(prompt, _params(engine, 4), "contract-after-update")
    assert g.weight_version == v, "generations are stamped with the new version"


async def engine_contract(engine: Engine) -> None:
    prompt = chat_prompt(engine, "Compute 123 * 45 + 6789.", system="Use Python. " * 12)
    await check_alignment(engine, prompt)
    await check_stop_tokens(engine, prompt)
    await check_prefix_cache(engine, prompt)
    await check_abort(engine, prompt)
    await check_concurrency(engine, prompt)
    await check_too_long(engine)


class ScriptedEngine(InstantEngine):
    """An :class:`InstantEngine` whose turns say what a script says: ``script(prompt_text, n)``
    (the decoded prompt and the engine's request count) returns the turn's text, which is
    encoded and ended with EOS (cut at ``max_tokens``, or at a stop token it holds). Each
    token's logprob is a distinct number, so that a test can tell which sampled token went
    where. For exact tests of what is built around the engine (the gateway's token sequences)."""

    def __init__(self, script: Any, tokenizer: Any = None, **kw: Any) -> None:
        super().__init__(tokenizer, **kw)
        self.script = script

    def _make(self, prompt: list[int], params: SamplingParams, program: str | None, room: int) -> Generation:
        tok = self.tokenizer
        text = self.script(tok.decode(prompt, skip_special_tokens=False), self.requests)
        ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
        ids = ids[: min(params.max_tokens, room)]
        stop_id = None
        for j, t in enumerate(ids):
            if t in params.stop_token_ids:
                ids, stop_id = ids[: j + 1], t
                break
        self.requests += 1
        self.generated += len(ids)
        self.prompted += len(prompt)
        lps = [-0.001 * (self.generated - len(ids) + j + 1) for j in range(len(ids))]
        return Generation(ids, lps, "stop" if stop_id is not None else "length", len(prompt), 0, self.weight_version,
                          stop_id)
