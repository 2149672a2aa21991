"""Packed vs. padded training steps: trained tokens per second of ``Policy.train_step`` on the
retool-math length mix.

    python bench/train_packing.py [--groups 4 --group-size 8 --budgets 1024 8192 --repeats 3]

The rows come from a real rollout of the bundled model on retool-math with the environment's
training settings (``train_defaults``: temperature 1.6, one extra digit, 128 new tokens per
turn), run once here: a mix of short answers and a few multi-turn rows several times longer.
Two models train on them, each as a padded and as a packed policy (same seed, same weights):

* ``bundled``: the bundled tiny model (Qwen2 architecture, 4 layers, hidden 192), on the
  rollout's own token ids;
* ``qwen2-39m``: a randomly initialised Qwen2 (8 layers, hidden 512, 8 heads / 2 KV heads,
  MLP 1408, vocabulary 32,000: ~39M parameters, what two CPU cores step through in tens of
  seconds), on random ids with the rollout's row lengths and loss masks.

For each model and each token budget (``micro_batch_tokens``: padded tokens per pass when
padded, the rows' own tokens when packed; 1024 is retool-math's training default, 8192
TrainConfig's), the padded and packed steps alternate ``--repeats`` times after one warm-up
step each; a step's time is the fastest of its repeats. Both the wall time and the process's
CPU time (all its threads) are measured: on a machine shared with other work the wall time
also counts the waits for a core, so the speedups are computed from the CPU time (on an idle
machine the two agree). The first step's loss of both is printed: packing does not change it.

Prints one line per (model, budget) and, last, ``packing_speedup: X``: on the bundled model,
the packed step's best throughput over the budgets over the padded step's best (each path at
the budget that suits it: padding favours small passes of like-length rows, packing large
ones).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _report  # noqa: E402  (bench/_report.py: the figures as JSON)

#: The second model's shape: Qwen2, scaled to run a step in tens of seconds on two cores.
QWEN2_39M = dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 intermediate_size=1408, vocab_size=32000, tie_word_embeddings=True, max_position_embeddings=32768)


def rollout_batch(groups: int = 4, group_size: int = 8, seed: int = 0):
    """A collated batch of a real retool-math rollout of the bundled model, with the
    environment's training settings."""
    import anyio

    from agentenv.config import RolloutConfig
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.models import default_model
    from agentenv.registry import make
    from agentenv.reactor import Reactor
    from agentenv.sandboxes import default_sandbox
    from agentenv.train import TrainConfig, collate

    cfg = TrainConfig.for_env("retool-math")

    async def collect():
        env = make("retool-math", **cfg.env.env_kwargs)
        engine = EmbeddedEngine(default_model(), seed=seed, temperature=cfg.rollout.temperature)
        try:
            rc = RolloutConfig(max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature)
            async with default_sandbox("local") as sb, Reactor(engine, env, sb, rc) as reactor:
                return await reactor.collect(env.tasks(groups, seed=seed), group_size=group_size)
        finally:
            await engine.aclose()

    return collate(anyio.run(collect))


