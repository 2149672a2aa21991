"""The trainer and the embedded engine on a CUDA GPU: throughput, peak memory, sync time.

    python bench/gpu.py                       # on a machine with a CUDA GPU (about two minutes on an H200)
    python bench/gpu.py --device cpu --quick  # the same code on the CPU, small shapes (a smoke test)

bench/gpu_check.sh runs it on a GPU machine, after ``pytest -m gpu``. Its parts, each printing
its figures as soon as it has them (``--skip PART`` leaves one out):

* ``qwen``: a randomly initialised Qwen2-family model shaped like Qwen2-0.5B (hidden 896, 24
  layers, 14 heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings; no
  weights can be downloaded) trained by :class:`agentenv.train.policy.Policy` on synthetic
  rows (8 rows x 2,048 tokens, bf16 autocast, float32 master weights): tokens per second of
  the optimiser steps after a warm-up step, the peak memory of the steps, and the weight
  sync: ``sync_tensors`` plus a copy into a second model on the device (``sync_s``) and into
  host memory (``host_copy_s``);
* ``decode``: the embedded engine's decode tok/s, 32 requests of 256 tokens at once, on the
  bundled model and on the 0.5B-shaped one (bf16);
* ``logprobs``: one 8,192-token row through the 0.5B-shaped model, token logprobs and their
  gradient with the whole logits against chunked: peak memory and time;
* ``packing``: a step on rows of uneven lengths, packed (varlen attention) against padded;
* ``bundled``: a short training of the bundled tiny model by agentenv's ``Trainer`` (the
  retool-math environment, the local sandbox, the embedded engine on the same device; the
  vLLM engine too where it is installed): trained tokens per second of the optimiser steps,
  generation tok/s, peak memory, and the sync (``sync_tensors`` plus the engine's
  ``load_weights``) as the trainer measured it. If the trainer cannot run here (a sandbox
  that cannot start, a missing dependency), the same policy and engine train on rows the
  engine generates for fixed prompts, with the error printed;
* ``train``: ``agentenv train --env retool-math --device DEVICE --steps 5`` as a user runs it:
  its wall time and each step's reward.

Peak memory is ``torch.cuda.max_memory_allocated`` on a GPU (reset before each part), the
process's peak resident set so far on the CPU. A GPU machine without internet gets pure-Python
dependencies from ``<repo>/.gpu-deps`` (put first on ``sys.path`` when it exists). The figures
go to ``bench/results/gpu.json`` (not with ``--quick``); the last line is ``gpu_results: {json}``.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if (ROOT / ".gpu-deps").is_dir():
    sys.path.insert(0, str(ROOT / ".gpu-deps"))
sys.path.insert(0, str(ROOT))

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1e6, rms_norm_eps=1e-6)
#: --quick: the same family, small enough for a CPU smoke test.
QUICK = dict(QWEN2_05B, num_hidden_layers=1, vocab_size=16000, intermediate_size=1024)


#: The parts, each skipped with ``--skip PART``.
PARTS = ("qwen", "decode", "logprobs", "packing", "bundled", "train")

#: retool-math by its class path: the id is an entry point, which a tree that is not
#: pip-installed (a GPU machine's copy of the checkout) does not publish.
RETOOL = "agentenv.envs.retool_math:RetoolMathEnv"


def say(text: str) -> None:
    print(text, flush=True)


def peak_gib(device) -> float:
    import torch

    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def reset_peak(device) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def synced(device) -> float:
    """``time.perf_counter()`` once the device has finished its queued work."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter()


def synthetic_batch(rows: int, tokens: int, vocab: int, seed: int):
    """``rows`` rows of ``tokens`` random ids; the second half of each is trained on, with
    advantages of either sign and behaviour logprobs near a uniform policy's."""
    import math

    import torch

    from agentenv.train.batch import Batch

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    mask = torch.zeros(rows, tokens)
    mask[:, tokens // 2:] = 1
    blp = torch.full((rows, tokens), -math.log(vocab)) * mask
    adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(rows)])
    return Batch(
        ids,
        torch.ones(rows, tokens, dtype=torch.long),
        mask,
        blp,
        torch.zeros(rows, tokens, dtype=torch.long),
        adv,
        [float(i % 2 == 0) for i in range(rows)],
    )


