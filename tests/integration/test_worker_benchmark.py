"""benchmarks/bench_worker.py runs (one short case, on a tiny random model of Llama's layers): the figures the README and closing notes quote come
from it, so it must not rot; its ISA cap reaches the worker."""

from __future__ import annotations

import functools
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

from service.contract import wire
from tests.support.processes import ROOT
from tests.support.tiny_families import save_tiny_model


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory, hf_smollm_tokenizer) -> str:
    """A 2-layer random model of Llama's layers (ERNIE 4.5's: the fused decoder stack runs it, as it runs SmolLM2):
    the harness is what these tests check, and SmolLM2's 30 layers took ~5 minutes of CI."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    save_tiny_model("ernie4_5", folder, hf_smollm_tokenizer, num_hidden_layers=2)
    return str(folder)


@pytest.fixture
def bench_worker(monkeypatch, tiny_llama):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import bench_worker

    monkeypatch.setattr(bench_worker, "MODEL", tiny_llama)

    monkeypatch.setattr(bench_worker, "DECODE_BATCHES", (1, 2))
    monkeypatch.setattr(bench_worker, "PREFILLS", ((1, 20),))
    # The cases are run_precisions' defaults, bound when it was defined: short ones here.
    short = functools.partial(bench_worker.run_precisions, decode_batches=(1, 2), prefills=((1, 20),))
    monkeypatch.setattr(bench_worker, "run_precisions", short)
    yield bench_worker
    sys.modules.pop("bench_worker", None)


@pytest.mark.parametrize("op_by_op", [False, True])
def test_bench_worker_times_each_case_on_the_capped_instruction_set(bench_worker, op_by_op):
    probe = bench_worker.ReadProbe()
    [run] = bench_worker.run_precisions(["custom:bfloat16:none:avx2"], steps=2, op_by_op=op_by_op, probe=probe)

    assert run.described["kernels_isa"] == "avx2" and run.described["dtype"] == "bfloat16"
    assert [case[:2] for case in run.cases] == [("decode B=1", 1), ("decode B=2", 2), ("prefill 1x20", 20)]
    # The read bandwidth the B=1 step is held against: one read before each of its timed steps, no others.
    assert len(run.read_bandwidths) == 2 and all(bandwidth > 0 for bandwidth in run.read_bandwidths)
    for _, _, seconds, parts, _ in run.cases:
        assert seconds > 0 and parts["sampling"] > 0
        # Fused, the stack's own stage clock times its matmuls and attention, as the timers do op by op.
        assert parts["attention"] > 0 and parts["linear matmuls"] > 0
        assert parts["attention"] + parts["linear matmuls"] + parts["sampling"] < seconds
    assert run.weight_bytes > 0


def test_bench_worker_requests_sample_as_asked(bench_worker):
    """--temperature/--top-p/--top-k reach every request, and a run with them times its draw."""
    top_p = wire.SamplingParams(temperature=0.8, top_p=0.9, max_tokens=bench_worker.GREEDY.max_tokens)
    asked = bench_worker.Workload(SimpleNamespace(block_size=16), top_p).new_requests(3, 5, room=2)
    default = bench_worker.Workload(SimpleNamespace(block_size=16)).new_requests(2, 5, room=2)
    assert [request.sampling for request in asked] == [top_p] * 3
    assert [request.sampling for request in default] == [bench_worker.GREEDY] * 2

    [run] = bench_worker.run_precisions(
        ["custom:float32:none"], steps=2, op_by_op=False, probe=bench_worker.ReadProbe(), sampling=top_p
    )

    for _, _, seconds, parts, _ in run.cases:
        assert 0 < parts["sampling"] < seconds


def test_bench_worker_compares_kv_caches_of_two_dtypes_in_one_run(bench_worker, capsys):
    """KERNELS:DTYPE:QUANTIZATION:ISA_CAP:KV_CACHE_DTYPE: each precision serves from a cache of the dtype it asks
    for, its attention timed, and the attention table holds each beside the first."""
    names = ["custom:float32:none:all:bfloat16", "custom:float32:none:all:int8"]
    runs = bench_worker.run_precisions(
        names, steps=2, op_by_op=False, probe=bench_worker.ReadProbe(), decode_batches=(2,)
    )

    assert [run.kv_cache_dtype for run in runs] == ["bfloat16", "int8"]
    for run in runs:
        assert [case[0] for case in run.cases] == ["decode B=2", "prefill 1x20"]
        assert all(parts["attention"] > 0 for _, _, _, parts, _ in run.cases)
    bench_worker.print_attention(runs, runs[0])
    printed = capsys.readouterr().out
    assert "KV cache: bfloat16, int8" in printed
    int8_decode = runs[1].cases[0][3]["attention"] / runs[0].cases[0][3]["attention"]
    assert f"({int8_decode:.2f}x)" in printed.splitlines()[3]
    # Each round's attention, the median step's among them; the paired table: the median of round-by-round ratios.
    rounds = [run.cases[0][4] for run in runs]
    for run, own in zip(runs, rounds):
        assert len(own) == 2 and all(seconds > 0 for seconds in own) and run.cases[0][3]["attention"] in own
    paired = float(np.median([int8 / bf16 for int8, bf16 in zip(rounds[1], rounds[0])]))
    lines = printed.splitlines()
    paired_decode = lines[lines.index(next(line for line in lines if line.startswith("attention paired"))) + 1]
    assert paired_decode.startswith("decode B=2") and paired_decode.split()[-1] == f"{paired:.3f}x"


def test_bench_worker_precisions_take_turns_step_by_step(bench_worker, monkeypatch):
    """Two precisions in one run: their timed steps alternate (each after an untimed one of its own), each
    B=1 step gets its own read, and each precision's figures are its own."""
    timed_by = []
    timed = bench_worker.Subject.timed

    def recording(subject, run_step):
        timed_by.append(subject.name)
        return timed(subject, run_step)

    monkeypatch.setattr(bench_worker.Subject, "timed", recording)
    import worker.model_runner as model_runner_module

    building = model_runner_module.build_step_inputs

    def slow_building(*args, **kwargs):  # every runner's step building, at least 2 ms
        time.sleep(0.002)
        return building(*args, **kwargs)

    monkeypatch.setattr(model_runner_module, "build_step_inputs", slow_building)
    probe = bench_worker.ReadProbe()
    names = ["custom:float32:none", "custom:bfloat16:none:avx2"]

    runs = bench_worker.run_precisions(names, steps=3, op_by_op=False, probe=probe, decode_batches=(1,))

    fp32, bf16 = names
    decode, prefill = timed_by[:6], timed_by[6:]
    assert decode == [fp32, bf16, bf16, fp32, fp32, bf16]  # the first place rotates every round
    assert prefill == [fp32, bf16, bf16, fp32, fp32, bf16]  # prefills: max(3, steps // 3) rounds
    assert [run.name for run in runs] == names
    assert [run.described["dtype"] for run in runs] == ["float32", "bfloat16"]
    assert runs[0].weight_bytes > runs[1].weight_bytes
    assert [len(run.read_bandwidths) for run in runs] == [3, 3]
    assert probe.bandwidths == [
        runs[0].read_bandwidths[0],
        runs[1].read_bandwidths[0],
        runs[1].read_bandwidths[1],
        runs[0].read_bandwidths[1],
        runs[0].read_bandwidths[2],
        runs[1].read_bandwidths[2],
    ]
    for run in runs:
        assert [case[:2] for case in run.cases] == [("decode B=1", 1), ("prefill 1x20", 20)]
        # Each precision's parts are timed by its own timers (the runners share the step-building module).
        for _, _, seconds, parts, _ in run.cases:
            assert seconds > parts["input building"] >= 0.002 and parts["sampling"] > 0


def test_turns_give_every_precision_one_step_a_round_and_rotate_the_first(bench_worker):
    rounds = bench_worker.turns(3, 4)

    assert [sorted(order) for order in rounds] == [[0, 1, 2]] * 4
    assert [order[0] for order in rounds] == [0, 1, 2, 0]
    assert bench_worker.turns(1, 2) == [[0], [0]]
