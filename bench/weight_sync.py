"""Weight sync into the in-process vLLM engine: the weight-update group vs the host path.

    python bench/weight_sync.py [--repeats 5] [--big-layers 12]

For the bundled model and for a Qwen2-shaped model of about 100M parameters (randomly
initialised, written to a temporary directory with the bundled tokenizer), one vLLM engine
loads the whole state dict ``--repeats`` times over the group (``weight_sync=group``: a
broadcast into the worker, gloo on CPU) and as many times through the host (``host``: one
safetensors blob through ``collective_rpc``); it prints the median seconds of each and their
ratio. Each timing is ``engine.load_weights`` as the trainer calls it: the pause, the transfer,
the in-place load and the version stamp. The last line is ``weight_sync_speedup: X`` (host /
group, the bigger model).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import anyio
import torch


def big_model(dest: Path, layers: int) -> Path:
    """A Qwen2 config of hidden 768, 12 heads (4 KV), MLP 3072: ~8.7M parameters a layer."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.models import default_model

    small = default_model()
    for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json"):
        if (small / f).exists():
            shutil.copy2(small / f, dest / f)
    base = json.loads((small / "config.json").read_text())
    cfg = Qwen2Config(vocab_size=base["vocab_size"], hidden_size=768, intermediate_size=3072, num_hidden_layers=layers,
                      num_attention_heads=12, num_key_value_heads=4, head_dim=64, max_position_embeddings=2048,
                      tie_word_embeddings=True, eos_token_id=base["eos_token_id"], pad_token_id=base["pad_token_id"])
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).to(torch.float32).save_pretrained(dest)
    return dest


async def measure(model: Path, repeats: int) -> dict[str, float]:
    from safetensors.torch import load_file

    from agentenv.engines.vllm import VLLMEngine
    from agentenv.engines.weight_group import GroupLink

    tensors = load_file(str(model / "model.safetensors"))
    eng = await VLLMEngine.create(model, max_model_len=512)
    out: dict[str, float] = {"params": sum(t.numel() for t in tensors.values()),
                             "bytes": sum(t.numel() * t.element_size() for t in tensors.values())}
    try:
        for mode in ("group", "host"):
            eng.weight_group.close()
            eng.weight_group = GroupLink(mode)
            await eng.load_weights(tensors)  # forms the group (not timed), warms both ends
            times = []
            for _ in range(repeats):
                start = time.perf_counter()
                await eng.load_weights(tensors)
                times.append(time.perf_counter() - start)
            out[f"{mode}_s"] = statistics.median(times)
    finally:
        await eng.aclose()
    return out


async def main() -> None:
    from agentenv.models import default_model

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--big-layers", type=int, default=12)
    args = ap.parse_args()
    rows = {"bundled": await measure(default_model(), args.repeats)}
    with tempfile.TemporaryDirectory() as tmp:
        rows[f"qwen2-{args.big_layers}x768"] = await measure(big_model(Path(tmp), args.big_layers), args.repeats)
    print(f"{'model':<16}{'params':>12}{'MB':>9}{'group s':>10}{'host s':>10}{'host/group':>12}")
    for name, r in rows.items():
        print(f"{name:<16}{int(r['params']):>12,}{r['bytes'] / 1e6:>9.1f}{r['group_s']:>10.3f}{r['host_s']:>10.3f}"
              f"{r['host_s'] / r['group_s']:>12.2f}")
    big = rows[f"qwen2-{args.big_layers}x768"]
    print(f"weight_sync_speedup: {big['host_s'] / big['group_s']:.2f}")


if __name__ == "__main__":
    anyio.run(main)
