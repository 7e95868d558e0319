"""Chapter 15, section 4: the planner's terms for the small layouts, from the calibrated constants.

The prediction is arithmetic on the calibration and on the calls and bytes a trace records; these
tests hold it to the formulas it composes (chapter 10's ring, the planner's bucket overlap,
chapter 5's bubble), each with a wrong variant it would miss. The runs themselves are checked by
notebook 15 under nbval, and `labs.profiling.planner_check.rank_run` is marked on_cpu.
"""
import pytest

from labs.profiling import planner_check as pc

CAL = {"flops": 1e10, "alpha": 1e-4, "beta": 1e-9}
MB = 1 << 20


def comm(**ops):
    return {f"gloo:{op}": {"calls": calls, "bytes": nbytes} for op, (calls, nbytes) in ops.items()}


def test_a_ring_all_reduce_on_two_ranks_costs_two_alphas_per_call_and_its_bytes_once():
    # 2(p-1) = 2 rounds of alpha, 2(p-1)/p = 1 times the bytes (Patarasuk & Yuan): not p alphas
    assert pc.collective_s("all_reduce", 4, 4 * MB, CAL) == pytest.approx(8e-4 + 4 * MB * 1e-9)
    assert pc.collective_s("send", 4, 4 * MB, CAL) == pytest.approx(4e-4 + 4 * MB * 1e-9)


def test_data_parallel_hides_the_all_reduce_under_backward_but_one_bucket():
    c = comm(all_reduce=(4, 4 * MB), broadcast=(1, 64 * 1024))
    p = pc.predict("dp 2", 3e9, c, CAL)          # compute 0.3 s, backward 0.2 s: the wire fits under it
    reduce = pc.collective_s("all_reduce", 4, 4 * MB, CAL)
    assert p["compute_s"] == pytest.approx(0.3)
    assert p["groups"]["dp all-reduce"] == pytest.approx(reduce / 4)      # the last bucket's share
    assert p["groups"]["dp broadcast"] == pytest.approx(1e-4 + 64 * 1024 * 1e-9)   # before forward
    assert p["comm_s"] == pytest.approx(reduce + p["groups"]["dp broadcast"])      # in flight: all
    assert p["peer_wait_s"] == 0
    slow = dict(CAL, beta=1e-7)                                     # a wire slower than backward
    wire = pc.collective_s("all_reduce", 4, 4 * MB, slow)
    got = pc.predict("dp 2", 3e9, c, slow)["groups"]["dp all-reduce"]
    assert got == pytest.approx(wire - 0.2 + 0.2 / 4)       # what backward cannot cover, one bucket


def test_tensor_parallel_exposes_every_all_reduce_and_a_pipeline_its_bubble():
    tp = pc.predict("tp 2", 1e9, comm(all_reduce=(16, 16 * 262144)), CAL)
    assert tp["exposed_comm_s"] == pytest.approx(pc.collective_s("all_reduce", 16, 16 * 262144, CAL))
    pp = pc.predict("pp 2", 2e9, comm(send=(8, 8 * 32768), recv=(8, 8 * 32768)), CAL)
    m = pc.LAYOUTS["pp 2"][1]["microbatches"]
    assert pp["peer_wait_s"] == pytest.approx(pp["compute_s"] / m)       # (p - 1)/m, p = 2
    one_way = pc.collective_s("send", 8, 8 * 32768, CAL)
    # in flight: its sends and its receives; waited for: the receives alone (an isend does not
    # block). Catches a prediction that charges the sends as exposed, as the trace reader never does
    assert pp["comm_s"] == pytest.approx(2 * one_way)
    assert pp["exposed_comm_s"] == pytest.approx(pc.collective_s("recv", 8, 8 * 32768, CAL))
    assert pp["step_s"] == pytest.approx(pp["compute_s"] + pp["exposed_comm_s"] + pp["peer_wait_s"])


def test_bad_layouts_and_too_few_steps_are_refused_before_any_rank_starts():
    with pytest.raises(ValueError, match="unknown layout"):
        pc.run(layouts=("dp 3",))
    with pytest.raises(ValueError, match="at least 6 steps"):
        pc.run(steps=5)


