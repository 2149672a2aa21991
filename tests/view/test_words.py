"""The viewer's words and colours in a real browser (headless Chromium driven by Playwright,
as in test_page.py), over the recorded rollout and training run and one small real rollout
whose turns were cut at their token cap: counts read "1 tool call", a model segment that
continues a cut turn says so, and each training curve has agentenv plot's colour."""

from __future__ import annotations

import re
from urllib.parse import quote

import pytest
from matplotlib.colors import to_hex

from agentenv.evaluation import read_jsonl
from agentenv.train.plot import figure
from agentenv.view.runs import open_run
from agentenv.view.server import Viewer, ViewServer

from .conftest import DATA
from .test_page import ARGS, CHROMIUM, WAIT_MS, _browser_or_fail, goto


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


@pytest.fixture
def page(browser):
    page = browser.new_page()
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
    page.set_default_timeout(WAIT_MS)
    yield page
    page.close()
    assert errors == [], errors


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # The recorded runs are read, never written: the viewer only follows files.
    viewer = Viewer([open_run(DATA / "rollout.jsonl"), open_run(DATA / "train")])
    with ViewServer(viewer) as s:
        yield s


@pytest.mark.slow  # a browser, as test_page.py's
def test_a_group_counts_one_tool_call_in_the_singular(page, server):
    rows = list(read_jsonl(DATA / "rollout.jsonl"))
    gid = next(r["group_id"] for r in rows if [c["status"] for c in r["tool_calls"]] == ["error"])
    goto(page, server, f"#/run/0/g/{quote(gid, safe='')}")
    lines = page.locator("#group .sample .muted").all_inner_texts()
    assert len(lines) == 2 and all(" · 1 tool call (1 error) · " in line for line in lines), lines
    ok = next(r["group_id"] for r in rows if [c["status"] for c in r["tool_calls"]] == ["ok"])
    goto(page, server, f"#/run/0/g/{quote(ok, safe='')}")
    assert all(
        " · 1 tool call (0 errors) · " in line for line in page.locator("#group .sample .muted").all_inner_texts()
    )
    assert not re.search(r"\b1 (tool calls|errors)\b", page.inner_text("body"))


@pytest.mark.slow  # a browser, as test_page.py's
def test_a_model_segment_that_continues_a_cut_turn_says_why(page, cut_rollout):
    rows = list(read_jsonl(cut_rollout))
    row = next(r for r in rows if any(a["kind"] == b["kind"] == "model" for a, b in zip(r["segments"],
                                                                                         r["segments"][1:])))
    with ViewServer(Viewer([open_run(cut_rollout)])) as srv:
        goto(page, srv, f"#/run/0/t/{quote(row['id'], safe='')}")
        kinds = [s["kind"] for s in row["segments"]]
        continued = sum(a == b == "model" for a, b in zip(kinds, kinds[1:]))
        labels = page.locator(".seg[data-continued='1'] > .seg-label").all_inner_texts()
        assert len(labels) == continued and all(
            label.startswith("model, continued (loss mask 1): the turn before stopped at its token cap "
                             "(--max-tokens-per-turn)") for label in labels), labels
        assert page.locator(".seg-model:not([data-continued]) > .seg-label").first.inner_text() == "model (loss mask 1)"


@pytest.mark.slow  # a browser, as test_page.py's
def test_each_training_curve_has_the_colour_agentenv_plot_gives_it(page, server):
    """The viewer's legend swatches against the lines of agentenv plot's figure for the same
    run, matched by label: the generator's and trainer's idle lines were swapped."""
    fig = figure(DATA / "train")
    plotted = {line.get_label(): to_hex(line.get_color()) for ax in fig.axes for line in ax.get_lines()
               if not line.get_label().startswith("_")}
    goto(page, server, "#/run/1")
    keys = page.locator("#charts .panel .key")
    shown = {}
    for i in range(keys.count()):
        key = keys.nth(i)
        rgb = key.locator("i").evaluate("el => getComputedStyle(el).backgroundColor")
        r, g, b = (int(x) for x in re.findall(r"\d+", rgb)[:3])
        shown[key.inner_text().strip()] = f"#{r:02x}{g:02x}{b:02x}"
    both = sorted(set(plotted) & set(shown))
    assert {"generator idle", "trainer idle", "generated tok/s (run mean)"} <= set(both), (plotted, shown)
    assert {k: shown[k] for k in both} == {k: plotted[k] for k in both}
    assert shown["generator idle"] == "#2ca02c" and shown["trainer idle"] == "#d62728"
