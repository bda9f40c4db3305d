import json
from importlib.util import find_spec

import numpy as np
import pytest

from service.launch.cli import main as blockserve
from service.scheduler.scheduler import SchedulerConfig
from service.tools.simulator import simulate
from service.tools.workload import LengthDistribution, Workload, make_trace


def small_trace(seed=3, rate=50.0):
    return make_trace(
        Workload(60, LengthDistribution("uniform", 40), LengthDistribution("chat", 30, max_len=120), rate, seed=seed)
    )


def tight_config(policy="min_recompute"):
    return SchedulerConfig(
        num_blocks=48,
        block_size=8,
        max_num_seqs=16,
        max_num_batched_tokens=128,
        max_model_len=256,
        preemption_policy=policy,
    )


def test_trace_is_seeded():
    first, again, other = small_trace(seed=3), small_trace(seed=3), small_trace(seed=4)
    assert first == again
    assert first != other


@pytest.mark.parametrize("burstiness", [1.0, 0.5, 4.0], ids=["poisson", "bursty", "regular"])
def test_arrivals_are_ordered_with_gamma_gaps_of_mean_one_over_the_rate(burstiness):
    """Shape 1 (the default) is a Poisson process: exponential gaps, their standard deviation their mean."""
    rate, num_requests = 50.0, 20_000
    one_token = LengthDistribution("fixed", 1)
    trace = make_trace(Workload(num_requests, one_token, one_token, rate, burstiness=burstiness, seed=11))

    arrivals = np.array([r.arrival_time_s for r in trace])
    assert arrivals[0] == 0.0 and np.all(np.diff(arrivals) >= 0)
    gaps = np.diff(arrivals)
    # Over 20,000 gaps the mean is off by CV / sqrt(n), 1% at most here, and the CV by 1.3% at shape 0.5: 5% is far.
    expected_cv = 1.0 / np.sqrt(burstiness)
    assert abs(gaps.mean() * rate - 1.0) < 0.05
    assert abs(gaps.std() / gaps.mean() / expected_cv - 1.0) < 0.05
    if find_spec("scipy") is not None:
        from scipy import stats

        shape_test = stats.kstest(gaps, "gamma", args=(burstiness, 0.0, 1.0 / (rate * burstiness)))
        assert shape_test.pvalue > 0.001, shape_test


@pytest.mark.parametrize("overlapped", [False, True], ids=["serial", "overlapped"])
def test_simulation_finishes_every_request_with_all_its_tokens(overlapped):
    trace = small_trace()
    report = simulate(trace, tight_config(), overlapped=overlapped)
    assert report.num_finished == len(trace) and report.num_rejected == 0
    expected_tokens = sum(r.max_tokens for r in trace)
    assert abs(report.output_tokens_per_s * report.duration_s - expected_tokens) < 1e-6 * expected_tokens
    assert report.num_preemptions > 0  # the cache is tight on purpose
    assert 0.0 < report.mean_kv_usage <= 1.0
    assert 0.0 < report.ttft_p50_s <= report.ttft_p99_s


def test_simulation_is_deterministic():
    assert simulate(small_trace(), tight_config()) == simulate(small_trace(), tight_config())


def test_simulate_subcommand_prints_a_report_per_policy(capsys):
    assert blockserve(["simulate", "--num-requests", "40", "--num-blocks", "1024", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [row["scheduler"] for row in rows] == ["lifo", "min_recompute"]
    assert all(row["num_finished"] == 40 for row in rows)
