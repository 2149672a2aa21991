"""Build and train the bundled tiny ReTool model (Qwen2 architecture) on CPU.

    python -m agentenv.recipes.tiny --out agentenv/models/tiny-retool

1. Generate ``retool-math`` tasks and their reference code cells.
2. Run every cell in a real sandbox session, so the transcripts carry real interpreter output.
3. Build the tokenizer (BPE + byte fallback + tags + chat template) on those transcripts.
4. Lay each transcript out exactly as the reactor will at rollout time: chat-template prompt
   ids, then model text (loss on), then the format's observation text (loss off), ...
5. Train a small Qwen2 model by supervised learning and save model + tokenizer.

The result emits well-formed ``<code>`` calls nearly always and solves many, not all,
problems when sampled at temperature 1 (copying long numbers is where it slips), which
leaves headroom for RL.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import anyio
import torch

from agentenv.formats import ReToolFormat
from agentenv.envs.retool_math import RetoolMathEnv

from agentenv.models import BUNDLED
from agentenv.models.tokenizer import build_tokenizer

DEFAULT_DIR = BUNDLED["tiny-retool"]
OPENERS = ["I will use Python.", "Let me compute this with code.", "I will write code for this."]
SECOND = ["Now the next step.", "Next, I compute the rest."]


async def _transcripts(n: int, seed: int) -> list[dict]:
    """Task, prompt messages and the list of (kind, text) pieces of the assistant's part."""
    from agentenv.sandboxes.local import LocalSandbox

    # The SFT data uses the easiest setting (extra_digits=0); the env default is harder, which
    # leaves headroom for RL.
    env, fmt, rng = RetoolMathEnv(extra_digits=0), ReToolFormat(), random.Random(seed)
    out = []
    async with LocalSandbox() as sandbox:
        session = await sandbox.session()
        for task in env.tasks(n, seed):
            pieces: list[tuple[str, str]] = []
            for i, cell in enumerate(task.data["solution"]):
                lead = rng.choice(OPENERS if i == 0 else SECOND)
                pieces.append(("model", f"{lead}\n<code>\n{cell}\n</code>"))
                res = await session.run(cell)
                pieces.append(("env", fmt.observation([res.render()], None, False)))
            pieces.append(("model", f"The answer is \\boxed{{{task.answer}}}."))
            out.append({"messages": env.prompt(task), "pieces": pieces})
        await session.aclose()
    return out


def _copy_drills(n: int, seed: int) -> list[dict]:
    """Short chat exchanges whose answer repeats numbers from the question.

    Copying digits from the question into code (and from the interpreter into the answer) is
    what the tiny model must learn; dense copy examples make that ability form in a few
    hundred steps instead of thousands.
    """
    rng = random.Random(seed + 1)
    out = []
    for _ in range(n):
        nums = [str(rng.randint(1, 10 ** rng.randint(1, 5))) for _ in range(rng.randint(2, 6))]
        text = " ".join(nums)
        out.append({"messages": [{"role": "user", "content": f"Repeat: {text}"}],
                    "pieces": [("model", text)]})
    return out


def _render(tok, tr: dict) -> tuple[list[int], list[int]]:
    """Ids and loss mask: the prompt (``messages``, and ``tools`` where given, rendered by the
    chat template; loss off), then each piece (loss on for ``model`` pieces), then EOS."""
    text = tok.apply_chat_template(tr["messages"], tools=tr.get("tools"), add_generation_prompt=True, tokenize=False)
    ids = tok.encode(text, add_special_tokens=False)
    mask = [0] * len(ids)
    for kind, piece in tr["pieces"]:
        p = tok.encode(piece, add_special_tokens=False)
        ids += p
        mask += [1 if kind == "model" else 0] * len(p)
    ids.append(tok.eos_token_id)  # the model ends its last turn with <|im_end|>
    mask.append(1)
    return ids, mask


