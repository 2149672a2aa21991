"""A judge-scored rollout (retool-math, the bundled model, embedded engine): what grading every
answer with a model costs, and what a judge that hangs or answers garbage does to the run.

    python bench/judge.py [--tasks 16 --group-size 4 --deadline 30 --bad-deadline 2]

Four runs of ``--tasks x --group-size`` programs, as ``agentenv rollout`` does them (the
library's ``RolloutJob``; each run loads its engine again):

* ``none``: no judge (the baseline wall time);
* ``policy``: ``--judge policy``, the run's own engine grading each answer as its program ends,
  beside the programs still decoding, under ``--deadline``;
* ``hang``: a loopback HTTP server that reads each request and never answers (``--bad-deadline``);
* ``garbage``: a loopback HTTP server answering every chat completion with nonsense.

Prints per run the wall time, the trajectories written, the judge's calls, failures by kind,
latency per call (p50 / p99) and its share of the run's wall time (the time with a judge call
in flight). Last ``judge_share_pct: <the policy run's share>``.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import anyio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from agentenv.config import JudgeOptions, OutputOptions, RolloutConfig, RolloutRunConfig, RunOptions  # noqa: E402
from agentenv.registry import make  # noqa: E402
from agentenv.rollout_run import RolloutJob, execute  # noqa: E402

from _report import write  # noqa: E402


class BadServer:
    """A real HTTP server on loopback: ``hang`` reads each request and never answers;
    ``garbage`` answers in the OpenAI wire format with nonsense."""

    def __init__(self, mode: str) -> None:
        self.mode, self.url, self.requests = mode, "", 0

    async def serve(self, *, task_status=anyio.TASK_STATUS_IGNORED) -> None:
        listener = await anyio.create_tcp_listener(local_host="127.0.0.1")
        self.url = f"http://127.0.0.1:{listener.extra(anyio.abc.SocketAttribute.local_port)}/v1"
        task_status.started()
        await listener.serve(self._handle)

    async def _handle(self, stream) -> None:
        async with stream:
            buf = b""
            try:
                while True:
                    while b"\r\n\r\n" not in buf:
                        buf += await stream.receive()
                    head, _, buf = buf.partition(b"\r\n\r\n")
                    lines = head.decode().split("\r\n")
                    size = next((int(h.split(":")[1]) for h in lines if h.lower().startswith("content-length")), 0)
                    while len(buf) < size:
                        buf += await stream.receive()
                    buf, self.requests = buf[size:], self.requests + 1
                    if self.mode == "hang":
                        await anyio.sleep_forever()
                    await stream.send(self._answer(lines[0].split()[1]))
            except (anyio.EndOfStream, anyio.BrokenResourceError):
                pass

    @staticmethod
    def _answer(path: str) -> bytes:
        body = ({"object": "list", "data": [{"id": "nonsense", "object": "model"}]} if path.endswith("/models") else
                {"object": "chat.completion", "choices": [{"index": 0, "finish_reason": "stop", "message": {
                    "role": "assistant", "content": "Purple ∞ lorem <scor>banana</score> 12 of 7"}}]})
        data = json.dumps(body).encode()
        return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(data), data)


async def one_run(args: argparse.Namespace, name: str, judge: JudgeOptions, out: Path) -> dict:
    opts = RolloutRunConfig(run=RunOptions(tasks=args.tasks, group_size=args.group_size, seed=args.seed),
                            output=OutputOptions(out=out, progress=False),
                            rollout=RolloutConfig(max_new_tokens=args.max_new_tokens, concurrency=args.concurrency),
                            judge=judge)
    t0 = time.perf_counter()
    result = await execute(RolloutJob.open(opts, make("retool-math"), t_start=t0))
    s = result.summary
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    fig = {"wall_s": s["wall_s"], "with_startup_s": round(time.perf_counter() - t0, 2), "written": result.written,
           "complete": result.code == 0 and result.written == args.tasks * args.group_size,
           "mean_reward": s["mean_reward"]}
    if judge.judge:
        fig.update({k.removeprefix("judge_"): s.get(k) for k in (
            "judge_calls", "judge_cached", "judge_failures", "judge_p50_ms", "judge_p99_ms", "judge_max_in_flight",
            "judge_share_pct")})
        fig["lines_with_a_verdict"] = sum("judge" in r.get("reward_details", {}) for r in rows)
    print(f"{name:8s} {fig['written']} written in {fig['wall_s']}s" + (
        f"; judge: {fig['calls']} calls, failures {fig['failures'] or 'none'}, p50 {fig['p50_ms']} ms, "
        f"p99 {fig['p99_ms']} ms, {fig['share_pct']}% of the wall time" if judge.judge else ""), flush=True)
    return fig


async def main(args: argparse.Namespace) -> dict:
    hang, garbage = BadServer("hang"), BadServer("garbage")
    figures: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        async with anyio.create_task_group() as tg:
            await tg.start(hang.serve)
            await tg.start(garbage.serve)
            runs = {"none": JudgeOptions(),
                    "policy": JudgeOptions(judge="policy", judge_deadline=args.deadline,
                                           judge_concurrency=args.judge_concurrency),
                    "hang": JudgeOptions(judge=hang.url, judge_deadline=args.bad_deadline,
                                         judge_concurrency=args.judge_concurrency),
                    "garbage": JudgeOptions(judge=garbage.url, judge_deadline=args.bad_deadline,
                                            judge_concurrency=args.judge_concurrency)}
            for name, judge in runs.items():
                figures[name] = await one_run(args, name, judge, Path(tmp) / f"{name}.jsonl")
            tg.cancel_scope.cancel()
    figures["judge_share_pct"] = figures["policy"]["share_pct"]
    print(f"judge_share_pct: {figures['judge_share_pct']}")
    return figures


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tasks", type=int, default=16)
    p.add_argument("--group-size", type=int, default=4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--deadline", type=float, default=30.0, help="seconds per judge call of the policy judge")
    p.add_argument("--bad-deadline", type=float, default=2.0, help="seconds per call of the hanging/garbage judges")
    p.add_argument("--judge-concurrency", type=int, default=16)
    a = p.parse_args()
    figs = anyio.run(main, a)
    write("judge", figs, headline="judge_share_pct", args=a)
