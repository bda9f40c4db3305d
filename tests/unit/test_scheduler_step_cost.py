"""What a scheduler step costs, held by counting, not timing (benchmarks/bench_scheduler_step.py times it): on a
busy server a step reads the waiting queue only as far as the requests it admits, and a decode step crosses to
the worker as deltas, a small fraction of every request re-sent whole."""

import pytest

from service.contract import wire
from tests.support.busy_scheduler import BusyServer, decoding_scheduler, full_state_step

NUM_STEPS = 20


@pytest.mark.parametrize("num_waiting", [100, 1000])
def test_a_busy_step_reads_the_waiting_queue_only_as_far_as_it_admits(num_waiting):
    server = BusyServer(num_running=256, num_waiting=num_waiting)
    admitted, read = [], []
    for _ in range(NUM_STEPS):
        output, num_read = server.step()
        admitted.append(len(output.new_requests))
        read.append(num_read)

    assert len(output.running_requests) == 255 and len(server.scheduler.waiting) == num_waiting
    assert set(admitted) == {1}  # a busy server: every step one request ends and the head of the queue takes its slot
    assert read == admitted  # the queue is read as far as the requests it gives up, never walked


def test_a_decode_step_sent_as_deltas_is_under_a_fiftieth_of_the_full_state():
    scheduler = decoding_scheduler(None)
    step = scheduler.schedule(0.0).output

    deltas, full_state = wire.encode(step), wire.encode(full_state_step(scheduler, step))

    assert wire.decode(deltas) == step and len(step.running_requests) == 64 and step.new_requests == []
    assert len(deltas) * 50 < len(full_state), (len(deltas), len(full_state))
