"""The viewer's page in a real browser: headless Chromium (Debian's package) driven by
Playwright, over runs the CLI makes here (a 128-row rollout, an eval report, a short training
run). Each test looks at what the page shows and checks it against the files; screenshots go
to ``tests/.artifacts/view-shots/`` (ignored by git).

Without Chromium or Playwright these tests fail, so that CI does not pass them unseen; set
``AGENTENV_SKIP_BROWSER=1`` to skip them on a machine that cannot run a browser."""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from urllib.parse import quote

import pytest

from agentenv import journal
from agentenv.evaluation import read_jsonl, report
from agentenv.view.page import STATIC
from agentenv.view.runs import open_run
from agentenv.view.server import Viewer, ViewServer

CHROMIUM = "/usr/bin/chromium"
ARGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WAIT_MS = 60_000  # a bound on a hang: each wait ends when the page shows what it waits for


def test_the_page_fetches_nothing_from_elsewhere():
    """The machine may be offline: no CDN, no web fonts, no absolute URLs in the page."""
    files = {p.name: p.read_text() for p in STATIC.iterdir()}
    assert {"index.html", "app.js", "style.css"} <= set(files)
    for name, text in files.items():
        found = [u for u in re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\s\"')]*", text) if "www.w3.org/2000/svg" not in u]
        assert not found, f"{name} reaches out: {found}"
        assert "@import" not in text and "url(" not in text.replace('url("data:', "")
    assert re.findall(r'(?:src|href)="([^"]+)"', files["index.html"]) == [
        "/static/style.css", "/static/icon.svg", "#/", "/static/app.js"]


