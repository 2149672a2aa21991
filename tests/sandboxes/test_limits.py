"""``Limits``: what a session may use, checked when it is made. A value the session could not
apply (a negative size, a float where the kernel takes a whole number) must never reach a
session: its confinement would fail, and the pool would take that for a host without
isolation (and, with ``allow_unisolated``, run unisolated)."""

from __future__ import annotations

from dataclasses import fields, replace

import pytest

from agentenv.errors import ConfigError
from agentenv.sandboxes.local import LocalSandbox
from agentenv.sandboxes.local.limits import Limits

pytestmark = pytest.mark.anyio
WHOLE = ("memory_mb", "cpu_s", "fsize_mb", "nofile", "pids", "tmp_mb", "shm_mb")


def test_the_defaults_and_every_field_are_valid_as_declared():
    limits = Limits()
    assert {f.name for f in fields(Limits)} == {*WHOLE, "cpus", "seccomp", "uid", "uids", "background"}
    assert replace(limits, cpus=0.0) == limits and replace(limits, cpus=2).cpus == 2  # 0: no cap


@pytest.mark.parametrize("name", WHOLE)
@pytest.mark.parametrize("value", [0, -1, 1.5, True, "64", None])
def test_a_size_or_count_that_is_not_a_positive_whole_number_is_refused_naming_it(name, value):
    with pytest.raises(ConfigError, match=rf"^Limits\.{name} must be a positive whole number .*not {value!r}$"):
        Limits(**{name: value})
    with pytest.raises(ConfigError, match=rf"^Limits\.{name} "):
        replace(Limits(), **{name: value})  # a copy is checked as well


@pytest.mark.parametrize("value", [-0.5, float("nan"), float("inf"), "1", True])
def test_a_cpu_cap_that_is_not_a_number_of_cpus_is_refused(value):
    with pytest.raises(ConfigError, match=r"^Limits\.cpus must be a number of CPUs >= 0"):
        Limits(cpus=value)


@pytest.mark.parametrize("uid, uids", [(0, 10), (-5, 10), (1000, 0), (2**32 - 10, 10), (1.0, 10), (True, 10)])
def test_a_uid_range_that_is_not_all_unprivileged_uids_is_refused(uid, uids):
    with pytest.raises(ConfigError, match=r"^Limits\.uid, Limits\.uids: .* is not a range of unprivileged uids"):
        Limits(uid=uid, uids=uids)


@pytest.mark.parametrize("name", ["seccomp", "background"])
def test_a_switch_is_a_bool(name):
    with pytest.raises(ConfigError, match=rf"^Limits\.{name} must be True or False, not 1$"):
        Limits(**{name: 1})


async def test_a_limit_no_session_could_apply_never_turns_into_an_unisolated_pool():
    # Unchecked, a negative /tmp size fails every session's mount: the pool would read that as
    # a host without isolation and, allowed to, run every session UNISOLATED.
    with pytest.raises(ConfigError, match="tmp_mb"):
        LocalSandbox(limits=Limits(tmp_mb=-1), allow_unisolated=True)
