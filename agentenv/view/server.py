"""``agentenv view``'s local server: the page and JSON endpoints over the runs' files.

A standard-library ``ThreadingHTTPServer`` on loopback. Every request re-reads only the bytes
the files gained (:class:`~agentenv.view.runs.Tail`), so a page that polls follows a run
that is still writing. The endpoints (all ``GET``, JSON; ``i`` is a run's index in the order
given on the command line):

====================================  =========================================================
``/api/runs``                         the runs: kind, path, label, row count
``/api/run/i``                        one run: settings, tokenizer, progress; an eval's report;
                                      a training run's config and summary
``/api/run/i/rows?since=N``           list rows from the N-th on, and the event log's progress
``/api/run/i/traj?id=ID``             one trajectory: its fields, each token's text, mask,
                                      logprob and weight version, the segments' extents; the
                                      same for each of an agent program's branches, with its role
``/api/run/i/group?id=GID``           a group's samples with their GRPO advantages
``/api/run/i/tasks``                  per task: samples, passes, mean reward
``/api/run/i/curves?since=N``         a training run's step rows, with the series ``agentenv plot``
                                      derives (and evaluation rows)
``/api/compare?a=i&b=j``              two runs task by task: pass rate of each
====================================  =========================================================
"""

from __future__ import annotations

import errno
import json
import math
import re
import socket
import sys
import threading
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Sequence
from urllib.parse import parse_qs, urlsplit

from ..errors import ConfigError
from .page import asset
from .runs import Run, TrainingRun


def finite(obj: Any) -> Any:
    """``obj`` with NaN and infinities as None: JSON has no NaN (a step with no scored
    reward logs ``reward_mean`` NaN) and the browser's JSON.parse refuses it."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [finite(v) for v in obj]
    return obj


def natural(name: str) -> list[Any]:
    """A sort key that puts ``task/2`` before ``task/10``: digit runs compare as numbers."""
    return [(0, int(part), "") if part.isdigit() else (1, 0, part) for part in re.split(r"(\d+)", name)]


class NotFound(Exception):
    """A request for something the runs do not hold (answered 404)."""


class Viewer:
    """The runs being shown and the answers to the page's requests (no HTTP here)."""

    def __init__(self, runs: Sequence[Run]) -> None:
        if not runs:
            raise ConfigError("nothing to view: give a rollout file, an eval report or a training run")
        self.runs = list(runs)

    def run(self, i: str) -> Run:
        try:
            return self.runs[int(i)]
        except (ValueError, IndexError):
            raise NotFound(f"no run {i}") from None

    def _rollout(self, i: str) -> Any:
        run = self.run(i)
        if isinstance(run, TrainingRun):
            raise NotFound(f"run {i} is a training run: it has no trajectories")
        return run

    def answer(self, path: str, query: dict[str, str]) -> Any:
        """The JSON object for ``path`` (an ``/api/...`` path) and its query; NotFound when none."""
        parts = [p for p in path.split("/") if p][1:]  # after "api"
        if parts == ["runs"]:
            return [
                {"index": i, "kind": r.kind, "path": str(r.path), "label": r.label} for i, r in enumerate(self.runs)
            ]
        if parts == ["compare"]:
            return self.compare(query.get("a", "0"), query.get("b", "1"))
        if len(parts) < 2 or parts[0] != "run":
            raise NotFound(path)
        i, what = parts[1], parts[2] if len(parts) > 2 else ""
        since = int(query.get("since", "0") or 0)
        if what == "":
            return self.run(i).info()
        if what == "curves":
            run = self.run(i)
            if not isinstance(run, TrainingRun):
                raise NotFound(f"run {i} is not a training run")
            return run.curves(since, int(query.get("evals_since", "0") or 0))
        if what == "rows":
            return self._rollout(i).summaries(since)
        if what == "traj":
            found = self._rollout(i).trajectory(query.get("id", ""))
            if found is None:
                raise NotFound(f"no trajectory {query.get('id')!r} in run {i}")
            return found
        if what == "group":
            return {"group_id": query.get("id", ""), "samples": self._rollout(i).group(query.get("id", ""))}
        if what == "tasks":
            return self._rollout(i).per_task()
        raise NotFound(path)

    def compare(self, a: str, b: str) -> dict[str, Any]:
        """Runs ``a`` and ``b`` task by task: each task's pass rate (and mean reward) in each;
        overall, the mean pass rate over the tasks both ran."""
        ta, tb = self._rollout(a).per_task(), self._rollout(b).per_task()

        def side(t: dict[str, Any] | None) -> dict[str, Any] | None:
            if t is None:
                return None
            return {"samples": t["samples"], "passed": t["passed"], "rate": t["passed"] / t["samples"],
                    "mean_reward": t["mean_reward"]}

        tasks = [
            {"task_id": k, "a": side(ta.get(k)), "b": side(tb.get(k))} for k in sorted(set(ta) | set(tb), key=natural)
        ]
        both = [t for t in tasks if t["a"] and t["b"]]
        mean = (lambda key: sum(t[key]["rate"] for t in both) / len(both) if both else None)
        return {"a": {"index": int(a), "label": self.runs[int(a)].label},
                "b": {"index": int(b), "label": self.runs[int(b)].label},
                "tasks": tasks, "common": len(both), "rate_a": mean("a"), "rate_b": mean("b"),
                "better": sum(t["b"]["rate"] > t["a"]["rate"] for t in both),
                "worse": sum(t["b"]["rate"] < t["a"]["rate"] for t in both)}


