"""``agentenv.raycluster``: what every Ray actor of agentenv shares: its options (OpenMP told
not to spin), its CPU share where actors would not fit, the errors of a dead actor, and the
connection to a running cluster."""

from __future__ import annotations

import pytest

from agentenv.raycluster import actor_options, connect, cpu_share, died_errors


def test_actor_options_put_the_callers_over_the_defaults_and_keep_openmp_passive():
    assert actor_options(None, num_cpus=1) == {"num_cpus": 1, "runtime_env": {"env_vars": {"OMP_WAIT_POLICY":
                                                                                          "PASSIVE"}}}
    theirs = {"num_cpus": 2, "runtime_env": {"pip": ["x"], "env_vars": {"A": "1"}}}
    merged = actor_options(theirs, num_cpus=1, max_restarts=0)
    assert merged == {"num_cpus": 2, "max_restarts": 0,
                      "runtime_env": {"pip": ["x"], "env_vars": {"OMP_WAIT_POLICY": "PASSIVE", "A": "1"}}}
    assert theirs == {"num_cpus": 2, "runtime_env": {"pip": ["x"], "env_vars": {"A": "1"}}}  # not changed
    spin = actor_options({"runtime_env": {"env_vars": {"OMP_WAIT_POLICY": "ACTIVE"}}})
    assert spin["runtime_env"]["env_vars"] == {"OMP_WAIT_POLICY": "ACTIVE"}  # the caller's choice stands


class Cluster:
    """The two questions ``cpu_share`` asks Ray (``ray.cluster_resources``, ``ray.nodes``)."""

    def __init__(self, cpus: float, nodes: int, dead: int = 0) -> None:
        self.cpus, self.alive, self.dead = cpus, nodes, dead

    def cluster_resources(self) -> dict:
        return {"CPU": self.cpus}

    def nodes(self) -> list:
        return [{"Alive": True}] * self.alive + [{"Alive": False}] * self.dead


def test_actors_that_would_not_fit_one_node_share_its_cpus_rounded_down():
    assert cpu_share(Cluster(4, 1), 4) is None  # they fit
    assert cpu_share(Cluster(2, 1), 3) == 0.6666  # Ray keeps 4 decimals: down, so three fit in 2
    assert 3 * cpu_share(Cluster(2, 1), 3) <= 2
    assert cpu_share(Cluster(2, 1, dead=3), 8) == 0.25  # dead nodes do not count
    assert cpu_share(Cluster(2, 2), 8) is None  # several nodes: it may be scaling, actors wait for room


def test_a_dead_actors_errors_are_rays():
    ray = pytest.importorskip("ray")
    errors = died_errors()
    assert ray.exceptions.RayActorError in errors and all(issubclass(e, BaseException) for e in errors)


@pytest.mark.slow
def test_a_running_cluster_is_joined_not_started_again(ray_cluster):
    ray, started = connect()
    assert ray is ray_cluster and started is False  # the caller must not shut down a cluster it did not start
    assert cpu_share(ray, 2) is None and cpu_share(ray, 4) == 0.5  # the fixture's cluster has 2 CPUs
