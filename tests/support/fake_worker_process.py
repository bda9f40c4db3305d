"""A model-free worker process: the verifying FakeWorker behind the real worker loop.

Run as `python -m tests.support.fake_worker_process`; settings come from the environment as for
`blockserve worker`, plus FAKE_STEP_DELAY_S and FAKE_TOKEN_DELAY_S to slow steps down (a fixed
time a step, and a time per scheduled token), FAKE_MODEL_NAME to serve the tiny model under
another name (FAKE_MAX_MODEL_LEN: with a longer context) and FAKE_REFUSED_SEED to refuse the
requests with that seed, as the real worker refuses a request for its own parameters (never
computed, the reason in each result).
"""

import os
import time

import msgspec

from service.contract import wire
from service.contract.config import load_settings
from service.tools.fake_worker import FakeWorker
from tests.support.tiny_model import tiny_model_info
from worker.process import serve_worker


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        step_delay_s: float,
        model_name: str | None = None,
        token_delay_s: float = 0.0,
        refused_seed: int | None = None,
    ):
        self.model_info = tiny_model_info()
        if model_name:
            self.model_info = msgspec.structs.replace(self.model_info, name=model_name)
        if max_model_len := int(os.environ.get("FAKE_MAX_MODEL_LEN", "0")):
            self.model_info = msgspec.structs.replace(self.model_info, max_model_len=max_model_len)
        self.kernels: dict[str, str] = {}
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.step_delay_s = step_delay_s
        self.token_delay_s = token_delay_s
        self.refused_seed = refused_seed
        self.refused: dict[str, str] = {}
        self.worker = FakeWorker(num_kv_blocks, block_size, self.model_info.vocab_size, verify_kv=True)

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        time.sleep(self.step_delay_s + self.token_delay_s * step.num_scheduled_tokens)
        if self.refused_seed is None:
            return self.worker.execute(step)
        for request_id in step.finished_request_ids + step.preempted_request_ids:
            self.refused.pop(request_id, None)
        for new in step.new_requests:
            if new.sampling.seed == self.refused_seed:
                self.refused[new.request_id] = f"seed {new.sampling.seed} is refused by this test worker"
        kept = msgspec.structs.replace(
            step,
            new_requests=[r for r in step.new_requests if r.request_id not in self.refused],
            running_requests=[r for r in step.running_requests if r.request_id not in self.refused],
        )
        scheduled = [r.request_id for r in step.new_requests + step.running_requests]
        refusals = {request_id: self.refused[request_id] for request_id in scheduled if request_id in self.refused}
        return msgspec.structs.replace(self.worker.execute(kept), refused=refusals)


if __name__ == "__main__":
    settings = load_settings()
    refused_seed = os.environ.get("FAKE_REFUSED_SEED")
    runner = FakeRunner(
        settings.num_kv_blocks or 64,
        settings.block_size,
        float(os.environ.get("FAKE_STEP_DELAY_S", "0")),
        os.environ.get("FAKE_MODEL_NAME"),
        float(os.environ.get("FAKE_TOKEN_DELAY_S", "0")),
        None if refused_seed is None else int(refused_seed),
    )
    serve_worker(runner, settings)
