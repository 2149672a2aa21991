"""Build and train the bundled tiny Hermes model (Qwen2 architecture) on CPU.

    python -m agentenv.recipes.tiny_hermes --out agentenv/models/tiny-hermes

The recipe of :mod:`agentenv.recipes.tiny` in the Hermes format of ``retool-math``
(``format="hermes"``): each model turn thinks in ``<think>...</think>`` and then calls
``<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>``; each tool output
returns as a ``<tool_response>`` user turn rendered by the model's own chat template
(:data:`~agentenv.models.tokenizer.HERMES_CHAT_TEMPLATE`, Qwen2.5/Qwen3 style); the last turn
thinks and answers in ``\\boxed{}``.

A share of the transcripts (``--tools-share``) come as an OpenAI request reaches the model
instead: no environment prompt, the question as the user turn and ``tools=[python]`` rendered
by the chat template (the ``# Tools`` system block a gateway or ``vllm serve`` writes), each
call turn ending with ``<|im_end|>`` (loss on: an OpenAI server stops there, not at
``</tool_call>``); some of those carry their earlier turns as the template re-renders an
OpenAI history (assistant ``tool_calls``, ``role: tool`` messages) with loss on the last turn
only.

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

import json
import random
import time
from pathlib import Path

import anyio
import torch

from agentenv.envs.retool_math import HERMES_PROMPT, RetoolMathEnv
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


#: The python tool as OpenAI requests declare it, in the shapes agent libraries write it (the
#: plain SDK, a pydantic schema with titles, a strict Agents SDK function tool).
PYTHON_TOOLS = [
    {"type": "function", "function": {
        "name": "python", "description": "Run Python code and return what it prints.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "python", "description": "Run Python code. Print the result.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string", "description": "Python source"}},
                       "required": ["code"]}}},
    {"type": "function", "function": {
        "name": "python", "description": "Execute a Python program and return its standard output.",
        "parameters": {"properties": {"code": {"title": "Code", "type": "string"}}, "required": ["code"],
                       "title": "python_args", "type": "object", "additionalProperties": False},
        "strict": True}},
]
#: System turns an agent may send before the tools block (None: none).
AGENT_SYSTEMS = [None, None, "You are a helpful assistant.",
                 "Solve the problem with Python. Give the final answer as \\boxed{answer}.",
                 "Use the python tool to compute, then give the final answer as \\boxed{answer}.", HERMES_PROMPT]


async def _transcripts(n: int, seed: int) -> list[dict]:
    """Task prompt messages, each call turn as (thought, code cell, tool output) and the final
    turn's text; :func:`env_form` and :func:`openai_form` lay them out as pieces."""
    from agentenv.sandboxes.local import LocalSandbox

    # The easiest setting (extra_digits=0), as for the ReTool model: headroom for RL.
    env, rng = RetoolMathEnv(extra_digits=0, format="hermes"), random.Random(seed)
    out = []
    async with LocalSandbox() as sandbox:
        session = await sandbox.session()
        for task in env.tasks(n, seed):
            calls = []
            for i, cell in enumerate(task.data["solution"]):
                res = await session.run(cell)
                calls.append((thought(rng, task.data["kind"] if i == 0 else "next"), cell, res.render()))
            final = thought(rng, "final") + f"The answer is \\boxed{{{task.answer}}}."
            out.append({"messages": env.prompt(task), "calls": calls, "final": final})
        await session.aclose()
    return out


def env_form(tr: dict) -> dict:
    """The transcript under the environment's own prompt: each turn stops at ``</tool_call>``
    (the reactor's stop string) and its output comes back as a ``tool`` piece."""
    pieces: list[tuple[str, str]] = []
    for lead, cell, output in tr["calls"]:
        pieces += [("model", lead + HermesFormat().example_call("python", {"code": cell})), ("tool", output)]
    return {"messages": tr["messages"], "pieces": pieces + [("model", tr["final"])]}


def openai_form(tr: dict, rng: random.Random, rerender: bool) -> dict:
    """The transcript as an OpenAI request with ``tools=[python]`` reaches the model: an agent's
    system turn (or none), the question, the tool block. Each call turn ends with EOS (loss on).
    ``rerender``: the earlier turns are history, rendered by the template from OpenAI messages
    (``content`` + ``tool_calls``, then ``role: tool``), and only the last turn is learned."""
    system = rng.choice(AGENT_SYSTEMS)
    messages = ([{"role": "system", "content": system}] if system else []) + [tr["messages"][-1]]
    pieces: list[tuple[str, str]] = []
    for i, (lead, cell, output) in enumerate(tr["calls"]):
        if rerender:
            call = {"id": f"call_{i}", "type": "function",
                    "function": {"name": "python", "arguments": json.dumps({"code": cell})}}
            messages += [{"role": "assistant", "content": lead, "tool_calls": [call]},
                         {"role": "tool", "tool_call_id": f"call_{i}", "content": output}]
        else:
            pieces += [("model", lead + HermesFormat().example_call("python", {"code": cell}) + "<|im_end|>"),
                       ("reply", output)]
    return {"messages": messages, "tools": [rng.choice(PYTHON_TOOLS)], "pieces": pieces + [("model", tr["final"])]}


