"""The viewer's JSON endpoints over real HTTP on loopback, without a browser."""

from __future__ import annotations

import json
import socket
import urllib.error
import urllib.request
from urllib.parse import quote

import pytest

from agentenv.errors import ConfigError
from agentenv.evaluation import read_jsonl
from agentenv.view.page import STATIC, asset
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
    for host in ("999.1.1.1", "10.255.255.1"):  # no such address; not this machine's: no word of the port
        with pytest.raises(ConfigError, match=r"\(--host must be an address of this machine, e\.g\. 127\.0\.0\.1 "
                                              r"or 0\.0\.0\.0\)$"):
            ViewServer(served.viewer, host=host, port=0)
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
    assert sorted(names, key=natural) == [
        "a",
        "retool-math/0/1b",
        "retool-math/0/2",
        "retool-math/0/10",
        "retool-math/1/0",
    ]


def raw_get(url: str, target: str, host: str) -> tuple[int, bytes]:
    """A request written by hand (``urllib`` refuses a Host like ``[``): status and body."""
    port = int(url.rsplit(":", 1)[1].strip("/"))
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(f"GET {target} HTTP/1.1\r\nHost: {host}\r\nConnection: close\r\n\r\n".encode())
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    head, _, body = reply.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


def test_a_host_that_is_no_host_name_is_refused(served):
    assert raw_get(served.url, "/api/runs", "[")[0] == 403
    assert raw_get(served.url, "/api/runs", "[::1")[0] == 403
    status, body = raw_get(served.url, "/api/runs", "127.0.0.1")
    assert status == 200 and len(json.loads(body)) == 3


def test_a_malformed_line_is_an_error_in_its_row_and_the_list_goes_on(served, rollout):
    rows = read_jsonl(rollout)
    no_ids = {**rows[0], "id": "no-token-ids", "segments": [{"kind": "model"}]}  # a segment without token_ids
    bad_tools = {**rows[1], "id": "bad-tools", "tool_calls": [1]}
    bad_reward = {**rows[2], "id": "bad-reward", "reward": "high"}
    with open(rollout, "a") as f:
        for row in (no_ids, bad_tools, bad_reward, {**rows[3], "id": "fine"}):
            f.write(json.dumps(row) + "\n")
    status, got = get(served.url + "api/run/0/rows?since=6")
    assert status == 200 and got["total"] == 10
    by_id = {r["id"]: r for r in got["rows"]}
    assert list(by_id) == ["no-token-ids", "bad-tools", "bad-reward", "fine"]
    for bad, src in (("bad-tools", bad_tools), ("bad-reward", bad_reward)):
        assert by_id[bad]["finish_reason"] == "error: malformed line" and by_id[bad]["reward"] is None
        assert by_id[bad]["error"].startswith("malformed line at byte ") and by_id[bad]["task_id"] == src["task_id"]
    assert "reward is 'high'" in by_id["bad-reward"]["error"]
    assert by_id["fine"]["error"] is None and by_id["fine"]["reward"] == rows[3]["reward"]
    status, err = get(served.url + "api/run/0/traj?id=no-token-ids")
    assert status == 500 and "trajectory 'no-token-ids' is malformed (KeyError: 'token_ids')" in err["error"]
    assert get(served.url + "api/run/0/traj?id=fine")[0] == 200
    status, tasks = get(served.url + "api/run/0/tasks")
    assert status == 200 and sum(t["samples"] for t in tasks.values()) == 10


def test_an_unexpected_error_is_a_500_with_one_line_logged(served, rollout, capsys):
    capsys.readouterr()
    rollout.unlink()
    rollout.mkdir()  # the path is a directory now: reading it fails as nothing in the viewer expects
    status, err = get(served.url + "api/run/0/rows")
    assert status == 500 and err["error"].startswith("IsADirectoryError: ")
    logged = capsys.readouterr().err.splitlines()
    assert len(logged) == 1 and logged[0].startswith("agentenv view: GET /api/run/0/rows: IsADirectoryError: ")
    assert get(served.url + "api/runs")[0] == 200  # the server goes on


def test_no_path_reaches_outside_static(served, tmp_path):
    """A file the page's suffixes allow, outside static/: no spelling of its path is served."""
    secret = tmp_path / "secret.js"
    secret.write_text("the runs' secrets\n")
    up = "../" * (len(STATIC.resolve().parts) + 2)  # past the root: resolves to the file itself
    for name in (str(secret), f"{up}{secret}".replace("//", "/"), f"{up}{secret}"):
        assert (STATIC / name).resolve() == secret.resolve()  # what the check must refuse
        assert asset(name) is None, name
    targets = [f"/static/{secret}", f"/static//{secret}", f"/static/{up}{secret}".replace("//", "/"),
               f"/static/{up}{secret}".replace("//", "/").replace("..", "%2e%2e"),
               f"/static/{up}{secret}".replace("//", "/").replace("/", "%2f").replace("%2fstatic%2f", "/static/", 1),
               "/static/../page.py", "/static/../static/app.js/..", f"/{up}{secret}".replace("//", "/"), f"//{secret}"]
    for target in targets:
        status, body = raw_get(served.url, target, "127.0.0.1")
        assert status == 404 and b"secrets" not in body, target
    assert raw_get(served.url, "/static/../static/app.js", "127.0.0.1")[0] == 200  # inside static/: served


