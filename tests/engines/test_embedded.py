"""The engine contract on the real embedded engine (transformers continuous batching)."""

import pytest

from agentenv import testing
from agentenv.engines.base import SamplingParams
from agentenv.errors import ConfigError


@pytest.fixture(scope="module")
def engine(own_engine):
    """This module loads weights into its engine: its own engine, not the session's."""
    return own_engine


pytestmark = pytest.mark.anyio


async def test_engine_contract(engine):
    await testing.engine_contract(engine)


async def test_resume_reports_cached_tokens_close_to_the_whole_prefix(engine):
    prompt = testing.chat_prompt(engine, "Compute 4364 + 83 * 54.", system="Use Python. " * 10)
    p = SamplingParams(max_tokens=40)
    g = await engine.generate(prompt, p, "resume-1")
    resumed = prompt + g.token_ids + engine.tokenizer.encode("\n<interpreter>\n8846\n</interpreter>\n")
    g2 = await engine.generate(resumed, p, "resume-2")
    seen = len(prompt) + len(g.token_ids) - 1  # KV exists for all but the last sampled token
    assert g2.cached_tokens >= (seen // engine.page_size) * engine.page_size > 0


async def test_weight_update_changes_outputs_and_version(engine):
    import math

    import torch

    prompt = testing.chat_prompt(engine, "Compute 12 * 34.")
    original = engine.model.lm_head.weight.detach().clone()
    vocab = original.shape[0]
    before = await engine.generate(prompt, SamplingParams(max_tokens=8), "before-update")
    assert any(abs(lp + math.log(vocab)) > 1e-3 for lp in before.logprobs)
    try:
        # Zero output weights: every logit is 0, so every sampled token has logprob -log(V).
        await testing.check_weight_update(engine, prompt, {"lm_head.weight": torch.zeros_like(original)})
        g = await engine.generate(prompt, SamplingParams(max_tokens=8), "after-update")
        assert g.weight_version == engine.weight_version == before.weight_version + 1
        assert all(abs(lp + math.log(vocab)) < 1e-3 for lp in g.logprobs)
    finally:
        await engine.load_weights({"lm_head.weight": original})


async def test_sampling_settings_are_fixed_per_engine(engine):
    with pytest.raises(ConfigError, match="temperature"):
        await engine.generate([1, 2, 3], SamplingParams(max_tokens=2, temperature=0.5), "temp")


def test_missing_model_dir(tmp_path):
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.errors import ModelNotFoundError

    with pytest.raises(ModelNotFoundError):
        EmbeddedEngine(tmp_path / "nope")
    with pytest.raises(ModelNotFoundError, match="config.json"):
        EmbeddedEngine(tmp_path)


def test_a_transformers_release_outside_the_tested_range_is_a_one_line_error():
    from agentenv.engines.embedded import TRANSFORMERS_RANGE, require_transformers
    from agentenv.errors import ConfigError

    require_transformers()  # the installed one is in range
    lo, hi = TRANSFORMERS_RANGE
    for found in (f"{lo[0]}.{lo[1] - 2}.0", f"{hi[0]}.{hi[1]}.1"):
        with pytest.raises(
            ConfigError, match=rf"needs transformers>={lo[0]}\.{lo[1]},<{hi[0]}\.{hi[1]}, found {found}"
        ):
            require_transformers(found)