def qwen_shaped(args, device) -> dict:
    """Part (b): train steps of the 0.5B-shaped model on synthetic rows."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.train.policy import Policy

    shape = QUICK if args.quick else QWEN2_05B
    rows, tokens, steps = (2, 64, 1) if args.quick else (args.rows, args.tokens, args.steps)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        with torch.device(device):  # initialised where it trains: no host-side init of 0.5B weights
            model = Qwen2ForCausalLM(Qwen2Config(**shape))
        n_params = sum(p.numel() for p in model.parameters())
        model.to(torch.bfloat16).save_pretrained(tmp)  # the Policy loads a model directory (float32 again)
        del model
        policy = Policy(tmp, lr=1e-5, device=str(device), precision=args.precision, micro_batch=args.micro_rows,
                        micro_batch_tokens=args.micro_rows * tokens,
                        activation_checkpointing=args.activation_checkpointing)
    say(f"qwen2-0.5b-shaped: {n_params / 1e6:.0f}M parameters on {policy.device}, precision {policy.precision}, "
        f"{rows} rows x {tokens} tokens, {args.micro_rows} rows per pass; ready in {time.perf_counter() - t0:.1f} s")
    batch = synthetic_batch(rows, tokens, shape["vocab_size"], seed=1)
    reset_peak(device)
    times = []
    for step in range(steps + 1):  # the first is a warm-up (kernels, allocator)
        start = synced(device)
        stats = policy.train_step(batch)
        times.append(synced(device) - start)
        say(f"  step {step}{' (warm-up)' if step == 0 else ''}: {times[-1]:.3f} s, loss {stats['loss']:+.4f}, "
            f"grad_norm {stats['grad_norm']:.3f}")
    peak = peak_gib(device)
    timed = times[1:] or times
    tok_s = rows * tokens * len(timed) / sum(timed)
    # The sync: the policy's tensors into a second copy of the model on the device, then to the host.
    with torch.device(device):
        engine_side = Qwen2ForCausalLM(Qwen2Config(**shape))
    params = dict(engine_side.named_parameters())
    start = synced(device)
    with torch.no_grad():
        for name, tensor in policy.sync_tensors().items():
            params[name].copy_(tensor)
    sync_s = synced(device) - start
    start = synced(device)
    host = {n: t.to("cpu") for n, t in policy.sync_tensors().items()}
    host_s = synced(device) - start
    equal = all(torch.equal(params[n].cpu(), t) for n, t in host.items())
    out = {"params_m": round(n_params / 1e6, 1), "rows": rows, "tokens_per_row": tokens, "precision": policy.precision,
           "activation_checkpointing": args.activation_checkpointing, "step_s": [round(t, 4) for t in times],
           "train_tok_per_s": round(tok_s, 1), "peak_mem_gib": round(peak, 2), "sync_s": round(sync_s, 4),
           "host_copy_s": round(host_s, 4), "sync_gib": round(sum(t.numel() * t.element_size() for t in host.values())
                                                              / 2**30, 3), "synced_equal": equal}
    say(f"qwen2-0.5b-shaped: train_tok_per_s={tok_s:.0f} peak_mem_gib={peak:.2f} sync_s={sync_s:.3f} "
        f"host_copy_s={host_s:.3f} ({out['sync_gib']} GiB, copies equal: {equal})")
    return out


def qwen_dir(tmp: str, shape: dict, device) -> str:
    """A randomly initialised model of ``shape`` saved in ``tmp`` (bf16 on disk) with the bundled
    model's tokenizer files (the engine needs a tokenizer; nothing decodes its random ids)."""
    import shutil

    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.models import default_model

    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape))
    model.to(torch.bfloat16).save_pretrained(tmp)
    del model
    for f in Path(default_model()).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "added_tokens", "vocab", "merges")):
            shutil.copy(f, tmp)
    return tmp