class _Handler(BaseHTTPRequestHandler):
    viewer: Viewer  # set on the subclass a server makes
    hosts: frozenset[str] | None  # the Host names answered; None: any (a server bound to all addresses)

    def log_message(self, format: str, *args: Any) -> None:  # quiet: the terminal shows the URL only
        pass

    def _send(self, status: int, body: bytes, ctype: str) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Cache-Control", "no-store")
        # Only the page's own files run or load: text from a run (a tool's output, the model's
        # text) that reached the page as markup could neither run a script nor fetch anything.
        self.send_header("Content-Security-Policy", "default-src 'self'")
        self.send_header("X-Content-Type-Options", "nosniff")
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj: Any) -> None:
        self._send(status, json.dumps(finite(obj), separators=(",", ":")).encode(), "application/json")

    def _addressed_here(self) -> bool:
        """Whether the request's Host names this server (any name when it listens on all
        addresses); a Host that is not a host name (``[``) names none."""
        if self.hosts is None:
            return True
        try:
            return urlsplit(f"//{self.headers.get('Host', '')}").hostname in self.hosts
        except ValueError:
            return False

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        """Answer one request. Whatever goes wrong is answered (500 with a JSON error, and one
        line on stderr): the connection is never dropped without an answer."""
        try:
            self._get()
        except ConnectionError:  # the browser went away mid-answer: nobody to tell
            pass
        except Exception as exc:  # noqa: BLE001 (the boundary: every failure becomes an answer)
            error = f"{type(exc).__name__}: {exc}"
            sys.stderr.write(f"agentenv view: GET {self.path[:200]}: {error}\n")
            self._json(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": error})

    def _get(self) -> None:
        # A web page elsewhere can make the browser ask a loopback server under its own host
        # name (DNS rebinding); a loopback viewer answers only requests addressed to it.
        if not self._addressed_here():
            self._send(HTTPStatus.FORBIDDEN, b"not this server's host name\n", "text/plain")
            return
        url = urlsplit(self.path)
        path = url.path
        if path.startswith("/api/"):
            query = {k: v[-1] for k, v in parse_qs(url.query).items()}
            try:
                self._json(HTTPStatus.OK, self.viewer.answer(path, query))
            except NotFound as exc:
                self._json(HTTPStatus.NOT_FOUND, {"error": str(exc)})
            except (ValueError, ConfigError) as exc:
                self._json(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        found = asset("index.html" if path in ("/", "/index.html") else path.removeprefix("/static/"))
        if found is None or (path not in ("/", "/index.html") and not path.startswith("/static/")):
            self._send(HTTPStatus.NOT_FOUND, b"not found\n", "text/plain")
            return
        self._send(HTTPStatus.OK, *found)


class ViewServer:
    """The viewer served on ``host:port`` (port 0: a free one) from a background thread.

        with ViewServer(viewer, port=0) as server:
            print(server.url)
    """

    def __init__(self, viewer: Viewer, host: str = "127.0.0.1", port: int = 0) -> None:
        hosts = (
            None if host in ("", "0.0.0.0", "::") else frozenset({host.strip("[]"), "localhost", "127.0.0.1", "::1"})
        )
        handler = type("Handler", (_Handler,), {"viewer": viewer, "hosts": hosts})
        server = type("Server", (ThreadingHTTPServer,), {"address_family": socket.AF_INET6}) if ":" in host \
            else ThreadingHTTPServer
        try:
            self.httpd = server((host.strip("[]"), port), handler)
        except OSError as exc:  # a busy port has a fix (another port); a bad --host another
            hint = (" (--port 0 takes any free port)" if exc.errno == errno.EADDRINUSE else
                    " (--host must be an address of this machine, e.g. 127.0.0.1 or 0.0.0.0)")
            raise ConfigError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None
        self.httpd.daemon_threads = True
        self.viewer = viewer
        self._thread: threading.Thread | None = None

    @property
    def url(self) -> str:
        host, port = self.httpd.server_address[:2]
        return f"http://{'[' + host + ']' if ':' in str(host) else host}:{port}/"

    def start(self) -> "ViewServer":
        self._thread = threading.Thread(target=self.httpd.serve_forever, name="agentenv-view", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._thread is not None:
            self.httpd.shutdown()
            self._thread.join()
            self._thread = None
        self.httpd.server_close()

    def __enter__(self) -> "ViewServer":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.close()


__all__ = ["NotFound", "ViewServer", "Viewer", "finite"]