def test_the_page_forbids_scripts_and_loads_from_elsewhere(served):
    for path in ("", "static/app.js", "api/runs"):
        with urllib.request.urlopen(served.url + path, timeout=30) as r:
            assert r.headers["Content-Security-Policy"] == "default-src 'self'"
            assert r.headers["X-Content-Type-Options"] == "nosniff"
    with urllib.request.urlopen(served.url + "static/icon.svg", timeout=30) as r:
        assert r.headers["Content-Type"] == "image/svg+xml" and r.read().startswith(b"<svg")


def test_training_curves_carry_the_series_agentenv_plot_derives(served, train_run):
    """The derived series are plot.py's: a busy interval in which no program finished has no
    measured rate (not 0 tok/s), an idle one measured 0; the moving mean skips NaN."""
    from agentenv.train.plot import moving, throughput

    path = train_run / "metrics.jsonl"
    rows = [json.loads(x) for x in path.read_text().splitlines()]
    last = rows[-1]
    busy = {**last, "step": 4, "gen_tokens_per_s": 0.0, "gen_idle_frac": 0.25, "reward_mean": float("nan")}
    idle = {**last, "step": 5, "gen_tokens_per_s": 0.0, "gen_idle_frac": 1.0}
    with open(path, "a") as f:
        f.write(json.dumps(busy) + "\n" + json.dumps(idle) + "\n")
    rows += [busy, idle]
    status, c = get(served.url + "api/run/2/curves")
    assert status == 200 and [r["step"] for r in c["rows"]] == [1, 2, 3, 4, 5]
    steps, rate, mean = throughput(rows)
    assert 4 not in steps and 5 in steps
    measured = {r["step"]: r["gen_tokens_per_s_measured"] for r in c["rows"]}
    assert (
        measured == {s: dict(zip(steps, rate)).get(s) for s in range(1, 6)} and measured[4] is None and measured[5] == 0
    )
    assert [r["gen_tokens_per_s_run_mean"] for r in c["rows"] if r["step"] in steps] == pytest.approx(mean)
    assert [r["reward_moving"] for r in c["rows"]] == pytest.approx(moving([r["reward_mean"] for r in rows], 5))
    status, tail = get(served.url + "api/run/2/curves?since=4")  # a poll for the last row: its run mean is the run's
    assert [r["step"] for r in tail["rows"]] == [5] and tail["rows"][0]["gen_tokens_per_s_run_mean"] == pytest.approx(
        mean[-1]
    )


def test_an_agent_programs_branches_and_roles_over_http(agent_rollout):
    """The trajectory's JSON carries each branch with its index, role and tokens, as it carries
    the main sequence; the list rows count the branches and name their roles."""
    line = read_jsonl(agent_rollout)[0]
    with ViewServer(Viewer([open_run(agent_rollout)])) as server:
        status, got = get(server.url + "api/run/0/rows")
        assert status == 200 and [(r["branches"], r["roles"]) for r in got["rows"]] == [(2, ["main", "critic"])] * 2
        status, t = get(server.url + f"api/run/0/traj?id={line['id']}")
    assert status == 200 and t["role"] == "main" and t["ids"] == line["input_ids"]
    assert [(b["index"], b["role"]) for b in t["branches"]] == [(1, "main"), (2, "critic")]
    for shown, branch in zip(t["branches"], line["branches"]):
        ids = branch["prompt_ids"] + [i for s in branch["segments"] for i in s["token_ids"]]
        assert shown["ids"] == ids and len(shown["pieces"]) == len(shown["loss_mask"]) == len(ids)
        sampled = [i for s in branch["segments"] if s["kind"] == "model" for i in s["token_ids"]]
        assert [i for i, m in zip(ids, shown["loss_mask"]) if m] == sampled
        assert [lp for lp, m in zip(shown["logprobs"], shown["loss_mask"]) if m] == [
            lp for s in branch["segments"] if s["kind"] == "model" for lp in s["logprobs"]]
        assert [v for v, m in zip(shown["weight_versions"], shown["loss_mask"]) if m] == [
            v for s in branch["segments"] if s["kind"] == "model" for v in s["weight_versions"]]