def decode(args, device) -> dict:
    """Part (c): the embedded engine's decode tok/s on ``device``, ``--decode-requests`` requests
    of ``--decode-tokens`` sampled tokens at once (EOS does not stop them), after a warm-up, on
    the bundled model and on the 0.5B-shaped one."""
    import anyio
    import torch

    from agentenv.engines.base import SamplingParams
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.models import default_model

    requests, tokens = (4, 16) if args.quick else (args.decode_requests, args.decode_tokens)

    async def rate(model_dir: str, dtype) -> float:
        engine = EmbeddedEngine(model_dir, seed=0, device=str(device), dtype=dtype)
        try:
            prompt = engine.tokenizer.encode("<|im_start|>user\nCount on.<|im_end|>\n<|im_start|>assistant\n")
            await engine.generate(prompt, SamplingParams(max_tokens=8), "warm-up")
            outs: list = []

            async def one(i: int) -> None:
                outs.append(await engine.generate(prompt, SamplingParams(max_tokens=tokens), f"r{i}"))

            start = synced(device)
            async with anyio.create_task_group() as tg:
                for i in range(requests):
                    tg.start_soon(one, i)
            return sum(len(o.token_ids) for o in outs) / (synced(device) - start)
        finally:
            await engine.aclose()

    out = {"requests": requests, "tokens_per_request": tokens,
           "bundled_tok_per_s": round(anyio.run(rate, str(default_model()), torch.float32), 1)}
    say(f"decode: bundled model, {requests} requests x {tokens} tokens: {out['bundled_tok_per_s']:.0f} tok/s")
    shape = QUICK if args.quick else QWEN2_05B
    with tempfile.TemporaryDirectory() as tmp:
        out["qwen2_05b_tok_per_s"] = round(anyio.run(rate, qwen_dir(tmp, shape, device), torch.bfloat16), 1)
    say(f"decode: qwen2-0.5b-shaped (bf16), {requests} requests x {tokens} tokens: "
        f"{out['qwen2_05b_tok_per_s']:.0f} tok/s")
    return out


