"""The bundled Hermes model (``agentenv/models/tiny-hermes``, built by
``agentenv.recipes.tiny_hermes``) through the Hermes path: its recipe is what was shipped, the
token bridge is exact under its chat template, ``--model tiny-hermes`` finds it, retool-math
speaks its format, a call written inside ``<think>`` is not run, and its rollouts make calls
that run, with every array aligned."""

from __future__ import annotations

import json
import random

import anyio
import pytest
from transformers import AutoConfig

from agentenv import Reactor, RolloutConfig, Trajectory, check_tokenizer, make
from agentenv.cli import _bundled, main
from agentenv.engines.base import SamplingParams
from agentenv.engines.embedded import load_tokenizer
from agentenv.engines.instant import InstantEngine
from agentenv.envs.retool_math import HERMES_PROMPT, SYSTEM_PROMPT, RetoolMathEnv
from agentenv.errors import ConfigError
from agentenv.formats import HermesFormat, ToolRequest
from agentenv.models import BUNDLED, default_model, model_dir
from agentenv.recipes import tiny, tiny_hermes
from agentenv.models.tokenizer import HERMES_CHAT_TEMPLATE
from agentenv.sandboxes.local import LocalSandbox

HERMES = BUNDLED["tiny-hermes"]
CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(6 * 7)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(HERMES)


def test_the_bundled_model_is_the_recipes(tok):
    recorded = json.loads((HERMES / "training.json").read_text())
    model = tiny.build_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    assert sum(p.numel() for p in model.parameters()) == recorded["params"] and recorded["format"] == "hermes"
    bundled = AutoConfig.from_pretrained(str(HERMES))
    for key in ("vocab_size", "hidden_size", "num_hidden_layers", "head_dim", "eos_token_id", "pad_token_id"):
        assert getattr(model.config, key) == getattr(bundled, key), key
    assert tok.chat_template == HERMES_CHAT_TEMPLATE
    assert sum(f.stat().st_size for f in HERMES.iterdir()) < 10 * 2**20  # a few MB, like tiny-retool


def test_a_warm_start_keeps_the_base_layers_and_each_shared_tokens_embedding(tok):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(str(default_model()))
    base_tok = load_tokenizer(default_model())
    model = tiny.build_model(len(tok), tok.eos_token_id, tok.pad_token_id)
    tiny_hermes.warm_start(model, tok, default_model())
    ours, theirs = model.state_dict(), base.state_dict()
    layers = [k for k in theirs if "embed_tokens" not in k and "lm_head" not in k]
    assert layers and all(ours[k].equal(theirs[k]) for k in layers)
    rows, base_rows = model.get_input_embeddings().weight, base.get_input_embeddings().weight
    for text in ["7", "<tool_call>", "</think>", "<|im_end|>"]:
        assert rows[tok.convert_tokens_to_ids(text)].equal(base_rows[base_tok.convert_tokens_to_ids(text)]), text
    new = next(t for t in tok.get_vocab() if t not in base_tok.get_vocab())  # spelled by several base tokens
    spelled = base_tok.encode(tok.convert_tokens_to_string([new]), add_special_tokens=False)
    assert len(spelled) > 1 and rows[tok.convert_tokens_to_ids(new)].allclose(base_rows[spelled].mean(0))
    assert model.get_output_embeddings().weight is rows  # the head is tied: it follows


def test_the_token_bridge_is_exact_under_its_chat_template(tok):
    report = check_tokenizer(tok, HermesFormat())
    assert report.exact, str(report)
    assert all(report.checks.values()) and len(report.checks) >= 6, report.checks
    # Its template renders history as written: re-rendered conversations keep their think blocks.
    assert not any("rewrites earlier turns" in n for n in report.notes), report.notes
    assert len(tok.encode("<think>", add_special_tokens=False)) == 1  # so the bridge played reasoning blocks


def test_a_transcript_is_laid_out_as_the_chat_template_renders_the_conversation(tok):
    think, final = "<think>\nI compute.\n</think>\n\n", "<think>\nDone.\n</think>\n\nThe answer is \\boxed{42}."
    msgs = [{"role": "system", "content": HERMES_PROMPT}, {"role": "user", "content": "6 * 7?"}]
    tr = {"messages": msgs, "pieces": [("model", think + CALL), ("tool", "42"), ("model", final)]}
    ids, mask = tiny_hermes.lay_out(tok, tr)
    rendered = tok.apply_chat_template(msgs + [{"role": "assistant", "content": think + CALL},
                                               {"role": "tool", "content": "42"},
                                               {"role": "assistant", "content": final}], tokenize=False)
    assert tok.decode(ids) + "\n" == rendered  # the template ends the last turn with a newline after EOS
    sampled = tok.decode([i for i, m in zip(ids, mask) if m])
    assert sampled == think + CALL + final + tok.eos_token
    spliced = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert spliced.endswith("<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n"
                            "<|im_start|>assistant\n")


