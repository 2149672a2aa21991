"""The bundled model's recipe (``agentenv.recipes.tiny``): the architecture it builds is the
bundled model's, transcripts are laid out with the reactor's masks, and a few training steps
on real sandbox transcripts write a model directory the embedded engine serves."""

from __future__ import annotations

import json

import anyio
import pytest
from transformers import AutoConfig

from agentenv.engines.base import SamplingParams
from agentenv.models import default_model
from agentenv.recipes import tiny


def test_the_architecture_is_the_bundled_models(tokenizer):
    model = tiny.build_model(len(tokenizer), tokenizer.eos_token_id, tokenizer.pad_token_id)
    bundled = AutoConfig.from_pretrained(str(default_model()))
    for key in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "head_dim", "tie_word_embeddings", "eos_token_id", "pad_token_id"):
        assert getattr(model.config, key) == getattr(bundled, key), key
    recorded = json.loads((default_model() / "training.json").read_text())
    assert sum(p.numel() for p in model.parameters()) == recorded["params"]


def test_a_transcript_is_laid_out_as_the_reactor_splices_it(tokenizer):
    tr = {"messages": [{"role": "user", "content": "2 + 3?"}],
          "pieces": [("model", "<code>\nprint(2 + 3)\n</code>"), ("env", "\n<interpreter>\n5\n</interpreter>\n"),
                     ("model", "The answer is \\boxed{5}.")]}
    ids, mask = tiny._render(tokenizer, tr)
    prompt = tokenizer.apply_chat_template(tr["messages"], add_generation_prompt=True, tokenize=False)
    n = len(tokenizer.encode(prompt, add_special_tokens=False))
    assert len(ids) == len(mask) and mask[:n] == [0] * n
    assert tokenizer.decode(ids) == prompt + "".join(p for _, p in tr["pieces"]) + tokenizer.eos_token
    spans, at = [], n
    for kind, piece in tr["pieces"]:
        k = len(tokenizer.encode(piece, add_special_tokens=False))
        spans.append(set(mask[at:at + k]))
        at += k
    assert spans == [{1}, {0}, {1}] and ids[-1] == tokenizer.eos_token_id and mask[-1] == 1


def test_copy_drills_repeat_the_question_and_depend_only_on_the_seed():
    drills = tiny._copy_drills(20, seed=3)
    assert drills == tiny._copy_drills(20, seed=3) != tiny._copy_drills(20, seed=4)
    for d in drills:
        assert d["messages"][0]["content"] == "Repeat: " + d["pieces"][0][1]


@pytest.mark.timeout(300)
@pytest.mark.slow
def test_a_few_steps_write_a_model_directory_the_engine_serves(tmp_path):
    from agentenv.engines.embedded import EmbeddedEngine

    info = tiny.train(tmp_path / "m", n_tasks=4, steps=3, batch=2, lr=1e-3, seed=0, drills=2)
    assert info["steps"] == 3 and json.loads((tmp_path / "m" / "training.json").read_text()) == info

    async def generate():
        engine = EmbeddedEngine(tmp_path / "m", seed=0)
        try:
            prompt = engine.tokenizer.encode("Repeat: 12 34", add_special_tokens=False)
            return await engine.generate(prompt, SamplingParams(max_tokens=4), "tiny-0")
        finally:
            await engine.aclose()

    g = anyio.run(generate)
    assert 0 < len(g.token_ids) == len(g.logprobs) <= 4