def logprobs_peak(args, device) -> dict:
    """Part (d): one row of ``--long-tokens`` tokens through the 0.5B-shaped model, its token
    logprobs and their gradient, with the whole logits (chunk 0) and chunked (the default
    chunk): peak memory and time of each."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from agentenv.train.logprobs import DEFAULT_CHUNK, token_logprobs

    shape = QUICK if args.quick else QWEN2_05B
    n = 256 if args.quick else args.long_tokens
    torch.manual_seed(0)
    with torch.device(device):
        model = Qwen2ForCausalLM(Qwen2Config(**shape)).to(torch.bfloat16)
    model.gradient_checkpointing_enable()  # the layers' activations aside: the head's logits are what differs
    ids = torch.randint(0, shape["vocab_size"], (1, n), device=device)
    out: dict = {"tokens": n, "chunk": DEFAULT_CHUNK}
    for name, chunk in (("whole", 0), ("chunked", DEFAULT_CHUNK)):
        model.zero_grad(set_to_none=True)
        reset_peak(device)
        start = synced(device)
        token_logprobs(model, ids, chunk=chunk).sum().backward()
        out[f"{name}_s"] = round(synced(device) - start, 4)
        out[f"{name}_peak_gib"] = round(peak_gib(device), 3)
    say(f"logprobs: {n} tokens, whole logits peak {out['whole_peak_gib']:.2f} GiB in {out['whole_s']:.3f} s, "
        f"chunked ({DEFAULT_CHUNK}) peak {out['chunked_peak_gib']:.2f} GiB in {out['chunked_s']:.3f} s")
    return out


def packing(args, device) -> dict:
    """Part (e): a training step of the 0.5B-shaped model on rows of uneven lengths, packed
    (varlen attention, no padding) against padded, after a warm-up step of each."""
    import torch

    from agentenv.train.policy import Policy

    shape = QUICK if args.quick else QWEN2_05B
    lengths = [64, 24, 40, 16] if args.quick else [2048, 256, 1024, 512, 1536, 128, 768, 384]
    width = max(lengths)
    batch = synthetic_batch(len(lengths), width, shape["vocab_size"], seed=2)
    for i, n in enumerate(lengths):  # row i holds n tokens, its second half trained on
        batch.attention_mask[i, n:] = 0
        batch.mask[i, :] = 0
        batch.mask[i, n // 2:n] = 1
        batch.behaviour_logprobs[i, n:] = 0
    out: dict = {"lengths": lengths}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = qwen_dir(tmp, shape, device)
        for name, pack in (("padded", False), ("packed", True)):
            policy = Policy(model_dir, lr=1e-5, device=str(device), precision=args.precision, pack=pack,
                            micro_batch_tokens=4 * width)
            policy.train_step(batch)  # warm-up
            reset_peak(device)
            start = synced(device)
            stats = policy.train_step(batch)
            out[f"{name}_s"] = round(synced(device) - start, 4)
            out[f"{name}_peak_gib"] = round(peak_gib(device), 3)
            out[f"{name}_loss"] = round(stats["loss"], 6)
            del policy
    say(f"packing: {len(lengths)} rows of {min(lengths)} to {width} tokens: padded {out['padded_s']:.3f} s "
        f"({out['padded_peak_gib']:.2f} GiB), packed {out['packed_s']:.3f} s ({out['packed_peak_gib']:.2f} GiB)")
    return out


def train_cli(args, device) -> dict:
    """Part (f): ``agentenv train --env retool-math --device DEVICE --steps N`` as a user runs
    it (the installed entry point, the env's training defaults, no evaluation): its wall time
    and each step's reward, from the run's ``metrics.jsonl``."""
    import shutil
    import subprocess

    steps = 1 if args.quick else args.train_steps
    exe = shutil.which("agentenv") or str(Path(sys.executable).with_name("agentenv"))
    with tempfile.TemporaryDirectory() as out_dir:
        cmd = [exe, "train", "--env", "retool-math", "--device", str(device), "--steps", str(steps),
               "--eval-every", "0", "--report-to", "none", "--out-dir", out_dir]
        cmd += ["--sandbox-unisolated"] if args.sandbox_unisolated else []
        start = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=args.train_timeout)
        wall = time.perf_counter() - start
        if r.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[1:])} exited {r.returncode}: {r.stderr[-1500:]}")
        rows = [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines() if line]
    out = {"command": " ".join(["agentenv", *cmd[1:]]).replace(out_dir, "OUT"),
           "steps": len(rows), "wall_s": round(wall, 1), "rewards": [round(r["reward_mean"], 4) for r in rows],
           "gen_tok_per_s": round(sum(r["gen_tokens_per_s"] for r in rows) / max(len(rows), 1), 1),
           "train_s": round(sum(r["train_s"] for r in rows), 3)}
    say(f"train: agentenv train --device {device} --steps {steps}: {out['steps']} steps in {wall:.1f} s, "
        f"rewards {out['rewards']}")
    return out


def bundled(args, device, engine: str) -> dict:
    """Part (a): the Trainer on the bundled model, its engine on ``device``."""
    import anyio

    from agentenv.train.config import TrainConfig
    from agentenv.train.trainer import Trainer

    reset_peak(device)
    steps = 2 if args.quick else args.bundled_steps
    engine_kwargs = {"device": str(device)} if engine == "embedded" else {}
    with tempfile.TemporaryDirectory() as out_dir:
        cfg = TrainConfig.for_env(RETOOL, steps=steps, groups_per_step=2, group_size=4, max_new_tokens=64,
                                  engine=engine, engine_kwargs=engine_kwargs, device=str(device),
                                  precision=args.precision, eval_every=0, report_to=["none"],
                                  checkpoint_every=1000, out_dir=out_dir, seed=0,
                                  sandbox_unisolated=args.sandbox_unisolated)
        trainer = Trainer(cfg, print_steps=False)

        async def run() -> None:
            with anyio.fail_after(args.bundled_deadline):
                await trainer.run()

        start = time.perf_counter()
        anyio.run(run)
        wall = time.perf_counter() - start
    rows = trainer.rows
    train_s = sum(r["train_s"] for r in rows)
    out = {
        "engine": engine,
        "steps": len(rows),
        "wall_s": round(wall, 2),
        "train_tok_per_s": round(sum(r["trained_tokens"] for r in rows) / max(train_s, 1e-9), 1),
        "gen_tok_per_s": round(sum(r["gen_tokens_per_s"] for r in rows) / max(len(rows), 1), 1),
        "peak_mem_gib": round(peak_gib(device), 3),
        "sync_s": round(sum(r["sync_s"] for r in rows) / max(len(rows), 1), 4),
        "rewards": [round(r["reward_mean"], 3) for r in rows],
    }
    say(f"bundled: engine={engine} train_tok_per_s={out['train_tok_per_s']:.0f} "
        f"gen_tok_per_s={out['gen_tok_per_s']:.0f} peak_mem_gib={out['peak_mem_gib']:.3f} "
        f"sync_s={out['sync_s']:.4f} ({out['steps']} steps, {wall:.1f} s)")
    return out


def bundled_direct(args, device) -> dict:
    """Part (a) without the trainer: the embedded engine generates rows for fixed prompts, the
    policy trains on them and the weights go back into the engine, each on ``device``."""
    import anyio
    import torch

    from agentenv.engines.base import SamplingParams
    from agentenv.engines.embedded import EmbeddedEngine
    from agentenv.models import default_model
    from agentenv.train.batch import Batch
    from agentenv.train.policy import Policy

    reset_peak(device)
    model = default_model()
    steps = 2 if args.quick else args.bundled_steps
    policy = Policy(model, lr=1e-4, device=str(device), precision=args.precision)

    async def run() -> dict:
        engine = EmbeddedEngine(model, seed=0, device=str(device))
        prompts = [engine.tokenizer.encode(f"<|im_start|>user\n{a} + {a + 3}?<|im_end|>\n<|im_start|>assistant\n")
                   for a in range(8)]
        tokens = train_s = sync_s = gen_s = gen_tokens = 0.0
        try:
            for step in range(1, steps + 1):
                start = time.perf_counter()
                outs = [await engine.generate(p, SamplingParams(max_tokens=64), f"{step}-{i}")
                        for i, p in enumerate(prompts)]
                gen_s += time.perf_counter() - start
                gen_tokens += sum(len(o.token_ids) for o in outs)
                seqs = [p + o.token_ids for p, o in zip(prompts, outs)]
                width = max(map(len, seqs))
                ids, attn = (
                    torch.zeros(len(seqs), width, dtype=torch.long),
                    torch.zeros(len(seqs), width, dtype=torch.long),
                )
                mask, blp = torch.zeros(len(seqs), width), torch.zeros(len(seqs), width)
                for i, (p, o) in enumerate(zip(prompts, outs)):
                    n = len(p) + len(o.token_ids)
                    ids[i, :n], attn[i, :n], mask[i, len(p):n] = torch.tensor(seqs[i]), 1, 1
                    blp[i, len(p):n] = torch.tensor(o.logprobs)
                adv = torch.tensor([1.0 if i % 2 == 0 else -1.0 for i in range(len(seqs))])
                batch = Batch(ids, attn, mask, blp, torch.zeros_like(ids), adv, [0.0] * len(seqs))
                start = synced(device)
                policy.train_step(batch)
                train_s += synced(device) - start
                tokens += float(mask.sum())
                start = synced(device)
                await engine.load_weights(policy.sync_tensors(), version=step)
                sync_s += synced(device) - start
        finally:
            await engine.aclose()
        return {"engine": "embedded (direct)", "steps": steps, "train_tok_per_s": round(tokens / train_s, 1),
                "gen_tok_per_s": round(gen_tokens / gen_s, 1), "peak_mem_gib": round(peak_gib(device), 3),
                "sync_s": round(sync_s / steps, 4)}

    out = anyio.run(run)
    say(f"bundled: engine={out['engine']} train_tok_per_s={out['train_tok_per_s']:.0f} "
        f"gen_tok_per_s={out['gen_tok_per_s']:.0f} peak_mem_gib={out['peak_mem_gib']:.3f} sync_s={out['sync_s']:.4f}")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda", help="cuda, cuda:N, cpu or auto (default cuda)")
    ap.add_argument("--quick", action="store_true", help="small shapes, few steps, no vLLM (a smoke test)")
    ap.add_argument("--precision", default="auto", choices=("auto", "fp32", "bf16"))
    ap.add_argument("--rows", type=int, default=8, help="0.5B-shaped part: rows per step")
    ap.add_argument("--tokens", type=int, default=2048, help="0.5B-shaped part: tokens per row")
    ap.add_argument("--micro-rows", type=int, default=4, help="0.5B-shaped part: rows per forward/backward")
    ap.add_argument("--steps", type=int, default=3, help="0.5B-shaped part: timed steps after a warm-up")
    ap.add_argument("--activation-checkpointing", action="store_true")
    ap.add_argument("--bundled-steps", type=int, default=3)
    ap.add_argument("--bundled-deadline", type=float, default=45.0, help="seconds the bundled trainer may take")
    ap.add_argument("--decode-requests", type=int, default=32, help="decode part: requests at once")
    ap.add_argument("--decode-tokens", type=int, default=256, help="decode part: tokens each request samples")
    ap.add_argument("--long-tokens", type=int, default=8192, help="logprobs part: tokens of the one long row")
    ap.add_argument("--train-steps", type=int, default=5, help="train part: steps of agentenv train")
    ap.add_argument("--train-timeout", type=float, default=240.0, help="train part: seconds it may take")
    ap.add_argument("--sandbox-unisolated", action="store_true",
                    help="bundled part: the local sandbox runs with the isolation the host has (a container)")
    ap.add_argument("--skip", choices=PARTS, action="append", default=[])
    ap.add_argument("--json", type=Path, help="also write the figures to this file")
    args = ap.parse_args()

    import torch

    from agentenv.devices import resolve_device

    device = resolve_device(args.device)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    say(f"device {device} ({name}), torch {torch.__version__}")
    results: dict = {"device": name}
    if "qwen" not in args.skip:
        try:
            results["qwen2-0.5b-shaped"] = qwen_shaped(args, device)
        except Exception as exc:  # noqa: BLE001 - reported; the bundled part still runs
            say(f"qwen2-0.5b-shaped: failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}")
            results["qwen2-0.5b-shaped"] = {"error": f"{type(exc).__name__}: {exc}"}
    for part, run in (("decode", decode), ("logprobs", logprobs_peak), ("packing", packing)):
        if part not in args.skip:
            try:
                results[part] = run(args, device)
            except Exception as exc:  # noqa: BLE001 - reported; the other parts still run
                say(f"{part}: failed: {type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-6)}")
                results[part] = {"error": f"{type(exc).__name__}: {exc}"}
    if "bundled" not in args.skip:
        results["bundled"] = []
        engines = ["embedded"]
        try:
            import vllm  # noqa: F401

            if args.quick:
                say("bundled: --quick runs the embedded engine only (vLLM is installed)")
            else:
                engines.append("vllm")
        except ImportError:
            say("bundled: vLLM is not installed here; the embedded engine only")
        for engine in engines:
            try:
                results["bundled"].append(bundled(args, device, engine))
            except Exception as exc:  # noqa: BLE001 - a part that cannot run here is reported, the rest goes on
                say(f"bundled: the trainer with the {engine} engine failed: {type(exc).__name__}: {exc}\n"
                    f"{traceback.format_exc(limit=-6)}")
                results["bundled"].append({"engine": engine, "error": f"{type(exc).__name__}: {exc}"})
                if engine == "embedded":
                    try:
                        results["bundled"].append(bundled_direct(args, device))
                    except Exception as exc2:  # noqa: BLE001 - reported; the figures so far still print
                        say(f"bundled: the direct loop failed too: {type(exc2).__name__}: {exc2}")
                        results["bundled"].append({"engine": engine, "direct_error": f"{type(exc2).__name__}: {exc2}"})
    if "train" not in args.skip:
        try:
            results["train"] = train_cli(args, device)
        except Exception as exc:  # noqa: BLE001 - reported with the figures so far
            say(f"train: failed: {type(exc).__name__}: {exc}")
            results["train"] = {"error": f"{type(exc).__name__}: {exc}"}
    results["train_tok_per_s"] = results.get("qwen2-0.5b-shaped", {}).get("train_tok_per_s")
    line = json.dumps(results)
    if args.json:
        args.json.write_text(line + "\n")
    if not args.quick:  # a smoke test's figures are not the bench's
        import _report  # bench/_report.py

        _report.write("gpu", results, headline="train_tok_per_s", args=args)
    say(f"gpu_results: {line}")


if __name__ == "__main__":
    main()
