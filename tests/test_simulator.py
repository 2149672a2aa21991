"""The discrete-event simulator: its engine fit and its clock, checked against hand-worked cases."""

from __future__ import annotations

import pytest

from agentenv.scheduler import Scheduler, SchedulerConfig
from agentenv.simulator import EngineModel, fit_engine, fit_prefill, simulate
from agentenv.workload import ProgramTrace, WorkloadSpec, workload


def rates_of(m: EngineModel, points) -> dict:
    return {(b, c): m.decode_rate(b, c) for b, c in points}


def test_fit_engine_recovers_step_time_per_request_and_per_context_token():
    truth = EngineModel(step_base=0.005, step_per_seq=1e-4, step_per_ctx=5e-7)
    m = fit_engine(rates_of(truth, [(1, 400), (4, 400), (16, 400), (32, 400), (32, 800)]),
                   kv_capacity=4096, block_size=32, prefill_per_token=7e-5)
    assert m.step_base == pytest.approx(0.005, rel=1e-6)
    assert m.step_per_seq == pytest.approx(1e-4, rel=1e-6)
    assert m.step_per_ctx == pytest.approx(5e-7, rel=1e-6)
    assert (m.kv_capacity, m.block_size, m.prefill_per_token) == (4096, 32, 7e-5)


def test_fit_engine_at_one_context_folds_attention_into_the_per_request_term():
    truth = EngineModel(step_base=0.004, step_per_seq=1e-4, step_per_ctx=5e-7)
    m = fit_engine(rates_of(truth, [(1, 400), (4, 400), (32, 400)]), kv_capacity=4096, block_size=32)
    assert m.step_per_ctx == 0.0
    assert m.step_per_seq == pytest.approx(1e-4 + 5e-7 * 400, rel=1e-6)
    for b in (1, 4, 32):  # the same rates where it was measured
        assert m.decode_rate(b, 400) == pytest.approx(truth.decode_rate(b, 400), rel=1e-6)


def test_fit_engine_never_fits_a_negative_cost():
    # Noise that makes a longer context look faster: the attention term is dropped, not negative.
    rates = {(1, 400): 200.0, (32, 400): 2000.0, (32, 800): 2100.0}
    m = fit_engine(rates, kv_capacity=4096, block_size=32)
    assert m.step_per_ctx == 0.0 and m.step_per_seq >= 0.0 and m.step_base > 0.0
    with pytest.raises(ValueError):
        fit_engine({}, kv_capacity=1, block_size=1)


def test_fit_prefill_recovers_the_price_of_a_prompt_token():
    warm, turn, extra, cost = 2000.0, 50, 384, 7e-5
    cold = turn / (turn / warm + extra * cost)
    assert fit_prefill(warm, cold, turn, extra) == pytest.approx(cost, rel=1e-9)
    assert fit_prefill(warm, warm * 1.01, turn, extra) == 0.0  # noise: never negative
    with pytest.raises(ValueError):
        fit_prefill(warm, cold, turn, 0)


def test_one_program_takes_its_decode_steps_prefill_and_tool_time():
    # 10 then 20 tokens at 10 ms a step, one 0.5 s tool call between; prefill 1 ms a token:
    # the 64-token prompt, then the resume's uncached tail (74 tokens computed, 64 of them in
    # two full 32-token blocks, so 74 - 64 + 4 tool tokens = 14).
    m = EngineModel(step_base=0.01, step_per_seq=0.0, prefill_per_token=0.001, kv_capacity=4096, block_size=32)
    trace = ProgramTrace(turn_tokens=(10, 20), tool_tokens=(4,), tool_latency=(0.5,), prompt_tokens=64)
    r = simulate([trace], m, "program", concurrency=4, needs_session=False)
    assert r.wall_s == pytest.approx(30 * 0.01 + 0.5 + (64 + 14) * 0.001, rel=1e-9)
    assert r.tokens == 30 and r.reuse == 1.0 and r.pauses == 0
    # A slower engine (every cost doubled) doubles the engine's share, not the tool's.
    slow = simulate([trace], m.slowed(2.0), "program", concurrency=4, needs_session=False)
    assert slow.wall_s == pytest.approx(2 * (30 * 0.01 + 78 * 0.001) + 0.5, rel=1e-9)


