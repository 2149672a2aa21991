"""Program-aware routing over replicas (pure: no engine)."""

import pytest

from agentenv.engines.routing import Router


def test_a_program_sticks_to_its_replica_and_new_ones_go_where_there_is_kv_room():
    r = Router(2, [1000, 1000])
    assert r.route("big-0", 600, now=0) == 0  # a tie: the first replica
    assert r.route("a-0", 100, now=0) == 1  # more room on 1
    assert r.route("b-0", 100, now=0) == 1  # still more room on 1 (800 free vs 400)
    assert r.route("big-1", 700, now=0) == 0  # it stays where its prefix is, even now
    assert r.held == [700, 200]
    r.release("big")  # finished or paused: its KV no longer counts, its next turn goes anywhere
    assert r.held == [0, 200] and r.where("big") is None
    assert r.route("big-2", 700, now=0) == 0


def test_a_restored_program_goes_where_the_room_is_not_where_it_was():
    r = Router(2, [1000, 1000])
    assert r.route("p-0", 300, now=0) == 0
    for i in range(3):
        assert r.route(f"q{i}-0", 100, now=0) == 1
    r.report(1, 100)  # the replica says the others' programs ended (another client released them)
    r.release("p")  # paused under pressure...
    r.route("z-0", 500, now=0)  # ... while a newcomer took the room on replica 0
    assert r.route("p-1", 400, now=0) == 1  # restored on the replica with room


def test_reports_count_other_clients_programs():
    r = Router(2, [1000, 1000])
    r.report(0, 900)  # another client's programs fill replica 0
    assert r.route("a-0", 50, now=0) == 1
    assert r.route("b-0", 50, now=0) == 1  # 900 held on 0 vs 100 on 1
    r.report(1, 950)  # now replica 1 is the fuller one
    assert r.held == [900, 950]
    assert r.route("c-0", 10, now=0) == 0
    assert r.held == [910, 950]  # the report plus what this router sent since


def test_without_capacities_the_fewest_requests_in_flight():
    r = Router(3)
    r.inflight = [2, 0, 1]
    assert r.route("a-0", 10, now=0) == 1
    r.inflight[1] = 5
    assert r.route("b-0", 10, now=0) == 2


def test_a_failed_replica_gets_no_new_programs_until_its_probe_time():
    r = Router(2, [1000, 1000], probe_after=2.0)
    assert r.route("a-0", 100, now=0) == 0
    r.down(0, now=10)  # its programs are routed afresh
    assert r.where("a") is None and r.held[0] == 0
    assert r.route("a-1", 100, now=10.5) == 1
    assert r.route("b-0", 100, now=11) == 1  # 0 is still down (more room there notwithstanding)
    assert r.route("c-0", 100, now=12.5) == 0  # probe time: back in the choice
    r.down(0, now=13)
    r.down(1, now=13)
    assert r.route("d-0", 10, now=13) in (0, 1)  # all down: still routed somewhere (the call retries)


def test_sticky_routes_are_bounded():
    r = Router(2, [10**6, 10**6], sticky=3)
    for i in range(5):
        r.route(f"p{i}-0", 10, now=0)
    assert sum(r.assigned) == 3 and sum(r.held) == 30


def test_bad_arguments():
    with pytest.raises(ValueError):
        Router(0)
    with pytest.raises(ValueError):
        Router(2, [1])
