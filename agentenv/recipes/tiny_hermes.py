"""Build and train the bundled tiny Hermes model (Qwen2 architecture) on CPU.

    python -m agentenv.recipes.tiny_hermes --out agentenv/models/tiny-hermes

The recipe of :mod:`agentenv.recipes.tiny` in the Hermes format of ``retool-math``
(``format="hermes"``): each model turn thinks in ``<think>...</think>`` and then calls
``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``; each tool output
returns as a ``<tool_response>`` user turn rendered by the model's own chat template
(:data:`~agentenv.models.tokenizer.HERMES_CHAT_TEMPLATE`, Qwen2.5/Qwen3 style); the last turn
thinks and answers in ``\\boxed{}``.

1. Generate ``retool-math`` tasks and run their reference cells in a real sandbox session.
2. Build the tokenizer (byte-level BPE, tags as single tokens, the Hermes chat template).
3. Lay each transcript out as the reactor will: prompt ids, model turn (loss on), the
   format's observation rendered by the chat template (loss off), ...
4. Start from the bundled ReTool model's weights (:func:`warm_start`: it already reads these
   problems and copies their numbers, so a few hundred steps teach it the new format, a
   fraction of what training from scratch costs), train by supervised learning, and save
   model + tokenizer.
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import anyio
import torch

from agentenv.envs.retool_math import RetoolMathEnv
from agentenv.formats import HermesFormat

from agentenv.models import BUNDLED, model_dir
from agentenv.models.tokenizer import HERMES_CHAT_TEMPLATE

from .tiny import _copy_drills, _render, arguments, build_model, fit, save, tokenizer_for

DEFAULT_DIR = BUNDLED["tiny-hermes"]
#: What the model thinks before each call, by problem kind (and before a second call).
THOUGHTS = {
    "arithmetic": ["I need the value of the expression. Python computes it exactly.",
                   "This is arithmetic. I will let Python compute it."],
    "word": ["I turn the story into arithmetic and let Python compute it.",
             "The story is arithmetic. I will compute it with Python."],
    "algebra": ["x is the right side minus the constant, divided by the factor. I will compute it.",
                "I solve for x in Python: subtract, then divide."],
    "digit_sum": ["First the product, then the sum of its digits. I start with the product.",
                  "I compute the product first, then add its digits."],
    "next": ["Now I add up the digits of n.", "Next, the sum of the digits."],
    "final": ["The tool printed the answer.", "The output is the result."],
}


def thought(rng: random.Random, key: str) -> str:
    """A one-sentence reasoning block for ``key``, then the blank line before the action."""
    return f"<think>\n{rng.choice(THOUGHTS[key])}\n</think>\n\n"


async def _transcripts(n: int, seed: int) -> list[dict]:
    """Task, prompt messages and the (kind, text) pieces of the assistant's part; a ``tool``
    piece is the raw tool output, rendered by the chat template once the tokenizer exists."""
    from agentenv.sandboxes.local import LocalSandbox

    # The easiest setting (extra_digits=0), as for the ReTool model: headroom for RL.
    env, fmt, rng = RetoolMathEnv(extra_digits=0, format="hermes"), HermesFormat(), random.Random(seed)
    out = []
    async with LocalSandbox() as sandbox:
        session = await sandbox.session()
        for task in env.tasks(n, seed):
            pieces: list[tuple[str, str]] = []
            for i, cell in enumerate(task.data["solution"]):
                lead = thought(rng, task.data["kind"] if i == 0 else "next")
                pieces.append(("model", lead + fmt.example_call("python", {"code": cell})))
                res = await session.run(cell)
                pieces.append(("tool", res.render()))
            pieces.append(("model", thought(rng, "final") + f"The answer is \\boxed{{{task.answer}}}."))
            out.append({"messages": env.prompt(task), "pieces": pieces})
        await session.aclose()
    return out


def lay_out(tok, tr: dict) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one transcript: its tool outputs spliced as the format's
    observation (the chat template's ``<tool_response>`` turn), exactly as at rollout time."""
    fmt = HermesFormat()
    pieces = [("env", fmt.observation([p], tok, False)) if kind == "tool" else (kind, p) for kind, p in tr["pieces"]]
    return _render(tok, {"messages": tr["messages"], "pieces": pieces})


def warm_start(model, tok, base: Path) -> None:
    """Start ``model`` (tokenizer ``tok``) from the model in ``base``: its transformer weights,
    and its token embeddings by token text (a token of both vocabularies keeps its row, e.g.
    every digit and tag; any other starts as the mean of the rows of the base tokens that spell
    it). The output head is tied to the embeddings, so it follows."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from agentenv.models import quiet_loading

    with quiet_loading():
        old, old_tok = AutoModelForCausalLM.from_pretrained(str(base)), AutoTokenizer.from_pretrained(str(base))
    weights = {k: v for k, v in old.state_dict().items() if "embed_tokens" not in k and "lm_head" not in k}
    missing, unexpected = model.load_state_dict(weights, strict=False)
    assert not unexpected and all("embed_tokens" in k or "lm_head" in k for k in missing), (missing, unexpected)
    rows, old_rows, old_vocab = (model.get_input_embeddings().weight.data, old.get_input_embeddings().weight.data,
                                 old_tok.get_vocab())
    for text, i in tok.get_vocab().items():
        j = old_vocab.get(text)
        spelled = [j] if j is not None else old_tok.encode(tok.convert_tokens_to_string([text]), add_special_tokens=False)
        if spelled:
            rows[i] = old_rows[spelled].mean(0)


def train(out: Path, n_tasks: int, steps: int, batch: int, lr: float, seed: int, drills: int = 0,
          base: Path | None = None) -> dict:
    """Build the tiny Hermes model into ``out`` (from ``base``'s weights, or from scratch when
    None); returns what ``training.json`` records."""
    torch.manual_seed(seed)
    random.seed(seed)
    t0 = time.perf_counter()
    trs = anyio.run(_transcripts, n_tasks, seed) + _copy_drills(drills, seed)
    tok = tokenizer_for(trs, chat_template=HERMES_CHAT_TEMPLATE)
    data = [lay_out(tok, tr) for tr in trs]
    print(f"{len(data)} transcripts, vocab {len(tok)}, mean length "
          f"{sum(len(d[0]) for d in data) / len(data):.0f} tokens ({time.perf_counter() - t0:.1f}s)", flush=True)
    model = build_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    if base is not None:
        warm_start(model, tok, base)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, from {base or 'scratch'}", flush=True)
    loss = fit(model, tok, data, steps, batch, lr, seed, t0)
    info = {"format": "hermes", "base": base.name if base else None, "n_tasks": n_tasks, "copy_drills": drills,
            "steps": steps, "batch": batch, "lr": lr, "seed": seed, "params": n_params, "final_loss": loss,
            "seconds": time.perf_counter() - t0}
    save(model, tok, out, info)
    return info


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, DEFAULT_DIR, 900)
    ap.set_defaults(batch=16, lr=1e-3, drills=2000, threads=1)
    ap.add_argument("--base", default="tiny-retool",
                    help="start from this model's weights: a bundled model's name or a directory ('none': from scratch)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = None if a.base == "none" else model_dir(a.base)
    print(train(a.out, a.tasks, a.steps, a.batch, a.lr, a.seed, a.drills, base))


if __name__ == "__main__":
    main()