def qwen2_model(out: Path) -> Path:
    """A randomly initialised :data:`QWEN2_39M` model directory (seed 0)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_39M)).save_pretrained(str(out))
    return out


def with_random_ids(batch, vocab: int, seed: int = 0):
    """``batch`` with random token ids below ``vocab`` (the lengths and loss masks kept)."""
    import dataclasses

    import torch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, batch.input_ids.shape, generator=g) * batch.attention_mask
    return dataclasses.replace(batch, input_ids=ids)


def compare(model_dir: str | Path, batch, budget: int, repeats: int = 3, micro_batch: int = 16) -> dict[str, Any]:
    """CPU seconds (``step_s``) and wall seconds per ``train_step`` of a padded and a packed
    policy (the fastest of ``repeats`` alternating steps, after a warm-up step each), trained
    tokens per CPU second, passes, tokens computed per step (padding included) and first-step
    losses."""
    import torch

    from agentenv.train import TrainConfig
    from agentenv.train.loss import LossConfig
    from agentenv.train.policy import Policy

    defaults = TrainConfig.for_env("retool-math")
    policies = {}
    for pack in (False, True):
        torch.manual_seed(0)
        policies[pack] = Policy(model_dir, lr=defaults.lr, temperature=defaults.temperature, micro_batch=micro_batch,
                                micro_batch_tokens=budget, pack=pack,
                                loss=LossConfig(aggregation=defaults.aggregation), device="cpu")
    first = {pack: p.train_step(batch)["loss"] for pack, p in policies.items()}  # the warm-up step
    times: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
    for _ in range(repeats):
        for pack, p in policies.items():
            wall, cpu = time.perf_counter(), time.process_time()
            p.train_step(batch)
            times[pack].append((time.process_time() - cpu, time.perf_counter() - wall))
    lengths = batch.lengths
    out: dict[str, Any] = {"budget": budget, "trained_tokens": batch.trained_tokens, "rows": batch.size,
                           "row_tokens": sum(lengths)}
    for pack, name in ((False, "padded"), (True, "packed")):
        plan = policies[pack].micro_plan(batch)
        computed = sum((sum(lengths[i] for i in p) if pack else len(p) * max(lengths[i] for i in p)) for p in plan)
        best = min(t[0] for t in times[pack])
        out[name] = {"step_s": round(best, 3), "wall_s": round(min(t[1] for t in times[pack]), 3),
                     "trained_tok_s": round(batch.trained_tokens / best, 1), "passes": len(plan),
                     "computed_tokens": computed, "first_loss": first[pack]}
    out["speedup"] = round(out["padded"]["step_s"] / out["packed"]["step_s"], 3)
    out["loss_diff"] = abs(first[True] - first[False])
    return out


def best_speedup(results: list[dict[str, Any]]) -> float:
    """The packed step's best time over the padded step's best, over the budgets of ``results``."""
    return round(min(r["padded"]["step_s"] for r in results) / min(r["packed"]["step_s"] for r in results), 3)


def packing_speedup(budgets: tuple[int, ...] = (1024, 8192), repeats: int = 3, groups: int = 4,
                    group_size: int = 8) -> float:
    """Packed over padded ``train_step`` throughput on the bundled model, on a fresh retool-math
    rollout's rows, each path at its best of ``budgets`` tokens per pass (:func:`best_speedup`)."""
    from agentenv.models import default_model

    batch = rollout_batch(groups, group_size)
    return best_speedup([compare(default_model(), batch, b, repeats) for b in budgets])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--groups", type=int, default=4, help="GRPO groups in the rollout (retool-math trains 4 per step)")
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--budgets", type=int, nargs="+", default=[1024, 8192], help="micro_batch_tokens values")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--models", nargs="+", default=["bundled", "qwen2-39m"], choices=["bundled", "qwen2-39m"])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()

    import torch

    from agentenv.models import default_model

    batch = rollout_batch(a.groups, a.group_size, a.seed)
    lengths = sorted(batch.lengths)
    print(f"retool-math rollout: {batch.size} rows, {sum(lengths)} tokens ({batch.trained_tokens} trained), "
          f"lengths min {lengths[0]} median {lengths[len(lengths) // 2]} max {lengths[-1]}; "
          f"torch threads {torch.get_num_threads()}")
    figures: dict[str, Any] = {"lengths": lengths, "results": []}
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.models:
            model_dir = default_model() if name == "bundled" else qwen2_model(Path(tmp) / name)
            rows = batch if name == "bundled" else with_random_ids(batch, QWEN2_39M["vocab_size"], a.seed)
            for budget in a.budgets:
                r = compare(model_dir, rows, budget, a.repeats)
                r["model"] = name
                figures["results"].append(r)
                pad, pk = r["padded"], r["packed"]
                print(f"{name:9s} budget {budget:5d}: padded {pad['passes']:2d} passes {pad['computed_tokens']:6d} tok "
                      f"{pad['step_s']:6.2f} cpu-s ({pad['wall_s']:6.2f} wall) {pad['trained_tok_s']:7.1f} tok/s | "
                      f"packed {pk['passes']:2d} passes {pk['computed_tokens']:6d} tok {pk['step_s']:6.2f} cpu-s "
                      f"({pk['wall_s']:6.2f} wall) {pk['trained_tok_s']:7.1f} tok/s | x{r['speedup']:.2f}, "
                      f"first-step loss diff {r['loss_diff']:.1e}", flush=True)
    for name in a.models:
        figures[f"best_speedup_{name}"] = best_speedup([r for r in figures["results"] if r["model"] == name])
        print(f"{name}: best packed over best padded x{figures[f'best_speedup_{name}']:.2f}")
    figures["packing_speedup"] = figures[f"best_speedup_{a.models[0]}"]
    print(f"packing_speedup: {figures['packing_speedup']:.2f}")
    _report.write("train_packing", figures, headline="packing_speedup", args=a)


if __name__ == "__main__":
    main()