QUESTION = "What is 6 * 7?"
TOOLS_BLOCK = (
    "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
    "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tool}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within <tool_call></tool_call> "
    'XML tags:\n<tool_call>\n{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call><|im_end|>\n'
)


def test_the_environments_own_prompt_renders_as_it_always_has(tok):
    """No ``tools``: the system and user turns as written, byte for byte (what it was trained on)."""
    env = RetoolMathEnv(format="hermes")
    msgs = env.prompt(env.tasks(1)[0])
    assert tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == (
        f"<|im_start|>system\n{HERMES_PROMPT}<|im_end|>\n<|im_start|>user\n{msgs[1]['content']}<|im_end|>\n"
        "<|im_start|>assistant\n")


def test_the_chat_template_renders_an_openai_conversation_as_qwen_does(tok):
    """``tools`` as Qwen2.5's system block (after the agent's own system text), assistant
    ``tool_calls`` as ``<tool_call>`` JSON (arguments as the JSON string OpenAI sends, or an
    object), ``role: tool`` messages as ``<tool_response>`` blocks sharing one user turn; the
    rendering of each request is a prefix of the next one's, so a multi-turn conversation
    round-trips."""
    tool = tiny_hermes.PYTHON_TOOLS[0]
    first = [{"role": "user", "content": QUESTION}]
    assert tok.apply_chat_template(first, tools=[tool], tokenize=False, add_generation_prompt=True) == (
        "<|im_start|>system\n" + TOOLS_BLOCK.format(tool=json.dumps(tool)) +
        f"<|im_start|>user\n{QUESTION}<|im_end|>\n<|im_start|>assistant\n")
    with_system = [{"role": "system", "content": "Be brief."}] + first
    assert tok.apply_chat_template(with_system, tools=[tool], tokenize=False).startswith(
        "<|im_start|>system\nBe brief.\n\n# Tools\n")
    calls = [{"id": "a", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(6 * 7)"}'}},
             {"id": "b", "type": "function", "function": {"name": "python", "arguments": {"code": "print(1)"}}}]
    second = first + [{"role": "assistant", "content": None, "tool_calls": calls},
                      {"role": "tool", "tool_call_id": "a", "content": "42"},
                      {"role": "tool", "tool_call_id": "b", "content": "1"}]
    third = second + [{"role": "assistant", "content": "The answer is \\boxed{42}."}]
    renders = [tok.apply_chat_template(m, tools=[tool], tokenize=False, add_generation_prompt=g)
               for m, g in [(first, True), (second, True), (third, False)]]
    assert renders[0] in renders[1] and renders[1][:-len("<|im_start|>assistant\n")] in renders[2]
    assert renders[1].endswith(
        "<|im_start|>assistant\n" + CALL +
        '\n<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call><|im_end|>\n'
        "<|im_start|>user\n<tool_response>\n42\n</tool_response>\n<tool_response>\n1\n</tool_response><|im_end|>\n"
        "<|im_start|>assistant\n")
    assert renders[2].endswith("<|im_start|>assistant\nThe answer is \\boxed{42}.<|im_end|>\n")
    reasoning = [{"role": "assistant", "content": "", "reasoning_content": "I compute.", "tool_calls": calls[:1]}]
    assert tok.apply_chat_template(first + reasoning, tools=[tool], tokenize=False).endswith(
        "<|im_start|>assistant\n<think>\nI compute.\n</think>\n\n" + CALL + "<|im_end|>\n")
    assert HermesFormat().parse(renders[2].split("<|im_start|>assistant\n")[1], ["python"])[0] == \
        ToolRequest("python", {"code": "print(6 * 7)"})


def test_an_openai_transcript_is_laid_out_as_the_template_renders_it(tok):
    """The training script's OpenAI form: the ``tools`` prompt, each call turn learned through
    its ``<|im_end|>`` (where an OpenAI server stops), the tool output spliced unlearned; with a
    re-rendered history, only the last turn is learned."""
    think, final = "<think>\nI compute.\n</think>\n\n", "<think>\nDone.\n</think>\n\nThe answer is \\boxed{42}."
    tr = {"messages": [{"role": "system", "content": HERMES_PROMPT}, {"role": "user", "content": QUESTION}],
          "calls": [(think, "print(6 * 7)", "42")], "final": final}
    for rerender in (False, True):
        form = tiny_hermes.openai_form(tr, random.Random(0), rerender)
        assert form["messages"][-1 - 2 * rerender] == {"role": "user", "content": QUESTION}
        ids, mask = tiny_hermes.lay_out(tok, form)
        history = [{"role": "assistant", "content": think + CALL}, {"role": "tool", "content": "42"}]
        if rerender:
            assert form["messages"][-2]["tool_calls"][0]["function"] == {
                "name": "python", "arguments": '{"code": "print(6 * 7)"}'}
            history = []
        rendered = tok.apply_chat_template(form["messages"] + history + [{"role": "assistant", "content": final}],
                                           tools=form["tools"], tokenize=False)
        assert tok.decode(ids) + "\n" == rendered and "# Tools" in rendered
        learned = tok.decode([i for i, m in zip(ids, mask) if m])
        assert learned == ("" if rerender else think + CALL + tok.eos_token) + final + tok.eos_token


def test_the_cli_finds_it_by_name(capsys):
    assert main(["check-tokenizer", "--model", "tiny-hermes", "--format", "hermes"]) == 0
    out = capsys.readouterr().out
    assert f"{HERMES} with the 'hermes' format: the token bridge is EXACT" in out, out


def test_bundled_models_are_found_by_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert model_dir(None) == default_model() == BUNDLED["tiny-retool"]
    assert model_dir("tiny-hermes") == HERMES and _bundled("tiny-hermes") == str(HERMES)
    assert model_dir("elsewhere/m") == tmp_path.joinpath("elsewhere/m").relative_to(tmp_path)
    (tmp_path / "tiny-hermes").mkdir()  # a directory of that name here is what the user means
    assert model_dir("tiny-hermes").resolve() == tmp_path / "tiny-hermes"


def test_retool_math_speaks_the_format_it_is_given():
    assert RetoolMathEnv().tool_format is None and RetoolMathEnv().system_prompt == SYSTEM_PROMPT  # the model's
    env = make("retool-math", format="hermes")
    assert isinstance(env.tool_format, HermesFormat) and not env.tool_format.calls_in_think
    assert env.prompt(env.tasks(1)[0])[0] == {"role": "system", "content": HERMES_PROMPT}
    assert make("retool-math", format="hermes", calls_in_think=True).tool_format.calls_in_think
    with pytest.raises(ConfigError, match="format must be one of retool, hermes"):
        make("retool-math", format="xml")


def _rollout(engine, env, n_tasks: int, group_size: int, **cfg):
    async def go():
        config = RolloutConfig(**{"max_turns": 4, "max_new_tokens": 256, "concurrency": 8, **cfg})
        async with LocalSandbox() as sb:
            groups = await Reactor(engine, env, sb, config).collect(env.tasks(n_tasks, seed=3), group_size)
        return [t for g in groups for t in g.trajectories]

    return anyio.run(go)


@pytest.mark.parametrize("calls_in_think", [False, True])
def test_a_call_inside_think_is_not_run_unless_allowed(tok, calls_in_think):
    """The engine returns a turn that writes a call before closing its ``<think>`` (and stops
    at ``</tool_call>``, as a real engine does): the program ends with nothing run, or, with
    ``calls_in_think=True``, runs it in a real sandbox."""
    reply = tok.encode("<think>\nI run it now: " + CALL, add_special_tokens=False)
    engine = InstantEngine(tok, reply=reply, turn_tokens=len(reply))
    env = RetoolMathEnv(format="hermes", calls_in_think=calls_in_think)
    trajs = _rollout(engine, env, n_tasks=2, group_size=2, max_turns=2)
    assert len(trajs) == 4
    for t in trajs:
        t.validate()
        assert tok.decode(t.segments[0].token_ids) == tok.decode(reply)
        if calls_in_think:
            assert [(c.name, c.arguments, c.status, c.output) for c in t.tool_calls][:1] == [
                ("python", {"code": "print(6 * 7)"}, "ok", "42")]
            assert t.finish_reason == "max_turns"
        else:
            assert t.tool_calls == [] and t.finish_reason == "stop" and len(t.turns) == 1
            assert t.segments[-1].kind == "model" and t.reward == 0.0


@pytest.fixture(scope="module")
def hermes_engine():
    from agentenv.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(HERMES, seed=0)
    yield eng
    eng.close()


def test_rollouts_make_calls_that_run_and_keep_every_array_aligned(hermes_engine):
    tok, env = hermes_engine.tokenizer, RetoolMathEnv(extra_digits=0, format="hermes")
    trajs = _rollout(hermes_engine, env, n_tasks=4, group_size=2)
    ran = [t for t in trajs if any(c.status == "ok" for c in t.tool_calls)]
    assert len(ran) >= len(trajs) / 2, [t.text for t in trajs]
    prompt = tok.apply_chat_template(env.prompt(env.tasks(1, seed=3)[0]), tokenize=False, add_generation_prompt=True)
    for t in trajs:
        t.validate()
        mask, ids = t.loss_mask, t.input_ids
        assert [x for x, m in zip(ids, mask) if m] == [i for s in t.segments if s.kind == "model" for i in s.token_ids]
        assert len(t.logprobs) == len(ids) and all(
            lp <= 0 for s in t.segments if s.kind == "model" for lp in s.logprobs
        )
        assert tok.decode(t.prompt_ids).startswith(prompt[:40])
        assert tok.decode(ids) == tok.decode(t.prompt_ids) + t.text
    for t in ran:
        env_segs = [s for s in t.segments if s.kind == "env"]
        for seg, call in zip(env_segs, t.tool_calls):  # each output spliced as the template's tool turn
            assert tok.decode(seg.token_ids) == HermesFormat().observation([call.output], tok, False)
        call = next(c for c in t.tool_calls if c.status == "ok")
        assert HermesFormat().parse(CALL, ["python"]) == [ToolRequest("python", {"code": "print(6 * 7)"})]
        assert call.name == "python" and "code" in call.arguments
        assert "<think>" in t.text and "</think>" in t.text


async def openai_loop(engine, tasks) -> list[dict]:
    """Each task asked as a plain OpenAI SDK agent asks it: the question with ``tools=[python]``
    (rendered by the chat template, as a gateway or ``vllm serve --tool-call-parser hermes``
    renders it), sampled to EOS; a call is run in a real sandbox and its output sent back as a
    ``role: tool`` message after the assistant's ``tool_calls``, and the model answers. Returns,
    per task, the calls (ToolRequest or MalformedCall) and the last reply."""
    tok, fmt, tool = engine.tokenizer, HermesFormat(), tiny_hermes.PYTHON_TOOLS[0]
    params = SamplingParams(max_tokens=256, temperature=1.0, stop_token_ids=(tok.eos_token_id,))

    async def ask(msgs, rid):
        ids = tok.apply_chat_template(msgs, tools=[tool], add_generation_prompt=True, tokenize=False)
        gen = await engine.generate(tok.encode(ids, add_special_tokens=False), params, rid)
        return tok.decode([i for i in gen.token_ids if i != tok.eos_token_id])

    async def one(i, task, out):
        msgs = [{"role": "user", "content": task.question}]
        text = await ask(msgs, f"{i}-1")
        calls = fmt.parse(text, ["python"])
        out[i] = {"calls": calls, "reply": text}
        if calls and isinstance(calls[0], ToolRequest):
            session = await sandbox.session()
            result = (await session.run(calls[0].arguments["code"])).render()
            await session.aclose()
            call = {"id": "c", "type": "function",
                    "function": {"name": "python", "arguments": json.dumps(calls[0].arguments)}}
            msgs += [{"role": "assistant", "content": text[:text.find("<tool_call>")], "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": "c", "content": result}]
            out[i]["reply"] = await ask(msgs, f"{i}-2")

    out: list = [None] * len(tasks)
    with anyio.fail_after(300):
        async with LocalSandbox() as sandbox, anyio.create_task_group() as tg:
            for i, task in enumerate(tasks):
                tg.start_soon(one, i, task, out)
    return out


def test_openai_requests_with_tools_make_calls_and_answer(hermes_engine):
    """Its training mixes in the OpenAI ``tools`` rendering: asked that way (no environment
    prompt), most samples write a well-formed python call, and after the tool's reply most of
    those answer in ``\\boxed{}``. Rates seen over 8 seeds of 16 tasks: 87.5 % call, 83 % of
    those answer (the lowest seed 12 of 16 and 8 of 12). 32 tasks keep the bounds more than 4
    standard deviations below them, whatever the batching samples."""
    tasks = RetoolMathEnv(extra_digits=1).tasks(32, seed=5)
    results = anyio.run(openai_loop, hermes_engine, tasks)
    called = [r for r in results if r["calls"] and isinstance(r["calls"][0], ToolRequest)]
    assert len(called) >= 0.6 * len(tasks), [r["reply"] for r in results]
    answered = [r for r in called if "\\boxed{" in r["reply"] and "<tool_call>" not in r["reply"]]
    assert len(answered) >= 0.5 * len(called), [r["reply"] for r in called]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_the_script_writes_a_model_directory_with_an_exact_bridge(tmp_path):
    info = tiny_hermes.train(tmp_path / "m", n_tasks=4, steps=2, batch=2, lr=1e-3, seed=0, drills=2,
                             base=default_model())
    assert (info["format"], info["base"], info["steps"]) == ("hermes", "tiny-retool", 2)
    assert json.loads((tmp_path / "m" / "training.json").read_text()) == info
    assert check_tokenizer(load_tokenizer(tmp_path / "m"), "hermes").exact
    # Going on training the bundled Hermes model: its tokenizer kept, OpenAI-form transcripts
    # mixed in, its own recipe recorded beneath.
    info = tiny_hermes.train(tmp_path / "n", n_tasks=4, steps=2, batch=2, lr=1e-3, seed=0, drills=2, base=HERMES,
                             tools_share=1.0, keep_tokenizer=True)
    assert info["base_training"] == json.loads((HERMES / "training.json").read_text()) and info["tools_share"] == 1.0
    assert load_tokenizer(tmp_path / "n").get_vocab() == load_tokenizer(HERMES).get_vocab()
    with pytest.raises(ConfigError, match="not a tiny Hermes model"):
        tiny_hermes.train(tmp_path / "o", n_tasks=1, steps=1, batch=1, lr=1e-3, seed=0, base=default_model(),
                          keep_tokenizer=True)


def read(path) -> list[Trajectory]:
    """A rollout file's trajectories, each checked (segments, flat arrays, input_ids)."""
    return [Trajectory.from_dict(json.loads(line)) for line in path.read_text().splitlines()]


def calls_ran(trajs: list[Trajectory]) -> float:
    """The share of programs with a well-formed tool call that ran ok."""
    return sum(any(c.status == "ok" for c in t.tool_calls) for t in trajs) / len(trajs)


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_agentenv_rollout_and_eval_run_the_hermes_path(tmp_path, capsys):
    out, report = tmp_path / "r.jsonl", tmp_path / "report.json"
    hermes = ["--model", "tiny-hermes", "--env-arg", "format=hermes", "--no-progress"]
    assert main(["rollout", *hermes, "--tasks", "16", "--group-size", "4", "--out", str(out)]) == 0
    trajs = read(out)
    # Sampled at temperature 1 with timing-dependent batching, so not the same from run to run:
    # 0.48-0.56 of programs ran a call in the runs seen; a broken Hermes path runs none.
    assert len(trajs) == 64 and calls_ran(trajs) >= 0.3, calls_ran(trajs)
    assert all("<tool_call>" in t.text for t in trajs if t.tool_calls)
    assert any(t.reward == 1.0 for t in trajs)
    capsys.readouterr()
    assert main(["eval", *hermes, "--env-arg", "extra_digits=0", "--tasks", "8", "--k", "2", "--out",
                 str(tmp_path / "e.jsonl"), "--report", str(report)]) == 0
    rep = json.loads(report.read_text())
    assert rep["model"] == str(HERMES.resolve()) and rep["env_args"] == {"format": "hermes", "extra_digits": 0}
    assert calls_ran(read(tmp_path / "e.jsonl")) >= 0.3 and rep["components"]["tool_ran"] >= 0.3, rep
    assert rep["pass@k"]["1"] > 0, rep


@pytest.mark.slow
@pytest.mark.timeout(1200)
def test_agentenv_train_runs_the_hermes_path(tmp_path, capsys):
    """``agentenv train`` on tiny-hermes: its rollouts and its held-out evaluations parse with
    the environment's Hermes format (the evaluations' calls run), every step trains on scored
    groups. (Held-out pass@1 rises at ``extra_digits=2``, temperature 1.0, lr 1e-4 in 60 steps,
    about 8 minutes on the shared machine: docs/models.md has every run; too long to assert here.)"""
    run = tmp_path / "run"
    args = ["train", "--model", "tiny-hermes", "--env-arg", "format=hermes", "--temperature", "1.3", "--steps", "4",
            "--eval-every", "4", "--eval-tasks", "16", "--eval-k", "2", "--out-dir", str(run), "--no-progress",
            "--report-to", "none"]
    assert main(args) == 0, capsys.readouterr().err
    config = json.loads((run / "config.json").read_text())
    assert config["env"]["env_kwargs"] == {"extra_digits": 1, "format": "hermes"}
    assert config["engine"]["model"] == str(HERMES)
    evals = [json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 4]
    assert all(e["mean_tool_ran"] >= 0.5 and e["pass@1"] > 0 for e in evals), evals
    rows = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and all(r["reward_failures"] == 0 for r in rows)
    assert any(r["reward_mean"] > 0 for r in rows) and all(r["trained_tokens"] > 0 for r in rows)