def mix(trs: list[dict], tools_share: float, seed: int) -> list[dict]:
    """Each transcript in the environment's form, or (a ``tools_share`` of them) in the OpenAI
    form, a quarter of those with a re-rendered history."""
    rng = random.Random(seed + 2)
    return [openai_form(tr, rng, rerender=bool(tr["calls"]) and rng.random() < 0.25)
            if rng.random() < tools_share else env_form(tr) for tr in trs]


def lay_out(tok, tr: dict) -> tuple[list[int], list[int]]:
    """Ids and loss mask of one transcript: its tool outputs spliced as the format's
    observation (the chat template's ``<tool_response>`` turn), exactly as at rollout time
    (a ``reply`` piece follows a turn that ended with EOS, as through an OpenAI server)."""
    fmt = HermesFormat()
    pieces = [("env", fmt.observation([p], tok, kind == "reply")) if kind in ("tool", "reply") else (kind, p)
              for kind, p in tr["pieces"]]
    return _render(tok, {"messages": tr["messages"], "tools": tr.get("tools"), "pieces": pieces})


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
        spelled = (
            [j] if j is not None else old_tok.encode(tok.convert_tokens_to_string([text]), add_special_tokens=False)
        )
        if spelled:
            rows[i] = old_rows[spelled].mean(0)


def train(out: Path, n_tasks: int, steps: int, batch: int, lr: float, seed: int, drills: int = 0,
          base: Path | None = None, tools_share: float = 0.0, keep_tokenizer: bool = False) -> dict:
    """Build the tiny Hermes model into ``out`` (from ``base``'s weights, or from scratch when
    None; ``keep_tokenizer``: with ``base``'s own tokenizer, to go on training a Hermes model);
    returns what ``training.json`` records."""
    torch.manual_seed(seed)
    random.seed(seed)
    t0 = time.perf_counter()
    trs = mix(anyio.run(_transcripts, n_tasks, seed), tools_share, seed) + _copy_drills(drills, seed)
    tok, before = _tokenizer(trs, base, keep_tokenizer)
    data = [lay_out(tok, tr) for tr in trs]
    print(f"{len(data)} transcripts ({sum('tools' in tr for tr in trs)} as OpenAI requests), vocab {len(tok)}, mean "
          f"length {sum(len(d[0]) for d in data) / len(data):.0f} tokens ({time.perf_counter() - t0:.1f}s)", flush=True)
    model = build_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    if base is not None:
        warm_start(model, tok, base)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters, from {base or 'scratch'}", flush=True)
    loss = fit(model, tok, data, steps, batch, lr, seed, t0)
    info = {"format": "hermes", "base": base.name if base else None, "n_tasks": n_tasks, "copy_drills": drills,
            "tools_share": tools_share, "steps": steps, "batch": batch, "lr": lr, "seed": seed, "params": n_params,
            "final_loss": loss, "seconds": time.perf_counter() - t0}
    if before is not None:
        info["base_training"] = before  # the base's own recipe: together, how the model was built
    save(model, tok, out, info)
    return info


def _tokenizer(trs: list[dict], base: Path | None, keep: bool):
    """A tokenizer built on the transcripts, or (``keep``) ``base``'s, with its ``training.json``."""
    if not keep:
        return tokenizer_for(trs, chat_template=HERMES_CHAT_TEMPLATE), None
    from agentenv.engines.embedded import load_tokenizer
    from agentenv.errors import ConfigError

    if base is None:
        raise ConfigError("keep_tokenizer needs a base model to take the tokenizer from; give --base")
    tok = load_tokenizer(base)
    if tok.chat_template != HERMES_CHAT_TEMPLATE:
        raise ConfigError(f"{base} is not a tiny Hermes model (its chat template is not HERMES_CHAT_TEMPLATE); "
                          "keep the tokenizer only to go on training one, e.g. --base tiny-hermes")
    record = base / "training.json"
    return tok, json.loads(record.read_text()) if record.exists() else None


def main(argv: list[str] | None = None) -> None:
    ap = arguments(__doc__, DEFAULT_DIR, 900)
    ap.set_defaults(batch=16, lr=1e-3, drills=2000, threads=1)
    ap.add_argument(
        "--base",
        default="tiny-retool",
        help="start from this model's weights: a bundled model's name or a directory ('none': from scratch)",
    )
    ap.add_argument("--tools-share", type=float, default=0.5,
                    help="share of the transcripts laid out as OpenAI requests with tools=[python] (default 0.5)")
    ap.add_argument("--keep-tokenizer", action="store_true",
                    help="keep the base's tokenizer (to go on training a Hermes model, e.g. --base tiny-hermes)")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    base = None if a.base == "none" else model_dir(a.base)
    print(train(a.out, a.tasks, a.steps, a.batch, a.lr, a.seed, a.drills, base, a.tools_share, a.keep_tokenizer))


if __name__ == "__main__":
    main()