def _browser_or_fail():
    if os.environ.get("AGENTENV_SKIP_BROWSER") == "1":
        pytest.skip("AGENTENV_SKIP_BROWSER=1")
    if not Path(CHROMIUM).is_file():
        pytest.fail(f"{CHROMIUM} is missing: apt-get install -y chromium (or set AGENTENV_SKIP_BROWSER=1)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("playwright is missing: pip install -e '.[dev]' (or set AGENTENV_SKIP_BROWSER=1)")
    return sync_playwright


def _cli(*args: str, cwd: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "agentenv.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env={**os.environ, "COLUMNS": "120"})


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The runs the CLI makes: 32 tasks x 4 (128 rows), an eval of the same tasks at another
    temperature with the policy as judge (its report), and a 3-step training run with
    held-out evaluations."""
    _browser_or_fail()
    d = tmp_path_factory.mktemp("runs")
    procs = [
        _cli("rollout", "--tasks", "32", "--group-size", "4", "--out", "a.jsonl", "--no-progress", cwd=d),
        _cli("eval", "--tasks", "32", "--k", "2", "--temperature", "0.6", "--out", "b.jsonl", "--report", "b.json",
             "--judge", "policy", "--no-progress", cwd=d),
        _cli("train", "--steps", "3", "--groups-per-step", "2", "--group-size", "4", "--max-new-tokens", "96",
             "--eval-every", "2", "--eval-tasks", "4", "--eval-k", "2", "--out-dir", "train", "--no-progress", cwd=d),
    ]
    for p in procs:
        out = p.communicate(timeout=900)[0]
        assert p.returncode == 0, out[-3000:]
    return d


@pytest.fixture(scope="module")
def shots():
    """``tests/.artifacts/view-shots/`` (ignored by git): kept after the run, for a person to look at."""
    path = Path(__file__).resolve().parents[1] / ".artifacts" / "view-shots"
    path.mkdir(parents=True, exist_ok=True)
    print(f"screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    sync_playwright = _browser_or_fail()
    profile = tmp_path_factory.mktemp("chromium-profile")  # a fresh profile: nothing from another run
    with sync_playwright() as p:
        ctx = p.chromium.launch_persistent_context(str(profile), executable_path=CHROMIUM, args=ARGS, headless=True,
                                                   viewport={"width": 1300, "height": 900})
        try:
            yield ctx
        finally:
            ctx.close()


@pytest.fixture(scope="module")
def server(made):
    viewer = Viewer([open_run(made / "a.jsonl"), open_run(made / "b.json"), open_run(made / "train")])
    with ViewServer(viewer) as s:
        yield s


@pytest.fixture
def page(browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.set_default_timeout(WAIT_MS)
    yield page
    page.close()
    assert errors == [], errors  # no script error, no failed request


@contextlib.contextmanager
def served(page, viewer: Viewer):
    """A server of the test's own, which the page leaves before it stops. The page polls a
    run every second; a poll sent after the server stopped fails (a reset or refused
    connection, a console error that the page fixture fails on) when the page closes more
    than a poll later, as on a loaded machine."""
    with ViewServer(viewer) as server:
        try:
            yield server
        finally:
            page.goto("about:blank")


# The page's CSP forbids eval: a wait_for_function predicate is a function ("() => ..."),
# which Playwright runs without evaluating a string in the page.
def goto(page, server, route: str) -> None:
    page.goto(server.url + route)
    page.wait_for_selector(f'body[data-ready="{route}"]')


def js_fmt(v: float, digits: int = 3) -> str:
    """A number as the page's ``fmt`` writes it: integers bare, others to ``digits`` places."""
    return str(int(v)) if float(v).is_integer() else f"{v:.{digits}f}"


@pytest.mark.slow
def test_the_list_filters_and_sorts_128_trajectories(page, server, made, shots):
    rows = read_jsonl(made / "a.jsonl")
    assert len(rows) == 128
    goto(page, server, "#/run/0")
    count = page.locator("#count")
    assert count.inner_text().startswith("128 of 128 shown")
    page.screenshot(path=shots / "list.png")

    def shown(n: int) -> None:
        page.wait_for_function(f"() => document.querySelector('#count').textContent.startsWith('{n} of 128')")
        assert page.locator("tr.row").count() == n

    page.select_option("#f-finish", "stop")
    shown(sum(r["finish_reason"] == "stop" for r in rows))
    page.select_option("#f-finish", "")
    page.fill("#f-rmin", "1")
    shown(sum(r["reward"] is not None and r["reward"] >= 1 for r in rows))
    page.fill("#f-rmin", "")
    page.select_option("#f-toolerr", "with")
    with_errors = [r for r in rows if any(t["status"] != "ok" for t in r["tool_calls"])]
    shown(len(with_errors))
    page.screenshot(path=shots / "list-tool-errors.png")
    page.select_option("#f-toolerr", "")
    page.select_option("#f-resumed", "no")
    shown(sum(not r["metadata"].get("resumed") for r in rows))
    page.select_option("#f-resumed", "")
    page.fill("#f-task", "retool-math/0/3")
    shown(sum("retool-math/0/3" in r["task_id"] for r in rows))
    page.fill("#f-task", "")
    shown(128)
    page.click("th:has-text('sampled / tokens')")
    page.click("th:has-text('sampled / tokens')")  # descending
    first = page.locator("tr.row").first.get_attribute("data-id")
    assert first == max(rows, key=lambda r: (sum(r["loss_mask"]), -rows.index(r)))["id"]


@pytest.mark.slow
def test_a_trajectory_shows_its_tokens_by_loss_mask_tool_calls_and_reward(page, server, made, shots):
    rows = read_jsonl(made / "a.jsonl")
    row = next(r for r in rows if r["tool_calls"] and r["reward"])  # a solved one that used the tool
    goto(page, server, "#/run/0")
    page.click(f"tr.row[data-id='{row['id']}'] td:first-child")
    page.wait_for_selector("#tokens")
    text = page.evaluate(
        "[...document.querySelectorAll('#tokens .seg:not(.seg-prompt) .tok')].map(t => t.textContent).join('')"
    )
    assert text == row["text"]
    assert page.locator("#tokenizer-note").count() == 0  # the run's own tokenizer (its log names the model)
    assert page.locator("#tokens .tok.m1").count() == sum(row["loss_mask"])
    assert page.locator("#tokens .tok.m0").count() == len(row["loss_mask"]) - sum(row["loss_mask"])
    assert (
        page.locator("#tokens .seg-env .tok.m1").count() == 0
        and page.locator("#tokens .seg-model .tok.m0").count() == 0
    )
    calls = page.inner_text("#calls")
    for call in row["tool_calls"]:
        assert (
            call["arguments"]["code"].strip() in calls and call["output"].strip() in calls and call["status"] in calls
        )
    assert page.inner_text("#reward-value") == js_fmt(row["reward"])
    for name in row["reward_components"]:
        assert name in page.inner_text("#reward")

    i = row["loss_mask"].index(1, len(row["prompt_ids"]) + 2)  # a sampled token; hover shows its numbers
    page.hover(f"#tokens .tok[data-i='{i}']")
    tip = page.inner_text("#tip")
    assert f"logprob {row['logprobs'][i]:.4f}" in tip and f"weight version {row['weight_versions'][i]}" in tip
    assert f"p {math.exp(row['logprobs'][i]):.3f}" in tip
    page.screenshot(path=shots / "trajectory.png")
    plain = page.eval_on_selector(f".tok[data-i='{i}']", "t => getComputedStyle(t).backgroundColor")
    page.check("#heat")
    low = min(range(len(row["loss_mask"])), key=lambda k: row["logprobs"][k] if row["loss_mask"][k] else 1)
    page.hover(f"#tokens .tok[data-i='{low}']")
    assert page.eval_on_selector(f".tok[data-i='{i}']", "t => getComputedStyle(t).backgroundColor") != plain
    page.screenshot(path=shots / "trajectory-heat.png")


@pytest.mark.slow
def test_a_group_side_by_side_with_its_advantages(page, made, shots, tmp_path):
    """A group's samples side by side with the advantages the trainer would give them. The
    rollout's groups seldom have reward variance (the tiny model samples much alike within a
    group: 2 of 32 groups in one run, and which ones depends on the machine's load), so a copy
    of the run gives one group rewards by sample index: its advantages are not all zero."""
    from agentenv.train.loss import group_advantages  # the trainer's; imports torch

    rows = read_jsonl(made / "a.jsonl")
    gid = rows[0]["group_id"]
    members = sorted((r for r in rows if r["group_id"] == gid), key=lambda r: r["sample_index"])
    for r in members:
        r["reward"] = float(r["sample_index"] % 2)
    run = tmp_path / "a.jsonl"
    run.write_text("".join(json.dumps(r) + "\n" for r in rows))
    shutil.copy(made / "a.jsonl.log", tmp_path / "a.jsonl.log")
    assert len(members) == 4 and len({r["reward"] for r in members}) == 2
    with served(page, Viewer([open_run(run)])) as server:
        goto(page, server, "#/run/0")
        page.click(f"tr.row[data-id='{members[0]['id']}'] a")
        page.wait_for_selector("#group .sample")
        assert page.locator("#group .sample").count() == len(members)
        shown = [float(x) for x in page.locator("#group .advantage").all_inner_texts()]
        assert shown == pytest.approx(group_advantages([r["reward"] for r in members]), abs=1e-3)
        texts = page.locator("#group pre.text").all_inner_texts()
        assert [t.strip() for t in texts] == [r["text"].strip() for r in members]
        page.screenshot(path=shots / "group.png")
        assert gid in page.inner_text("h2")


@pytest.mark.slow
def test_two_runs_compared_task_by_task(page, server, made, shots):
    a, b = read_jsonl(made / "a.jsonl"), json.loads((made / "b.json").read_text())
    goto(page, server, "#/compare/0/1")
    rows = page.locator("#compare tr.task")
    assert rows.count() == 32
    mine = {t["task_id"]: t for t in report(a)["per_task"]}
    theirs = {t["task_id"]: t for t in b["per_task"]}
    for k in range(32):
        cells = rows.nth(k).locator("td").all_inner_texts()
        task = cells[0]
        assert f"{mine[task]['passed']}/{mine[task]['samples']}" in cells[1]
        assert f"{theirs[task]['passed']}/{theirs[task]['samples']}" in cells[2]
    summary = page.inner_text("#cmp-summary")
    mean_a = sum(t["passed"] / t["samples"] for t in mine.values()) / 32
    assert f"{100 * mean_a:.1f} %" in summary
    page.screenshot(path=shots / "compare.png", full_page=True)


@pytest.mark.slow
def test_an_eval_report_shows_its_figures_and_its_trajectories(page, server, made, shots):
    rep = json.loads((made / "b.json").read_text())
    goto(page, server, "#/run/1")
    box = page.inner_text("#report")
    assert f"pass@1 {js_fmt(rep['pass@k']['1'])}" in box and f"{rep['tasks']} tasks" in box
    assert page.inner_text("#count").startswith(f"{rep['samples']} of {rep['samples']} shown")
    page.screenshot(path=shots / "eval.png")
    # the judge (the tiny policy: its replies rarely hold a score) and its failures, as data
    rows = read_jsonl(made / "b.jsonl")
    failed = [r for r in rows if r["reward_details"]["judge"].get("failure")]
    page.select_option("#f-judge", "failed")
    page.wait_for_function(f"() => document.querySelector('#count').textContent.startsWith('{len(failed)} of "
                           f"{len(rows)}')")
    page.select_option("#f-judge", "ok")
    page.wait_for_function(
        f"() => document.querySelector('#count').textContent.startsWith('{len(rows) - len(failed)} of')"
    )
    row = (failed or rows)[0]
    page.select_option("#f-judge", "")
    page.click(f"tr.row[data-id='{row['id']}'] td:first-child")
    page.wait_for_selector("#judge")
    judge = page.inner_text("#judge")
    verdict = row["reward_details"]["judge"]
    assert f"score {js_fmt(verdict['score'])}" in judge
    status = page.inner_text("#judge .call[data-name='judge'] .status")
    assert status == (f"failed: {verdict['failure']}" if verdict.get("failure") else "ok")
    if verdict.get("failure"):
        assert verdict["error"] in judge
    if verdict.get("reply"):
        assert verdict["reply"].strip()[:40] in judge
    page.screenshot(path=shots / "judge.png")


@pytest.mark.slow
def test_training_curves_are_interactive(page, server, made, shots):
    steps = [json.loads(x) for x in (made / "train" / "metrics.jsonl").read_text().splitlines()]
    evals = (made / "train" / "eval.jsonl").read_text().splitlines()
    goto(page, server, "#/run/2")
    scored = sum(not math.isnan(r["reward_mean"]) for r in steps)
    assert page.locator("#chart-reward circle.dot").count() == scored + len(evals)  # batch means, evaluations
    assert page.locator("#charts .panel").count() == 6  # agentenv plot's panels
    labels = lambda panel: page.locator(f"#chart-{panel} text.axis-label").all_text_contents()  # noqa: E731
    assert labels("offpolicy") == ["staleness (weight versions behind)", "KL(behaviour || trainer), nats/token"]
    assert labels("throughput") == ["tokens/s", "idle fraction"]
    assert labels("clipping") == ["fraction of tokens"] + (
        ["KL(policy || reference), nats/token"] if any("kl_ref" in r for r in steps) else [])
    assert labels("reward") == ["reward"] and labels("loss") == ["loss"] and labels("signal") == ["groups"]
    page.hover("#chart-loss", position={"x": 300, "y": 80})
    readout = page.locator(".panel:has(#chart-loss) .readout").inner_text()
    assert readout.startswith("step ") and "loss" in readout
    assert page.locator("#chart-reward path.series").count() == 2  # moving mean, held-out pass@1
    page.click(".panel:has(#chart-reward) .key:has-text('moving mean')")
    assert page.locator("#chart-reward path.series").count() == 1
    page.click(".panel:has(#chart-reward) .key:has-text('moving mean')")
    page.hover("#chart-reward", position={"x": 250, "y": 100})
    page.screenshot(path=shots / "training.png", full_page=True)
    assert f"{len(steps)} steps" in page.inner_text("#train-status")


@pytest.mark.slow
def test_a_step_that_measured_no_rate_is_not_drawn_at_zero(page, made, tmp_path):
    """A step in which the generator was busy but no program finished has no throughput point
    (agentenv plot's rule); a step in which it was idle throughout is drawn at 0."""
    run = tmp_path / "train"
    shutil.copytree(made / "train", run)
    last = json.loads((run / "metrics.jsonl").read_text().splitlines()[-1])
    busy, idle = last["step"] + 1, last["step"] + 2
    with open(run / "metrics.jsonl", "a") as f:
        f.write(json.dumps({**last, "step": busy, "gen_tokens_per_s": 0.0, "gen_idle_frac": 0.3}) + "\n")
        f.write(json.dumps({**last, "step": idle, "gen_tokens_per_s": 0.0, "gen_idle_frac": 1.0}) + "\n")
    with served(page, Viewer([open_run(run)])) as server:
        goto(page, server, "#/run/0")
        dot = lambda step: page.locator(  # noqa: E731
            f"#chart-throughput circle[data-key='gen_tokens_per_s_measured'][data-step='{step}']")
        assert dot(last["step"]).count() == 1 and dot(busy).count() == 0
        assert dot(idle).get_attribute("data-value") == "0"
        assert page.locator("#chart-throughput path[data-key='gen_tokens_per_s_run_mean']").count() == 1


@pytest.mark.slow
def test_a_growing_run_is_followed(browser, made, shots, tmp_path):
    """The rollout's own lines and event-log records appended in the order they were written:
    the page shows the rows and the programs in flight as the files grow."""
    src = made / "a.jsonl"
    content = src.read_bytes()
    ends = [m.end() for m in re.finditer(b"\n", content)]  # where each line ends
    records, _ = journal.read(src.with_name("a.jsonl.log"))
    log_lines = src.with_name("a.jsonl.log").read_bytes().splitlines(keepends=True)
    out = tmp_path / "live.jsonl"
    out.write_bytes(b"")

    def upto(done: int) -> tuple[int, int]:
        """The log up to its done-th "done" record and the lines written by then; the
        programs started by then and those in flight."""
        n, seen = 0, 0
        while seen < done:
            seen += records[n]["e"] == "done"
            n += 1
        out.with_name("live.jsonl.log").write_bytes(b"".join(log_lines[:n]))
        with open(out, "ab") as f:
            f.write(content[out.stat().st_size:ends[done - 1]])
        started = sum(r["e"] == "start" for r in records[:n])
        return started, started - done

    upto(10)
    page = browser.new_page()
    page.set_default_timeout(WAIT_MS)
    with ViewServer(Viewer([open_run(out)])) as server:
        goto(page, server, "#/run/0")
        assert page.inner_text("#count").startswith("10 of 10 shown")
        started, flying = upto(60)
        assert flying > 0, "precondition: programs were in flight when the 60th was written"
        page.wait_for_function("() => document.querySelector('#count').textContent.startsWith('60 of 60')")
        page.wait_for_function(f"() => document.querySelector('#live').textContent.includes('{flying} in flight · "
                               f"{started} started')")
        assert page.locator("tr.row").count() == 60
        assert page.inner_text("#flight").count(" turns)") == min(flying, 50)
        page.screenshot(path=shots / "live.png")
        with open(out, "ab") as f:
            f.write(content[ends[59]:ends[59] + 100])  # torn: not shown until its newline
        upto(128)
        page.wait_for_function("() => document.querySelector('#count').textContent.startsWith('128 of 128')")
        page.wait_for_function("() => document.querySelector('#live').textContent.includes('128 written of 128 · 0 "
                               "in flight')")
    page.close()
    assert out.read_bytes() == content


MARKUP = '<img src=x onerror="window.pwned=(window.pwned||[]).concat(1)"><script>window.pwned=[2]</script>'


@pytest.mark.slow
def test_markup_in_a_run_shows_as_text_and_runs_nothing(page, made, shots, tmp_path):
    """A tool's output, the model's text, a task id and an error holding HTML: the page shows
    them as text (no element made of them) and no script runs (nor would under its CSP)."""
    from tokenizers import Tokenizer

    from agentenv.models import default_model

    tok = Tokenizer.from_file(str(default_model() / "tokenizer.json"))
    ids = tok.encode(MARKUP, add_special_tokens=False).ids
    row = next(r for r in read_jsonl(made / "a.jsonl") if r["tool_calls"])
    n = len(ids)
    row.update(task_id=f"task {MARKUP}", error=MARKUP, text=row["text"] + MARKUP,
               segments=row["segments"] + [{"kind": "model", "token_ids": ids, "logprobs": [-0.5] * n,
                                            "weight_versions": [0] * n}],
               input_ids=row["input_ids"] + ids, loss_mask=row["loss_mask"] + [1] * n,
               logprobs=row["logprobs"] + [-0.5] * n, weight_versions=row["weight_versions"] + [0] * n)
    row["tool_calls"] = [{**row["tool_calls"][0], "output": MARKUP, "error": MARKUP}]
    out = tmp_path / "markup.jsonl"
    out.write_text(json.dumps(row) + "\n")

    def nothing_ran() -> None:
        assert page.evaluate("window.pwned === undefined")
        assert page.locator("#main img, #main script").count() == 0

    with served(page, Viewer([open_run(out)])) as server:
        goto(page, server, "#/run/0")
        assert MARKUP in page.inner_text("#rows")
        nothing_ran()
        goto(page, server, f"#/run/0/t/{row['id']}")
        assert MARKUP in page.inner_text("#calls") and MARKUP in page.inner_text("#reward")
        text = page.evaluate(
            "[...document.querySelectorAll('#tokens .seg-model .tok')].map(t => t.textContent).join('')"
        )
        assert text.endswith(MARKUP)
        nothing_ran()
        page.screenshot(path=shots / "markup.png")
        goto(page, server, f"#/run/0/g/{quote(row['group_id'], safe='')}")
        assert page.inner_text("#group pre.text").endswith(MARKUP)
        nothing_ran()


@pytest.mark.slow
def test_an_agent_programs_sequences_are_shown_with_their_roles(page, agent_rollout, shots):
    """An agent program's trajectory (the real gateway): the list counts its branches and names
    their roles; its page shows the main sequence and each branch, labelled with its index and
    role, token by token as the main one (mask, text, a hovered token's logprob and version)."""
    from agentenv.trajectory import Trajectory

    lines = read_jsonl(agent_rollout)
    line = lines[0]
    seqs = Trajectory.from_dict(line).sequences()  # the trainer's rows: the main sequence, then each branch
    with served(page, Viewer([open_run(agent_rollout)])) as server:
        goto(page, server, "#/run/0")
        assert page.locator("tr.row td.branches").all_inner_texts() == ["2 · main, critic"] * len(lines)
        page.click(f"tr.row[data-id='{line['id']}'] td:first-child")
        page.wait_for_selector("#sequences")
        sections = page.locator("#sequences section.sequence")
        assert sections.count() == 3
        heads = page.locator("#sequences .seq-head").all_inner_texts()
        assert [h.split(" · sampled")[0].split(" · ")[:2] for h in heads] == [
            ["main", "role main"], ["branch 1", "role main"], ["branch 2", "role critic"]]
        assert [sections.nth(k).get_attribute("data-role") for k in range(3)] == ["main", "main", "critic"]
        for k, row in enumerate(seqs):
            box = f"#{'tokens' if k == 0 else f'tokens-{k}'}"
            assert f"{sum(row.loss_mask)} sampled of {len(row.input_ids)} tokens" in heads[k]
            assert page.locator(f"{box} .tok.m1").count() == sum(row.loss_mask)
            assert page.locator(f"{box} .tok.m0").count() == len(row.loss_mask) - sum(row.loss_mask)
            assert page.locator(f"{box} .seg-env .tok.m1").count() == 0
            kinds = page.locator(f"{box} .seg").evaluate_all("els => els.map(e => e.dataset.kind)")
            assert kinds == ["prompt"] + [s.kind for s in row.segments]
        sampled = page.evaluate("[...document.querySelectorAll('#tokens-2 .tok.m1')].map(t => t.textContent).join('')")
        assert sampled == "Looks right.<|im_end|>"
        assert "Critique: The sum is 5." in page.inner_text("#tokens-2 .seg-prompt")
        assert "Are you sure?" in page.inner_text("#tokens-1 .seg-env")  # the user's turn spliced in: mask 0
        critic = seqs[2]
        i = critic.loss_mask.index(1)
        page.hover(f"#tokens-2 .tok[data-i='{i}']")
        tip = page.inner_text("#tip")
        assert tip.startswith("branch 2 · role critic · position ")
        assert f"logprob {critic.logprobs[i]:.4f}" in tip and f"weight version {critic.weight_versions[i]}" in tip
        page.check("#heat")
        assert page.locator(".tokens.heat").count() == 3
        page.screenshot(path=shots / "agent-branches.png", full_page=True)
