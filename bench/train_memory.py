"""Peak memory of the trainer's per-token logprobs, whole logits against chunks, on a model
shaped like Qwen2-0.5B (randomly initialised: nothing is downloaded).

    python bench/train_memory.py [--tokens 2048 4096 8192] [--chunk 512] [--step-tokens 2048]

The model: transformers' ``Qwen2Config`` with Qwen2-0.5B's shape (hidden 896, 24 layers, 14
heads, 2 KV heads, intermediate 4864, vocabulary 151,936, tied embeddings; 494M parameters).
Each case runs in a fresh process and reports the growth of its peak resident memory
(``ru_maxrss``, reset to the memory held just before the measured part: ``_reset_peak``) over
that part (on CUDA, ``torch.cuda.max_memory_allocated`` over the same part):

* ``logprob``: one row's last hidden states [1, T, 896] -> per-token logprobs -> backward,
  through the model's head (the 151,936 x 896 tied embedding). ``before`` is the whole-logits
  computation ``Policy.token_logprobs`` ran before chunking (float32 logits, a log-softmax over
  the vocabulary, a gather); ``after`` is ``agentenv.train.logprobs.head_logprobs`` with
  ``--chunk`` positions per chunk. Their values and gradients are compared in the same process
  pair (the maximum differences are printed).
* ``step``: one whole ``Policy.train_step`` (full fine-tuning, AdamW, activation checkpointing)
  on one row of T tokens, ``--logprob-chunk 0`` against ``--chunk``: forward, backward, the
  optimiser's state and step.

A case runs only when the memory available (``MemAvailable``) exceeds its estimate by
``--headroom`` GiB; one skipped is printed as skipped. glibc's malloc is told to return every
freed block of 1 MiB or more to the system at once (``MALLOC_MMAP_THRESHOLD_``): left to raise
that threshold itself it keeps freed blocks of up to 32 MiB in its heap, and the peak would
count its fragmentation rather than the tensors alive.

Prints a table, then ``logprob_peak_reduction: X`` (the 8k-token row, before / after) and, when
``bench/train_packing.py`` is there, ``packing_speedup: X`` last.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import _report  # bench/_report.py: the figures as JSON

QWEN2_05B = dict(hidden_size=896, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                 intermediate_size=4864, vocab_size=151936, tie_word_embeddings=True, max_position_embeddings=32768,
                 rope_theta=1_000_000.0, rms_norm_eps=1e-6)
GIB = 2**30


def _reset_peak(device: str) -> int:
    """Start a measured part: the peak is reset to what is held now, which this returns (bytes).

    On the CPU, writing 5 to ``/proc/self/clear_refs`` resets the process's peak RSS (Linux):
    what ran before (loading the weights, the behaviour logprobs) does not hide the part's own
    peak under an earlier high-water mark. Where that is refused, the peak so far stands."""
    import torch

    if device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(device)
        return torch.cuda.memory_allocated(device)
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pass
    return _peak_now(device)


def _peak_now(device: str) -> int:
    """Bytes: the process's peak RSS, or the CUDA allocator's peak."""
    import torch

    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device)
    try:  # the mm's high-water mark, which clear_refs resets (ru_maxrss also keeps exited threads' marks)
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _before_logprobs(head, hidden, ids, temperature: float):
    """The whole-logits computation ``Policy.token_logprobs`` ran before chunking, after its
    backbone: float32 logits of every position, log-softmax over the vocabulary, gather."""
    import torch

    logits = head(hidden)[:, :-1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    picked = logp.gather(-1, ids[:, 1:, None]).squeeze(-1)
    return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)


def _logprob_case(path: str, tokens: int, chunk: int, device: str) -> dict:
    import torch

    from agentenv.train.logprobs import head_logprobs

    torch.manual_seed(0)
    head = torch.nn.Linear(QWEN2_05B["hidden_size"], QWEN2_05B["vocab_size"], bias=False, device=device)
    torch.nn.init.normal_(head.weight, std=0.02)
    hidden = torch.randn(1, tokens, QWEN2_05B["hidden_size"], device=device).requires_grad_()
    ids = torch.randint(0, QWEN2_05B["vocab_size"], (1, tokens), device=device)

    def run(h: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
        if path == "before":
            return _before_logprobs(head, h, i, 1.0)
        picked, _ = head_logprobs(head, h[:, :-1], i[:, 1:], chunk=chunk)
        return torch.cat([torch.zeros_like(picked[:, :1]), picked], dim=1)

    warm = torch.randn(1, 8, QWEN2_05B["hidden_size"], device=device, requires_grad=True)
    run(warm, ids[:, :8]).sum().backward()  # kernels loaded, threads started
    head.weight.grad = None
    start, t0 = _reset_peak(device), time.perf_counter()
    logp = run(hidden, ids)
    logp.sum().backward()
    peak, seconds = _peak_now(device) - start, time.perf_counter() - t0
    return {"peak_bytes": peak, "seconds": seconds, "logp_sum": float(logp.detach().sum()),
            "logp": logp.detach().cpu().tolist()[0][:64],
            "hidden_grad_sum": float(hidden.grad.double().abs().sum()),
            "head_grad_sum": float(head.weight.grad.double().abs().sum())}


def _step_case(path: str, tokens: int, chunk: int, device: str, model_dir: str) -> dict:
    import torch

    from agentenv.train.batch import Batch
    from agentenv.train.policy import Policy

    torch.manual_seed(0)
    policy = Policy(model_dir, lr=1e-6, device=device, precision="fp32", activation_checkpointing=True,
                    micro_batch_tokens=None, logprob_chunk=0 if path == "before" else chunk)
    ids = torch.randint(0, QWEN2_05B["vocab_size"], (1, tokens))
    attn, mask = torch.ones_like(ids), torch.ones(1, tokens)
    mask[:, : tokens // 4] = 0
    with torch.no_grad():
        mu = policy.token_logprobs(ids.to(policy.device), attn.to(policy.device)).cpu()
    batch = Batch(ids, attn, mask, mu, torch.zeros_like(ids), torch.tensor([1.0]), [1.0])
    start, t0 = _reset_peak(device), time.perf_counter()
    stats = policy.train_step(batch)
    peak, seconds = _peak_now(device) - start, time.perf_counter() - t0
    return {"peak_bytes": peak, "seconds": seconds, "loss": stats["loss"], "grad_norm": stats["grad_norm"],
            "entropy": stats["entropy"]}


def _estimate_gib(part: str, path: str, tokens: int, chunk: int) -> float:
    """A guess of a case's whole memory, a little above what this bench measured, to skip what
    the machine cannot hold: whole logits hold ~3 float32 copies of [T, V], chunks ~4 of
    [chunk, V]; a step adds the weights (2 GiB), their gradients and AdamW's two moments."""
    one_copy = tokens * QWEN2_05B["vocab_size"] * 4 / GIB
    logits = 3.3 * one_copy if path == "before" else 4.5 * min(chunk, tokens) * QWEN2_05B["vocab_size"] * 4 / GIB
    return logits + (1.5 if part == "logprob" else 9.0 + tokens / 1024)