def test_the_traffic_model_predicts_the_calls_and_bytes():
    # chapter 14's traffic model, not the trace: the tiny GPT's 867,072 fp32 gradients in 1 MiB buckets
    # and the attention masks' broadcast; TP's 4 all-reduces of b s h floats per layer; 1F1B's one
    # send per micro-batch of b s h floats plus the executor's clock
    dp, tp, pp = (pc.traffic(n) for n in ("dp 2", "tp 2", "pp 2"))
    assert dp["gloo:all_reduce"] == {"calls": 4, "bytes": 4 * 867_072}
    assert dp["gloo:broadcast"]["calls"] == 1
    assert tp == {"gloo:all_reduce": {"calls": 16, "bytes": 16 * 8 * 64 * 128 * 4}}
    assert pp["gloo:send"] == pp["gloo:recv"] == {"calls": 4, "bytes": 4 * (2 * 64 * 128 * 4 + 4)}


def test_a_pipeline_rank_is_priced_for_every_message_its_time_in_flight_spans():
    # like with like: `analysis.point_to_point` puts a rank's sends and its receives in flight, and
    # the traffic model lists both; pricing the sends alone (the named mistake) halves the prediction
    traffic = pc.traffic("pp 2")
    p = pc.predict("pp 2", 2e9, traffic, CAL)
    priced = sum(pc.collective_s(op[5:], c["calls"], c["bytes"], CAL) for op, c in traffic.items())
    sends_only = pc.collective_s("send", traffic["gloo:send"]["calls"], traffic["gloo:send"]["bytes"], CAL)
    assert set(traffic) == {"gloo:send", "gloo:recv"}
    assert p["comm_s"] == pytest.approx(priced)
    assert p["comm_s"] != pytest.approx(sends_only)


def test_the_calibration_refuses_an_intercept_below_the_fastest_exchange():
    # the named mistake: a free line's intercept (a fit parameter) used as the latency. On these
    # exchanges the relative-error line undershoots the fastest 4-byte exchange; a latency is never
    # negative, nor below the fastest exchange, so that fit is refused and chapter 10's model passes
    from labs.collectives import alpha_beta
    sizes = pc.SIZES
    fastest = [100e-6, 80e-6, 110e-6, 200e-6, 560e-6]
    median = [2 * t for t in fastest]
    line = alpha_beta.fit_line(sizes, fastest)
    free = [line["alpha"] + n * line["beta"] for n in sizes]
    assert free[0] < fastest[0]
    assert not pc.check_fit(line["alpha"], line["beta"], free, fastest, median)
    m = alpha_beta.model(sizes, [[t] for t in fastest])
    held = [m["alpha"] + n * m["beta"] for n in sizes]
    assert m["alpha"] == fastest[0]
    assert pc.check_fit(m["alpha"], m["beta"], held, fastest, median)
    # and the old band's lower edge, half the fastest, let that intercept through
    assert all(lo / 2 <= p <= 1.5 * t for p, lo, t in zip(free, fastest, median))


def test_the_calibration_refuses_a_beta_off_by_half_or_double():
    # the named mistakes: a beta 2 times too small (or too large) with alpha right. The old band
    # (half the fastest exchange at every size) let the small one through; at the largest size,
    # where beta rules, the line must lie within TOP_BAND of the fastest exchange
    from labs.collectives import alpha_beta
    sizes = pc.SIZES
    fastest = [100e-6, 80e-6, 110e-6, 200e-6, 560e-6]
    median = [2 * t for t in fastest]
    m = alpha_beta.model(sizes, [[t] for t in fastest])

    def line(beta):
        return [m["alpha"] + n * beta for n in sizes]

    assert pc.check_fit(m["alpha"], m["beta"], line(m["beta"]), fastest, median)
    small = line(m["beta"] / 2)
    assert all(f / 2 <= p for p, f in zip(small, fastest))        # inside the old band
    assert not pc.check_fit(m["alpha"], m["beta"] / 2, small, fastest, median)
    assert not pc.check_fit(m["alpha"], 2 * m["beta"], line(2 * m["beta"]), fastest, median)


