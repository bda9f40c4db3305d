"""How long the worker may wait for the next step while the device computes (worker/host/compute_clock.py)."""

from worker.host.compute_clock import ComputeClock


class FakeEvent:
    def __init__(self):
        self.recorded = False
        self.done = False

    def record(self):
        self.recorded = True

    def query(self):
        return self.done


class FakeTime:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def test_on_a_cpu_the_step_has_finished_when_launch_returns():
    clock = ComputeClock(None)
    clock.launched()
    assert clock.remaining_s() == 0.0


def test_on_a_gpu_the_last_step_time_less_the_time_since_launch_until_the_event_completes():
    time, events = FakeTime(), []
    clock = ComputeClock(lambda: events.append(FakeEvent()) or events[-1], now=time)
    clock.launched()
    time.now += 0.030
    clock.finished()  # the first step took 30 ms
    clock.launched()
    assert events[-1].recorded
    time.now += 0.010
    assert abs(clock.remaining_s() - 0.020) < 1e-9
    time.now += 0.050  # longer than the last step, still computing: no negative wait
    assert clock.remaining_s() == 0.0
    events[-1].done = True
    assert clock.remaining_s() == 0.0


def test_a_completed_event_means_nothing_left_to_wait_for():
    time, events = FakeTime(), []
    clock = ComputeClock(lambda: events.append(FakeEvent()) or events[-1], now=time)
    clock.launched()
    time.now += 1.0
    clock.finished()
    clock.launched()
    assert clock.remaining_s() > 0.9
    events[-1].done = True
    assert clock.remaining_s() == 0.0
