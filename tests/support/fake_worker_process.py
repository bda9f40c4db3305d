"""A model-free worker process: the verifying FakeWorker behind the real worker loop.

Run as `python -m tests.support.fake_worker_process`; settings come from the environment as for
`blockserve worker`, plus FAKE_STEP_DELAY_S and FAKE_TOKEN_DELAY_S to slow steps down (a fixed
time a step, and a time per scheduled token) and FAKE_MODEL_NAME to serve the tiny model under
another name (FAKE_MAX_MODEL_LEN: with a longer context).
"""

import os
import time

import msgspec

from gpu_worker.worker_process import serve_worker
from service import wire
from service.config import load_settings
from service.scheduler.fake_worker import FakeWorker
from tests.support.tiny_model import tiny_model_info


class FakeRunner:
    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int,
        step_delay_s: float,
        model_name: str | None = None,
        token_delay_s: float = 0.0,
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
        self.worker = FakeWorker(num_kv_blocks, block_size, self.model_info.vocab_size, verify_kv=True)

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        time.sleep(self.step_delay_s + self.token_delay_s * step.num_scheduled_tokens)
        return self.worker.execute(step)


if __name__ == "__main__":
    settings = load_settings()
    runner = FakeRunner(
        settings.num_kv_blocks or 64,
        settings.block_size,
        float(os.environ.get("FAKE_STEP_DELAY_S", "0")),
        os.environ.get("FAKE_MODEL_NAME"),
        float(os.environ.get("FAKE_TOKEN_DELAY_S", "0")),
    )
    serve_worker(runner, settings)
