"""Shared fixtures: the bundled tiny model on the real embedded engine, real sandboxes."""

from __future__ import annotations

import os

import psutil
import pytest

from agentenv.models import default_model


@pytest.fixture
def anyio_backend():
    return "asyncio"


@pytest.fixture(scope="session")
def model_dir():
    path = os.environ.get("AGENTENV_TEST_MODEL") or str(default_model())
    assert os.path.isfile(os.path.join(path, "config.json")), f"bundled model missing at {path}"
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
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