def build_model(vocab_size: int, eos_id: int, pad_id: int):
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(
        vocab_size=vocab_size,
        hidden_size=192,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=6,
        num_key_value_heads=2,
        head_dim=32,  # vLLM's CPU attention needs 32, 64, 80, ...
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        rope_theta=10000.0,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    return Qwen2ForCausalLM(cfg)


def tokenizer_for(trs: list[dict], **kwargs):
    """A tokenizer trained on the transcripts' messages and rendered pieces (plus the chat
    roles' names); ``kwargs`` go to :func:`build_tokenizer` (e.g. its ``chat_template``)."""
    corpus = []
    for tr in trs:
        corpus.append("".join(m["content"] + "\n" for m in tr["messages"]))
        corpus.append("".join(p for _, p in tr["pieces"]))
    corpus += ["system\nuser\nassistant\n"] * 20
    return build_tokenizer(corpus, **kwargs)


def train(out: Path, n_tasks: int, steps: int, batch: int, lr: float, seed: int, drills: int = 0) -> dict:
    torch.manual_seed(seed)
    random.seed(seed)
    t0 = time.perf_counter()
    trs = anyio.run(_transcripts, n_tasks, seed) + _copy_drills(drills, seed)
    tok = tokenizer_for(trs)
    data = [_render(tok, tr) for tr in trs]
    print(f"{len(data)} transcripts, vocab {len(tok)}, mean length "
          f"{sum(len(d[0]) for d in data) / len(data):.0f} tokens ({time.perf_counter() - t0:.1f}s)")

    model = build_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters")
    loss = fit(model, tok, data, steps, batch, lr, seed, t0)
    info = {"n_tasks": n_tasks, "copy_drills": drills, "steps": steps, "batch": batch, "lr": lr, "seed": seed,
            "params": n_params, "final_loss": loss, "seconds": time.perf_counter() - t0}
    save(model, tok, out, info)
    return info


def fit(model, tok, data: list[tuple[list[int], list[int]]], steps: int, batch: int, lr: float, seed: int,
        t0: float) -> float:
    """Supervised training on laid-out transcripts (loss on mask-1 tokens only): AdamW, linear
    warm-up over the first 5 % of steps, cosine decay. Returns the last step's loss."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.98))
    warm = max(1, steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps))
    )
    model.train()
    rng = random.Random(seed)
    for step in range(steps):
        rows = rng.sample(data, batch)
        width = max(len(r[0]) for r in rows)
        ids = torch.full((batch, width), tok.pad_token_id)
        labels = torch.full((batch, width), -100)
        for i, (r_ids, r_mask) in enumerate(rows):
            ids[i, : len(r_ids)] = torch.tensor(r_ids)
            lab = torch.tensor([t if m else -100 for t, m in zip(r_ids, r_mask)])
            labels[i, : len(r_ids)] = lab
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == steps - 1:
            print(f"step {step:4d}  loss {loss.item():.4f}  ({time.perf_counter() - t0:.0f}s)", flush=True)
    return float(loss.item())


def save(model, tok, out: Path, info: dict) -> None:
    """Write model, tokenizer (with its chat template), ``training.json`` and ``agentenv.json``
    (the tool-call format it speaks: ``info["format"]``, default retool) to ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    model.eval()
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    tok.save_pretrained(out)
    (out / "training.json").write_text(json.dumps(info, indent=2) + "\n")
    (out / "agentenv.json").write_text(json.dumps({"tool_format": info.get("format", "retool")}, indent=2) + "\n")


def arguments(doc: str, out: Path, steps: int) -> argparse.ArgumentParser:
    """The command line of a bundled model's build script."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--out", type=Path, default=out)
    ap.add_argument("--tasks", type=int, default=4000)
    ap.add_argument("--steps", type=int, default=steps)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--drills", type=int, default=4000, help="copy-drill examples mixed in")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=2)
    return ap


def main(argv: list[str] | None = None) -> None:
    a = arguments(__doc__, DEFAULT_DIR, 1500).parse_args(argv)
    torch.set_num_threads(a.threads)
    print(train(a.out, a.tasks, a.steps, a.batch, a.lr, a.seed, a.drills))


if __name__ == "__main__":
    main()
