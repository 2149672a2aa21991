"""Shared fixtures: the bundled tiny model on the real embedded engine, real sandboxes."""

from __future__ import annotations

import os

import psutil
import pytest

from agentenv.models import default_model


def pytest_addoption(parser):
    parser.addoption(
        "--busy-cores", type=int, default=0, metavar="N",
        help="keep N cores busy with spinning processes at normal priority for the whole session "
             "(the suite must pass on a loaded machine: tests wait on events, not on the clock)")
    parser.addoption(
        "--beside", action="store_true", default=False,
        help="run a second, independent pytest run of the fast tier (-m 'not slow') beside this "
             "one for its whole length, from a copy of this checkout with its own temporary "
             "directories, restarted each time it ends (the suite must pass beside other work "
             "of its own kind: a second CI job, a developer's run); its outcome is reported at "
             "the end and its log kept")


# Detached (not children of pytest, so tests that count their own child processes do not see
# them); each spins until the pytest process that started it is gone.
_SPINNER = ("import os, sys\nowner = int(sys.argv[1])\nwhile True:\n    for _ in range(10**6): pass\n"
            "    os.kill(owner, 0)")


def pytest_configure(config):
    import subprocess
    import sys

    n = config.getoption("--busy-cores", 0)
    pids = []
    for _ in range(n):
        out = subprocess.run(["sh", "-c", f'"$0" -c "$1" {os.getpid()} >/dev/null 2>&1 & echo $!',
                              sys.executable, _SPINNER], capture_output=True, text=True, check=True)
        pids.append(int(out.stdout))
    config._busy_spinners = pids
    # The socket files of the vLLM engines and servers the tests start (child processes inherit
    # the variable) in a directory of the run's own, removed when it ends; to the engines it is
    # a directory the user chose.
    import tempfile

    config._vllm_sockets = None
    if "VLLM_RPC_BASE_PATH" not in os.environ:
        config._vllm_sockets = os.environ["VLLM_RPC_BASE_PATH"] = tempfile.mkdtemp(prefix="vllm-", dir="/tmp")
    # Only the run the user started has a run beside it (the one beside never starts another).
    config._beside = None
    if config.getoption("--beside", False) and not os.environ.get("AGENTENV_BESIDE"):
        from .beside import Beside

        config._beside = Beside.start()


def pytest_unconfigure(config):
    import signal

    for pid in getattr(config, "_busy_spinners", []):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if getattr(config, "_beside", None) is not None:
        config._beside.stop()
    if getattr(config, "_vllm_sockets", None):
        import shutil

        shutil.rmtree(config._vllm_sockets, ignore_errors=True)


def pytest_report_header(config):
    lines = []
    n = config.getoption("--busy-cores", 0)
    if n:
        lines.append(f"busy cores: {n} spinning process(es) at normal priority")
    if getattr(config, "_beside", None) is not None:
        lines.append(f"beside: the fast tier runs again and again from {config._beside.root} "
                     f"(log {config._beside.log_path})")
    return lines


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    beside = getattr(config, "_beside", None)
    if beside is not None:
        terminalreporter.write_sep("-", "the run beside")
        for line in beside.outcomes():
            terminalreporter.write_line(line)


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir():
    path = os.environ.get("AGENTENV_TEST_MODEL") or str(default_model())
    assert os.path.isfile(os.path.join(path, "config.json")), f"bundled model missing at {path}"
    return path


@pytest.fixture(scope="session")
def session_engine(model_dir):
    """The bundled model on the embedded engine, one for the session. Opening and closing one
    costs about a second (the close collects the whole process's garbage)."""
    from agentenv.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_dir, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def engine(session_engine):
    """The session's engine: a module's tests leave its weights and version as they found them
    (checked when the module ends). A module that loads weights takes its own (``own_engine``)."""
    version = session_engine.weight_version
    yield session_engine
    assert session_engine.weight_version == version, (
        "this module loaded weights into the session's engine: give it its own (own_engine)")


@pytest.fixture(scope="module")
def own_engine(model_dir):
    """An embedded engine for this module alone, for tests that change its weights or version."""
    from agentenv.engines.embedded import EmbeddedEngine

    eng = EmbeddedEngine(model_dir, seed=0)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def tokenizer(model_dir):
    from agentenv.engines.embedded import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture(scope="session")
def ray_cluster():
    """One real local Ray cluster for the whole session, 2 CPUs (never `ray stop`: it kills
    every Ray process on the host)."""
    import tempfile

    ray = pytest.importorskip("ray")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    tmp = tempfile.mkdtemp(prefix="ray", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
    ray.init(num_cpus=2, include_dashboard=False, object_store_memory=200 * 1024 * 1024, _temp_dir=tmp,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()


def child_pids() -> set[int]:
    return {p.pid for p in psutil.Process().children(recursive=True)}
