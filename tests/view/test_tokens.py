"""Each token's text under the run's tokenizer: the pieces join to the decoded sequence."""

from __future__ import annotations

import json

from tokenizers import Tokenizer

from agentenv.models import default_model
from agentenv.view.tokens import TokenText, tokenizer_dir

from .conftest import DATA


def test_pieces_join_to_the_trajectory_text_and_the_decoded_sequence():
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    text = TokenText(default_model())
    for line in (DATA / "rollout.jsonl").read_text().splitlines():
        row = json.loads(line)
        pieces = text.pieces(row["input_ids"])
        assert len(pieces) == len(row["input_ids"])
        assert "".join(pieces[len(row["prompt_ids"]):]) == row["text"]
        assert "".join(pieces) == tok.decode(row["input_ids"], skip_special_tokens=False)
    assert "<|im_start|>" in text.pieces(row["prompt_ids"])  # special tokens are shown


def test_a_character_split_over_tokens_belongs_to_the_token_that_completes_it():
    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    ids = tok.encode("héllo 日本 ok").ids
    pieces = TokenText(default_model()).pieces(ids)
    assert "".join(pieces) == tok.decode(ids)
    assert "日" in pieces and "\ufffd" not in "".join(pieces)
    assert "" in pieces  # the bytes before the completing one show nothing of their own


def test_a_run_whose_model_is_gone_falls_back_to_the_bundled_tokenizer(tmp_path):
    assert tokenizer_dir(str(tmp_path / "gone")) == (default_model(), False)
    assert tokenizer_dir(None) == (default_model(), False)
    assert tokenizer_dir(str(default_model())) == (default_model(), True)
