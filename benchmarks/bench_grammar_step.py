"""The worker's step with every request constrained by a JSON Schema against the same step free, in-process
(ModelRunner with the default settings, no scheduler or sockets): the per-step breakdown behind
bench_structured_outputs.py's service-level ratio.

    OMP_NUM_THREADS=2 python benchmarks/bench_grammar_step.py [--batches 16 64] [--steps 120] [--rounds 2]

Each round runs the free batch, then the constrained one (benchmarks/schemas/readings.json, greedy), B requests
with a random prompt (128 tokens at B <= 16, 32 above) decoding `steps` tokens; the medians of the step, of its
launch (inputs, forward, masks filled before the draw) and finish (draw, checks, draws again, advances), and of
the step's grammar time (StepResult.grammar_mask_s: filling, applying, checking, advancing) are printed.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from worker.host.cpu_threads import set_thread_defaults  # noqa: E402

set_thread_defaults()

from service.api.constraints import Constraint, canonical_json  # noqa: E402
from service.contract import wire  # noqa: E402
from service.contract.config import load_settings  # noqa: E402
from worker.model_runner import ModelRunner  # noqa: E402

SCHEMA = ROOT / "benchmarks" / "schemas" / "readings.json"


class Batches:
    def __init__(self, runner: ModelRunner, grammar: str):
        self.runner, self.grammar = runner, grammar
        self.step_id = 0
        self.rng = np.random.default_rng(0)

    def _execute(self, **fields) -> wire.StepResult:
        self.step_id += 1
        result = self.runner.execute(wire.SchedulerOutput(step_id=self.step_id, **fields))
        assert result.error is None, result.error
        return result

    def run(self, batch: int, steps: int, constrained: bool, tag: str) -> dict[str, float]:
        sampling = wire.SamplingParams(
            temperature=0.0, max_tokens=1 << 20, grammar=self.grammar if constrained else None
        )
        prompt_len = 128 if batch <= 16 else 32
        blocks = -(-(prompt_len + steps + 8) // self.runner.block_size)
        requests = [
            wire.NewRequest(
                request_id=f"{tag}-{i}",
                token_ids=self.rng.integers(100, 40000, prompt_len).tolist(),
                num_prompt_tokens=prompt_len,
                sampling=sampling,
                block_ids=list(range(i * blocks, (i + 1) * blocks)),
                num_computed_tokens=0,
                num_scheduled_tokens=prompt_len,
            )
            for i in range(batch)
        ]
        self._execute(new_requests=requests)
        parts: dict[str, list[float]] = {"step": [], "launch": [], "finish": [], "grammar": []}
        for _ in range(steps):
            self.step_id += 1
            started = time.perf_counter()
            running = [wire.RunningRequest(r.request_id, [], 1) for r in requests]
            launched = self.runner.launch(
                self.runner.prepare(wire.SchedulerOutput(self.step_id, running_requests=running))
            )
            launched_at = time.perf_counter()
            result = self.runner.finish(launched)
            finished_at = time.perf_counter()
            assert result.error is None, result.error
            parts["step"].append(finished_at - started)
            parts["launch"].append(launched_at - started)
            parts["finish"].append(finished_at - launched_at)
            parts["grammar"].append(result.grammar_mask_s)
        self._execute(finished_request_ids=[r.request_id for r in requests])
        return {name: float(np.median(values)) * 1e3 for name, values in parts.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[16, 64])
    parser.add_argument("--steps", type=int, default=120)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    runner = ModelRunner(load_settings(num_kv_blocks=2048))
    grammar = Constraint("json_schema", "bench", canonical_json(json.loads(SCHEMA.read_text()))).grammar()
    batches = Batches(runner, grammar)
    print(f"kernels: {runner.kernels}")
    for batch in args.batches:
        for round_index in range(args.rounds):
            free = batches.run(batch, args.steps, False, f"free-{batch}-{round_index}")
            held = batches.run(batch, args.steps, True, f"json-{batch}-{round_index}")
            print(
                f"B={batch} round {round_index}: step free {free['step']:.2f} ms, constrained {held['step']:.2f} ms "
                f"({held['step'] / free['step']:.3f}x); constrained launch {held['launch']:.2f}, finish "
                f"{held['finish']:.2f}, grammar {held['grammar']:.2f} ms ({100 * held['grammar'] / held['step']:.1f}%)"
            )


if __name__ == "__main__":
    main()