@pytest.mark.parametrize("policy", ["program", "fifo", "lockstep"])
def test_every_program_finishes_and_samples_its_trace_under_kv_pressure(policy):
    traces = [p for g in workload(WorkloadSpec(mean_turns=4, tool_median=0.2), 16, 4, seed=3) for p in g]
    small = EngineModel(kv_capacity=4096, block_size=32)
    r = simulate(traces, small, policy, concurrency=8, group_size=4)
    assert r.tokens == sum(sum(t.turn_tokens) for t in traces)
    assert r.programs == 64 and r.wall_s > 0
    if policy == "program":
        assert r.pauses > 0 and r.restores > 0  # the working set did not fit


def test_the_engine_costs_decide_how_long_acting_programs_keep_their_kv():
    traces = [p for g in workload(WorkloadSpec(mean_turns=4, tool_median=0.2), 32, 4, seed=3) for p in g]
    free = EngineModel(kv_capacity=4096, block_size=32, prefill_per_token=0.0)
    held = simulate(traces, free, "program", concurrency=16, group_size=4, cost=None)
    costed = simulate(traces, free, "program", concurrency=16, group_size=4)
    # A re-prefill that costs nothing is never worth a slot: acting programs give their KV up
    # to waiting ones, more requests run, the run is shorter (and reuses less).
    assert costed.acting_kv < held.acting_kv and costed.in_flight > held.in_flight
    assert costed.wall_s < held.wall_s and costed.reuse < held.reuse
    assert costed.tokens == held.tokens == sum(sum(t.turn_tokens) for t in traces)
    # With re-prefill dear (a slot adds little against it), they keep it as they did.
    dear = EngineModel(kv_capacity=4096, block_size=32, prefill_per_token=1.0)
    assert simulate(traces, dear, "program", concurrency=16, group_size=4).row() == \
        simulate(traces, dear, "program", concurrency=16, group_size=4, cost=None).row()


def test_the_former_env_parameter_names_still_run_the_same_simulation_with_a_warning():
    """``needs_env``, ``env_start_s``, ``env_lookahead`` and ``env_workers`` were the session
    parameters' names: still taken (deprecated), the same run as under the new ones."""
    traces = [t for g in workload(WorkloadSpec(mean_turns=3, tool_median=0.1), 6, 2, seed=3) for t in g]
    m = EngineModel(kv_capacity=8192, block_size=32)
    new = simulate(traces, m, "program", concurrency=4, group_size=2, session_start_s=0.3, session_lookahead=2,
                   session_workers=1)
    with pytest.warns(DeprecationWarning, match="env_start_s"):
        old = simulate(traces, m, "program", concurrency=4, group_size=2, env_start_s=0.3, env_lookahead=2,
                       env_workers=1, needs_env=True)
    assert old == new and new.wall_s > simulate(traces, m, "program", concurrency=4, group_size=2).wall_s
    with pytest.raises(TypeError, match="env_spin"):
        simulate(traces, m, "program", env_spin=1)


def test_a_scheduler_subclass_runs_in_place_of_the_scheduler():
    """``scheduler=`` makes the scheduler the simulation drives (a variant studied on the same
    engine and traces): one that decides as the scheduler does gives the very same run, and it
    is the one driven."""
    made: list[Scheduler] = []

    class Counted(Scheduler):
        def __init__(self, config: SchedulerConfig) -> None:
            super().__init__(config)
            self.decisions = 0
            made.append(self)

        def schedule(self, now: float | None = None):
            self.decisions += 1
            return super().schedule(now)

    traces = [p for g in workload(WorkloadSpec(mean_turns=3, tool_median=0.2), 8, 4, seed=1) for p in g]
    m = EngineModel(kv_capacity=2048, block_size=32)
    assert simulate(traces, m, "program", concurrency=8, group_size=4, scheduler=Counted) == \
        simulate(traces, m, "program", concurrency=8, group_size=4)
    assert len(made) == 1 and made[0].decisions > len(traces)
