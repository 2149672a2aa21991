"""``EngineSpec`` opens the engine it names, with a bundled model's name as ``--model`` takes it."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.engines.spec import EngineSpec
from agentenv.errors import ConfigError
from agentenv.models import BUNDLED

pytestmark = pytest.mark.anyio


async def test_a_bundled_models_name_opens_that_model_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder named tiny-hermes here
    engine = await EngineSpec("embedded", "tiny-hermes").open()
    try:
        assert Path(engine.model_path).resolve() == BUNDLED["tiny-hermes"].resolve()
        assert "<tool_call>" in engine.tokenizer.get_vocab()
    finally:
        await engine.aclose()


async def test_a_keyword_the_engine_does_not_take_names_the_ones_it_does():
    with pytest.raises(ConfigError, match="bad --engine-arg for the embedded engine.*takes"):
        await EngineSpec("embedded", "tiny-retool", {"no_such_setting": 1}).open()
