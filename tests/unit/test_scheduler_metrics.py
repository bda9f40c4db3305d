import random

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from service.scheduler.batch_histogram import BatchHistogram
from service.scheduler.metrics import LATENCY_BUCKETS_S


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_batch_histogram_exposes_what_observing_one_by_one_does():
    rng = random.Random(5)
    edges = [*LATENCY_BUCKETS_S, 700.0]  # exactly on a bound, and past the last one
    steps = [[rng.choice(edges) if rng.random() < 0.3 else rng.expovariate(20) for _ in range(40)] for _ in range(60)]
    one_by_one, batched = CollectorRegistry(), CollectorRegistry()
    reference = Histogram("latency_seconds", "doc", ["model_name"], buckets=LATENCY_BUCKETS_S, registry=one_by_one)
    histogram = BatchHistogram("latency_seconds", "doc", LATENCY_BUCKETS_S, lambda: "m")
    batched.register(histogram)
    for values in steps:
        for value in values:
            reference.labels("m").observe(value)
        histogram.observe_many("m", values)
    expected, got = samples(one_by_one), samples(batched)
    assert got.keys() == expected.keys()
    for key, value in expected.items():
        if key[0].endswith("_sum"):
            assert abs(got[key] - value) < 1e-9 * value, key
        else:
            assert got[key] == value, key


def test_batch_histogram_shows_the_current_model_at_zero_before_any_observation():
    registry = CollectorRegistry()
    registry.register(BatchHistogram("latency_seconds", "doc", (0.1, 1.0), lambda: "m"))
    got = samples(registry)
    assert got[("latency_seconds_count", (("model_name", "m"),))] == 0
    assert got[("latency_seconds_bucket", (("le", "+Inf"), ("model_name", "m")))] == 0
