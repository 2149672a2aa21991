"""``agentenv view`` as a user runs it: a real subprocess serving on the port given, the page
opened (or not) through the user's browser setting, stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.request

import pytest

from agentenv.cli import main
from agentenv.evaluation import read_jsonl


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    """``agentenv view ARGS`` and the first line it prints (the server listens before it says where)."""
    proc = subprocess.Popen([sys.executable, "-m", "agentenv.cli", "view", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, **env},
                            # as from a terminal: a test run started in the background (``cmd &``)
                            # ignores SIGINT, and the child would inherit that and never see the Ctrl-C
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    return proc, proc.stdout.readline()


def start_view(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen, str]:
    proc, line = launch(*args, env=env)
    assert "agentenv view:" in line, proc.stderr.read() if proc.poll() is not None else line
    return proc, line.split(" at ", 1)[1].split()[0]


def start_on_a_free_port(*args: str, env: dict[str, str]) -> tuple[subprocess.Popen, str, int]:
    """``agentenv view ARGS --port N`` on a port free a moment before; another process on the
    machine (a second test run) may take it in between, so a port found busy is tried again."""
    for _ in range(5):
        port = free_port()
        proc, line = launch(*args, "--port", str(port), env=env)
        if "agentenv view:" in line:
            return proc, line.split(" at ", 1)[1].split()[0], port
        err = proc.communicate(timeout=30)[1]
        assert "--port 0 takes any free port" in err, err  # only a busy port is tried again
    raise AssertionError("five free ports were each taken before the view could listen on them")


def stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGINT)
    return proc.wait(timeout=30)


@pytest.fixture
def opener(tmp_path):
    """A "browser" ($BROWSER, as webbrowser reads it) that writes the URL it was given to a file."""
    script = tmp_path / "opener.sh"
    script.write_text('#!/bin/sh\necho "$1" > "$(dirname "$0")/opened"\n')
    script.chmod(0o755)
    return {"BROWSER": str(script), "DISPLAY": ":0"}, tmp_path / "opened"


def test_view_serves_the_trajectory_texts_on_the_port_given_without_a_browser(rollout, opener):
    env, opened = opener
    proc, url, port = start_on_a_free_port(str(rollout), "--no-browser", env=env)
    try:
        assert url == f"http://127.0.0.1:{port}/"
        with urllib.request.urlopen(url, timeout=30) as r:
            assert b"app.js" in r.read()
        served = b""
        for row in read_jsonl(rollout):
            with urllib.request.urlopen(f"{url}api/run/0/traj?id={row['id']}", timeout=30) as r:
                body = r.read()
            served += body
            assert json.loads(body)["text"] == row["text"]
        assert json.dumps(read_jsonl(rollout)[0]["text"])[1:-1].encode() in served
    finally:
        assert stop(proc) == 0
    assert not opened.exists()


def test_view_opens_the_page_in_the_users_browser(rollout, opener):
    env, opened = opener
    proc, url = start_view(str(rollout), "--port", "0", env=env)
    try:
        with urllib.request.urlopen(url + "api/runs", timeout=30) as r:
            assert json.loads(r.read())[0]["path"] == str(rollout)
    finally:
        assert stop(proc) == 0
    assert opened.read_text().strip() == url  # webbrowser ran the opener before the server was asked


@pytest.mark.parametrize("args, message", [
    (["view"], "the following arguments are required: paths"),
    (["view", "/nonexistent/r.jsonl"], "no such rollout file"),
    (["view", "x.jsonl", "--port", "70000"], "--port must be between 0 and 65535"),
])
def test_view_refuses_in_one_line(args, message, capsys):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