def _available_gib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 2**20
    return float("inf")


def _run_case(part: str, path: str, tokens: int, a: argparse.Namespace, model_dir: str | None) -> dict | None:
    need, have = _estimate_gib(part, path, tokens, a.chunk), _available_gib()
    if need + a.headroom > have:
        print(f"  {part:7s} {path:6s} {tokens:5d}: skipped (needs ~{need:.1f} GiB, {have:.1f} GiB available)",
              flush=True)
        return None
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": str(1 << 20)}
    cmd = [sys.executable, __file__, "--case", part, path, str(tokens), "--chunk", str(a.chunk), "--device", a.device]
    if model_dir:
        cmd += ["--model-dir", model_dir]
    out = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if out.returncode != 0:
        print(f"  {part:7s} {path:6s} {tokens:5d}: failed ({out.returncode}): {out.stderr[-600:]}", flush=True)
        return None
    result = json.loads(out.stdout.strip().splitlines()[-1])
    print(f"  {part:7s} {path:6s} {tokens:5d}: peak +{result['peak_bytes'] / GIB:6.2f} GiB "
          f"in {result['seconds']:.1f} s", flush=True)
    return result


def _random_model_dir(root: str) -> str:
    """The 0.5B-shaped model, randomly initialised, saved where ``Policy`` can load it."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(**QWEN2_05B)).save_pretrained(root)
    return root


def _packing_speedup() -> float | None:
    """``bench/train_packing.py``'s figure, when that bench is there: its ``packing_speedup()``,
    else the ``packing_speedup: X`` line it prints."""
    path = Path(__file__).with_name("train_packing.py")
    if not path.exists():
        return None
    spec = importlib.util.spec_from_file_location("train_packing", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if callable(getattr(module, "packing_speedup", None)):
        return float(module.packing_speedup())
    out = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, check=True)
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("packing_speedup:")]
    return float(lines[-1].split(":", 1)[1]) if lines else None


def _agreement(before: dict | None, after: dict | None) -> str:
    if not before or not after:
        return "-"
    diff = max(abs(x - y) for x, y in zip(before["logp"], after["logp"]))
    rel = abs(before["head_grad_sum"] - after["head_grad_sum"]) / max(abs(before["head_grad_sum"]), 1e-30)
    return f"max |dlogp| {diff:.1e}, head grad rel {rel:.1e}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, nargs="*", default=[2048, 4096, 8192],
                    help="row lengths of the logprob part (none: skip it)")
    ap.add_argument("--step-tokens", type=int, nargs="*", default=[2048, 4096, 8192],
                    help="row lengths of the whole-step part (none: skip it)")
    ap.add_argument("--chunk", type=int, default=512, help="positions per chunk (--logprob-chunk)")
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--headroom", type=float, default=2.0, help="GiB left free beside a case's estimate")
    ap.add_argument("--no-packing", action="store_true", help="do not run bench/train_packing.py's figure")
    ap.add_argument("--case", nargs=3, help=argparse.SUPPRESS)
    ap.add_argument("--model-dir", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.case:  # one measured case, in this fresh process
        part, path, tokens = a.case[0], a.case[1], int(a.case[2])
        result = (_logprob_case(path, tokens, a.chunk, a.device) if part == "logprob"
                  else _step_case(path, tokens, a.chunk, a.device, a.model_dir))
        print(json.dumps(result))
        return
    print(f"Qwen2-0.5B-shaped model (random), chunk {a.chunk}, {a.device}; peak growth per case:", flush=True)
    results: dict[str, dict[int, dict[str, dict | None]]] = {"logprob": {}, "step": {}}
    for tokens in a.tokens:
        results["logprob"][tokens] = {p: _run_case("logprob", p, tokens, a, None) for p in ("after", "before")}
    if a.step_tokens:
        with tempfile.TemporaryDirectory() as d:
            model_dir = _random_model_dir(d)
            for tokens in a.step_tokens:
                results["step"][tokens] = {p: _run_case("step", p, tokens, a, model_dir) for p in ("after", "before")}
    _report_and_print(results, a)


def _report_and_print(results: dict, a: argparse.Namespace) -> None:
    figures: dict = {"chunk": a.chunk, "device": a.device}
    print(f"\n{'part':8s} {'tokens':>6s} {'before GiB':>11s} {'after GiB':>10s} {'reduction':>10s}  agreement")
    for part, rows in results.items():
        for tokens, cases in rows.items():
            b, f = cases["before"], cases["after"]
            gib = lambda r: f"{r['peak_bytes'] / GIB:.2f}" if r else "-"  # noqa: E731
            red = b["peak_bytes"] / f["peak_bytes"] if b and f else None
            agree = _agreement(b, f) if part == "logprob" else (
                f"loss {b['loss']:.6g} / {f['loss']:.6g}" if b and f else "-")
            print(f"{part:8s} {tokens:6d} {gib(b):>11s} {gib(f):>10s} {f'{red:.2f}x' if red else '-':>10s}  {agree}")
            figures[f"{part}_{tokens}"] = {"before_gib": b and b["peak_bytes"] / GIB, "before_s": b and b["seconds"],
                                           "after_gib": f and f["peak_bytes"] / GIB, "after_s": f and f["seconds"],
                                           "reduction": red}
    eight = results["logprob"].get(8192, {})
    reduction = (eight["before"]["peak_bytes"] / eight["after"]["peak_bytes"]
                 if eight.get("before") and eight.get("after") else None)
    figures["logprob_peak_reduction"] = reduction
    packing = None if a.no_packing else _packing_speedup()
    if packing is not None:
        figures["packing_speedup"] = packing
    _report.write("train_memory", figures, headline="logprob_peak_reduction", args=a)
    print(f"logprob_peak_reduction: {reduction:.2f}" if reduction else "logprob_peak_reduction: not measured")
    if packing is not None:
        print(f"packing_speedup: {packing:.2f}")


if __name__ == "__main__":
    main()
