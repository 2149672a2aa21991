"""The viewer's JSON endpoints over real HTTP on loopback, without a browser."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from urllib.parse import quote

import pytest

from agentenv.errors import ConfigError
from agentenv.evaluation import read_jsonl
from agentenv.view.runs import open_run
from agentenv.view.server import Viewer, ViewServer, finite, natural


def get(url: str) -> tuple[int, object]:
    try:
        with urllib.request.urlopen(url, timeout=30) as r:
            body = r.read()
            return r.status, json.loads(body) if r.headers["Content-Type"] == "application/json" else body
    except urllib.error.HTTPError as exc:
        body = exc.read()
        return exc.code, json.loads(body) if exc.headers["Content-Type"] == "application/json" else body


@pytest.fixture
def served(rollout, eval_report, train_run):
    with ViewServer(Viewer([open_run(rollout), open_run(eval_report), open_run(train_run)])) as server:
        yield server


def test_the_runs_and_the_page_are_served(served):
    status, runs = get(served.url + "api/runs")
    assert status == 200 and [r["kind"] for r in runs] == ["rollout", "eval", "train"]
    assert [r["label"] for r in runs] == ["rollout.jsonl", "eval.json", "train"]
    status, page = get(served.url)
    assert status == 200 and b"<script src=\"/static/app.js\"" in page
    assert get(served.url + "static/app.js")[0] == 200
    assert get(served.url + "static/../server.py")[0] == 404
    assert get(served.url + "api/run/7")[0] == 404
    assert get(served.url + "api/run/2/rows")[0] == 404  # a training run has no trajectories


def test_rows_trajectory_and_group_over_http(served, rollout):
    rows = read_jsonl(rollout)
    status, got = get(served.url + "api/run/0/rows?since=4")
    assert status == 200 and got["total"] == 6 and [r["id"] for r in got["rows"]] == [r["id"] for r in rows[4:]]
    status, t = get(served.url + f"api/run/0/traj?id={rows[0]['id']}")
    assert status == 200 and t["text"] == rows[0]["text"]
    assert "".join(t["pieces"][len(rows[0]["prompt_ids"]):]) == rows[0]["text"]
    assert t["logprobs"] == rows[0]["logprobs"] and t["weight_versions"] == rows[0]["weight_versions"]
    assert get(served.url + "api/run/0/traj?id=nope")[0] == 404
    gid = rows[0]["group_id"]  # holds '/' and '#'
    status, g = get(served.url + f"api/run/0/group?id={quote(gid, safe='')}")
    assert status == 200 and g["group_id"] == gid and len(g["samples"]) == 2
    assert all(s["group_id"] == gid and "advantage" in s for s in g["samples"])


def test_an_eval_report_and_a_comparison(served, rollout):
    status, info = get(served.url + "api/run/1")
    assert status == 200 and info["kind"] == "eval" and info["report"]["tasks"] == 3 and info["rows"] == 6
    assert info["tokenizer_is_runs"] is True  # the rollout's log names the model (the bundled one here)
    status, cmp = get(served.url + "api/compare?a=0&b=1")
    assert status == 200 and cmp["common"] == 3 and cmp["rate_a"] == cmp["rate_b"]
    by_task = {t["task_id"]: t for t in cmp["tasks"]}
    for task in info["report"]["per_task"]:
        assert by_task[task["task_id"]]["a"]["passed"] == task["passed"]
        assert by_task[task["task_id"]]["b"]["rate"] == task["passed"] / task["samples"]
    assert get(served.url + "api/compare?a=0&b=2")[0] == 404


def test_a_growing_rollout_is_followed(served, rollout):
    lines = rollout.read_text().splitlines(keepends=True)
    with open(rollout, "a") as f:  # the same programs written again, as a second pass would
        f.write(lines[0])
        f.write(lines[1][:40])  # torn: not read yet
    assert get(served.url + "api/run/0/rows?since=6")[1]["total"] == 7
    with open(rollout, "a") as f:
        f.write(lines[1][40:])
    got = get(served.url + "api/run/0/rows?since=7")[1]
    assert got["total"] == 8 and [r["id"] for r in got["rows"]] == [json.loads(lines[1])["id"]]


def test_training_curves_with_nan_served_as_null(served, train_run):
    rows = (train_run / "metrics.jsonl").read_text().splitlines()
    row = json.loads(rows[-1])
    row.update(step=4, reward_mean=float("nan"))  # a step with no scored reward
    with open(train_run / "metrics.jsonl", "a") as f:
        f.write(json.dumps(row) + "\n")
    status, c = get(served.url + "api/run/2/curves?since=2")
    assert status == 200 and [r["step"] for r in c["rows"]] == [3, 4] and c["rows"][1]["reward_mean"] is None
    assert c["evals_total"] == 3 and c["summary"]["steps"] == 3
    assert get(served.url + "api/run/0/curves")[0] == 404
    assert finite({"a": [1.0, float("inf")], "b": {"c": float("-inf")}}) == {"a": [1.0, None], "b": {"c": None}}


def test_a_busy_port_is_a_config_error(served):
    port = int(served.url.rsplit(":", 1)[1].strip("/"))
    with pytest.raises(ConfigError, match="--port 0 takes any free port"):
        ViewServer(served.viewer, port=port)
    with pytest.raises(ConfigError, match="nothing to view"):
        Viewer([])


def test_a_loopback_viewer_answers_only_requests_addressed_to_it(served):
    """A page elsewhere that rebinds its host name to 127.0.0.1 gets nothing (DNS rebinding)."""
    port = served.url.rsplit(":", 1)[1].strip("/")
    for host, status in ((f"evil.example:{port}", 403), (f"localhost:{port}", 200), (f"127.0.0.1:{port}", 200)):
        req = urllib.request.Request(served.url + "api/runs", headers={"Host": host})
        try:
            with urllib.request.urlopen(req, timeout=30) as r:
                assert r.status == status == 200 and len(json.loads(r.read())) == 3
        except urllib.error.HTTPError as exc:
            assert exc.code == status == 403


def test_an_ipv6_loopback_viewer(rollout):
    try:
        server = ViewServer(Viewer([open_run(rollout)]), host="::1")
    except ConfigError as exc:  # a machine without IPv6 on loopback
        pytest.skip(str(exc))
    with server:
        assert server.url.startswith("http://[::1]:")
        status, runs = get(server.url + "api/runs")
        assert status == 200 and runs[0]["kind"] == "rollout"


def test_tasks_sort_by_their_numbers():
    names = ["retool-math/0/10", "retool-math/0/2", "retool-math/1/0", "a", "retool-math/0/1b"]
    assert sorted(names, key=natural) == ["a", "retool-math/0/1b", "retool-math/0/2", "retool-math/0/10", "retool-math/1/0"]
