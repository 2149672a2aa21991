"""The contract checks users run on their own engines (``agentenv.testing``): the real
embedded engine passes them, and the same engine with one broken promise fails the check for
that promise, with its message."""

from __future__ import annotations

import dataclasses

import pytest

from agentenv import testing
from agentenv.engines.base import Engine

pytestmark = pytest.mark.anyio


@pytest.fixture(scope="module")
def engine(own_engine):
    """The engine contract loads weights (a new version): this module's own engine, not the session's."""
    return own_engine


class Broken(Engine):
    """The real engine with one promise broken (``defect``)."""

    def __init__(self, inner: Engine, defect: str) -> None:
        self.inner, self.defect = inner, defect
        self.tokenizer, self.max_model_len, self.sampling = inner.tokenizer, inner.max_model_len, inner.sampling

    @property
    def weight_version(self) -> int:
        return self.inner.weight_version

    async def generate(self, prompt_ids, params, request_id, *, priority=0):
        if self.defect == "no stop":
            params = dataclasses.replace(params, stop_token_ids=())
        if self.defect == "no length check":
            prompt_ids = prompt_ids[-(self.max_model_len // 2):]
        g = await self.inner.generate(prompt_ids, params, request_id, priority=priority)
        if self.defect == "misaligned":
            g.logprobs = g.logprobs[:-1]
        if self.defect == "no cache":
            g.cached_tokens = 0
        if self.defect == "stale version":
            g.weight_version -= 1
        return g

    async def abort(self, request_id):
        await self.inner.abort(request_id)

    async def load_weights(self, weights, version=None):
        return await self.inner.load_weights(weights, version)

    async def aclose(self):
        """The inner engine belongs to the fixture."""


@pytest.fixture(scope="module")
def prompt(engine):
    return testing.chat_prompt(engine, "Compute 123 * 45 + 6789.", system="Use Python. " * 12)


async def test_the_real_engine_keeps_every_promise(engine, prompt):
    text = engine.tokenizer.decode(prompt)
    assert text.startswith("<|im_start|>system\nUse Python.") and text.endswith("<|im_start|>assistant\n")
    await testing.engine_contract(engine)
    weights = {n: p.detach().clone() for n, p in engine.model.named_parameters()}
    await testing.check_weight_update(engine, prompt, weights)


@pytest.mark.parametrize("defect, check, message", [
    ("misaligned", "check_alignment", "one logprob per sampled token"),
    ("stale version", "check_alignment", None),  # a bare assert: no message to match
    ("no stop", "check_stop_tokens", "generation must end at the stop token"),
    ("no cache", "check_prefix_cache", "served from the prefix cache"),
])
async def test_a_broken_promise_fails_its_check(engine, prompt, defect, check, message):
    with pytest.raises(AssertionError, match=message):
        await getattr(testing, check)(Broken(engine, defect), prompt)


async def test_an_engine_that_accepts_an_overlong_prompt_fails_the_length_check(engine):
    with pytest.raises(AssertionError, match="must raise PromptTooLongError"):
        await testing.check_too_long(Broken(engine, "no length check"))