def test_the_calibration_can_pass_a_doubled_beta_when_the_line_runs_below_the_fastest():
    # stated in the book: where the fitted line lies below the fastest exchange at the largest size
    # (0.74 of it, as in a run of the notebook), twice its beta still lands inside TOP_BAND
    from labs.collectives import alpha_beta
    sizes = pc.SIZES
    fastest = [100e-6, 80e-6, 110e-6, 200e-6, 560e-6]
    median = [2 * t for t in fastest]
    m = alpha_beta.model(sizes, [[t] for t in fastest])
    cal = {"alpha": m["alpha"], "beta": m["beta"], "fastest_s": dict(zip(sizes, fastest)),
           "median_s": dict(zip(sizes, median))}
    low, high = pc.beta_multiples(cal)
    assert 0.5 < low <= 1 <= high < 2                       # the line meets the fastest: refused
    beta = (0.74 * fastest[-1] - m["alpha"]) / sizes[-1]    # a line at 0.74 of the fastest there
    cal["beta"] = beta
    line = [m["alpha"] + n * 2 * beta for n in sizes]
    assert pc.check_fit(m["alpha"], 2 * beta, line, fastest, median)
    assert pc.beta_multiples(cal)[1] >= 2


def test_the_calibration_check_does_not_bound_the_line_by_the_median():
    # what the check does not catch, stated in the book: the line models the fastest exchanges, so
    # a line 30 times below the median exchange at some size passes when it follows the fastest
    from labs.collectives import alpha_beta
    sizes = pc.SIZES
    fastest = [100e-6, 80e-6, 110e-6, 200e-6, 560e-6]
    median = list(fastest)
    median[1] = 30 * fastest[1] * 2
    m = alpha_beta.model(sizes, [[t] for t in fastest])
    held = [m["alpha"] + n * m["beta"] for n in sizes]
    assert held[1] < median[1] / 30
    assert pc.check_fit(m["alpha"], m["beta"], held, fastest, median)


def test_each_step_is_priced_at_the_rate_timed_just_before_it_not_the_calibrations():
    # two ranks, three steps: the rate that prices step i is the ranks' median of their i-th timing
    results = [{"rates": [1e10, 2e10, 3e10]}, {"rates": [3e10, 4e10, 5e10]}]
    rates = pc.step_rates(results)
    assert rates == [2e10, 3e10, 4e10]
    assert CAL["flops"] not in rates      # the named mistake: the pre-run calibration's rate
    assert len(set(rates)) == 3           # and not one rate for every step


def test_a_pipelines_terms_are_its_first_stages_whose_window_is_the_whole_step(monkeypatch):
    # Equal stages, free messages, 1F1B with p = 2, m = 4 (F = 1, B = 2): the first stage idles
    # (p - 1)(F + B) = 3 of its window, (p - 1)/m = 0.25 of its compute of 12, the formula's bubble; the
    # last stage's window ends at its own optimizer step and holds 1 (`schedules.simulate`).
    # The named mistake: the mean over both ranks, 1/6, which no correct formula could match.
    def rows(wait):
        return [{"compute_s": 12.0, "comm_s": 0.0, "exposed_comm_s": 0.0, "peer_wait_s": wait,
                 "idle_s": 0.0, "step_s": 12.0 + wait}] * 6
    per_rank = [rows(3.0), rows(1.0)]
    monkeypatch.setattr(pc.lab, "summarize", lambda results: {
        "per_rank": per_rank, "ranks": [{"comm_by_op": {}}] * 2})
    monkeypatch.setattr(pc, "matmul_seconds", lambda trace: [12.0] * 6)
    results = [{"trace": None, "path": "", "flops": 12e10, "rates": [1e10] * 6}] * 2
    got = pc.compare("pp 2", results, dict(CAL))["terms"]["bubble_share"]
    assert got["measured_s"] == pytest.approx(0.25)
    assert got["ratio"] == pytest.approx(1.0)
