"""Execute scheduler steps: keep per-request state, run one forward over the mixed batch, sample."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import paddle

from service import wire
from service.config import Settings
from service.limits import sampling_problem
from worker.attention.custom_kernels import CustomPagedAttention
from worker.attention.kv_cache import KVCache, num_blocks_for
from worker.host.compute_clock import ComputeClock, gpu_event
from worker.host.cpu_memory import keep_freed_memory
from worker.host.huge_pages import collapse
from worker.host.model_to_device import move_model, on_host
from worker.host.placement import activation_bytes, choose_device, kv_cache_budget
from worker.inputs.model_inputs import DeviceInputs, HostInputs, ModelInputs
from worker.inputs.step_inputs import RequestState, StepError, StepInputs, build_step_inputs, fill_pending_tokens
from worker.kernels.selection import CPU_ISA_CAPS, select_kernels
from worker.layers.precision import resolve_precision
from worker.layers.row_gather import take_rows
from worker.loading.model_loader import load_model
from worker.sample.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass
class PreparedStep:
    """A step taken into the worker's state, its inputs built (the previous step's samples pending)."""

    step: wire.SchedulerOutput
    scheduled: list[tuple[RequestState, int]] = field(default_factory=list)
    inputs: StepInputs | None = None  # None: nothing to compute
    attention_metadata: object = None  # or the step's delta, where the inputs are built on the device
    error: str | None = None


@dataclass
class LaunchedStep:
    prepared: PreparedStep
    logits: paddle.Tensor | None = None  # None: nothing to sample
    error: str | None = None
    model_inputs: ModelInputs | None = None


class ModelRunner:
    """The model, its paged KV cache and the state of the requests the scheduler has sent."""

    def __init__(self, settings: Settings):
        compiled_with_cuda = paddle.is_compiled_with_cuda()
        gpu_count = paddle.device.cuda.device_count() if compiled_with_cuda else 0
        self.device = choose_device(settings.device, compiled_with_cuda, gpu_count)
        paddle.set_device(self.device)
        if self.device == "cpu":
            keep_freed_memory()
        choice = select_kernels(settings.kernels, CPU_ISA_CAPS[settings.cpu_isa])
        custom = choice.kernels.name == "custom"
        precision = resolve_precision(
            settings.dtype, settings.quantization, choice.kernels.name, bf16_dot=custom and choice.kernels.isa.bf16
        )
        log.info("kernels: %s (%s)", " ".join(f"{k}={v}" for k, v in choice.describe().items()), choice.reason)
        log.info(
            "device=%s dtype=%s quantization=%s (%s)",
            self.device,
            precision.dtype,
            precision.quantization,
            precision.reason,
        )
        with on_host():  # on a GPU the weights are read in host memory and moved once, cast to the dtype
            # On a CPU with huge pages, the weights in one buffer, so that all of them move into 2 MiB pages.
            loaded = load_model(
                settings, choice.kernels, precision, one_buffer=self.device == "cpu" and settings.huge_pages
            )
        if self.device != "cpu":
            move_model(loaded.model, self.device, precision.dtype)
        weight_bytes = loaded.model.weight_bytes()  # after the move: on a GPU in the precision's dtype
        # Reported in the hello and the scheduler's settings_info (worker_kernels, worker_device, worker_dtype, ...).
        self.kernels = {
            **choice.describe(),
            "device": self.device,
            "dtype": precision.dtype,
            "quantization": precision.quantization,
            "weights_mib": f"{weight_bytes / 2**20:.1f}",
        }
        config = loaded.config
        self.model = loaded.model
        self.model_info = loaded.info
        self.block_size = settings.block_size
        budget = kv_cache_budget(
            int(settings.kv_cache_memory) if "kv_cache_memory" in settings.model_fields_set else None,
            int(settings.kv_cache_memory),
            self.device,
            _free_and_total_memory(self.device),
            settings.gpu_memory_utilization,
            activation_bytes(config, settings.max_num_batched_tokens, settings.max_num_seqs, precision.dtype),
        )
        self.num_kv_blocks = num_blocks_for(
            config, self.block_size, budget.num_bytes, settings.num_kv_blocks, precision.kv_cache_dtype
        )
        self.kv_cache = KVCache(config, self.num_kv_blocks, self.block_size, precision.kv_cache_dtype)
        self.kernels["huge_pages_mib"] = self._move_to_huge_pages(settings) if self.device == "cpu" else "-"
        self.attention = choice.kernels.attention(config, self.block_size, self.model.rotary)
        if choice.kernels.name == "cuda" and isinstance(self.attention, CustomPagedAttention):
            max_blocks = -(-self.model_info.max_model_len // self.block_size)
            self.step_inputs = DeviceInputs(choice.kernels.ops, self.block_size, settings.max_num_seqs, max_blocks)
        else:
            self.step_inputs = HostInputs(self.attention)
        self.clock = ComputeClock(gpu_event if self.device != "cpu" else None)
        self.sampler = Sampler(argmax=choice.kernels.argmax_rows, sample_rows=choice.kernels.sample_rows)
        self.requests: dict[str, RequestState] = {}
        # Requests refused for their own parameters, and why: never computed (no token; each result that skips
        # one says why, and the scheduler ends it alone with that reason), until the scheduler says they finished.
        self.refused_requests: dict[str, str] = {}
        log.info(
            "KV cache on %s: %d blocks of %d tokens, %s, %.1f MiB (%s)",
            self.device,
            self.num_kv_blocks,
            self.block_size,
            self.kv_cache.dtype,
            self.kv_cache.num_bytes / 2**20,
            budget.reason if settings.num_kv_blocks is None else "BLOCKSERVE_NUM_KV_BLOCKS",
        )

    def _move_to_huge_pages(self, settings: Settings) -> str:
        """The weights and the KV cache into 2 MiB pages (worker/host/huge_pages.py) unless BLOCKSERVE_HUGE_PAGES=0;
        the MiB moved, as reported."""
        if not settings.huge_pages:
            log.info("huge pages: off (BLOCKSERVE_HUGE_PAGES=0)")
            return "0.0"
        started = time.perf_counter()
        moved = collapse(self.model.weight_tensors() + self.kv_cache.key_caches + self.kv_cache.value_caches)
        log.info(
            "huge pages: %.1f of the weights' and KV cache's %.1f MiB in 2 MiB pages, in %.2f s%s",
            moved.collapsed_bytes / 2**20,
            moved.tensor_bytes / 2**20,
            time.perf_counter() - started,
            f"; the kernel refused the rest ({moved.refused})" if moved.refused else "",
        )
        return f"{moved.collapsed_bytes / 2**20:.1f}"

    def execute(self, step: wire.SchedulerOutput) -> wire.StepResult:
        """Run one step; a failure becomes StepResult(error=...) rather than an exception."""
        return self.finish(self.launch(self.prepare(step)))

    # A step in three parts, so the worker loop can prepare step N+1 while step N computes:
    # prepare (deltas into state, inputs with N's samples pending), launch (fill them in, run the
    # forward and the logits: on a GPU these only queue kernels), finish (sample: waits for the device).

    def prepare(self, step: wire.SchedulerOutput) -> PreparedStep:
        try:
            return self._prepared(step, self._update_states(step))
        except Exception as exc:
            log.exception("step %d failed", step.step_id)
            return PreparedStep(step, error=f"{type(exc).__name__}: {exc}")

    def _prepared(self, step: wire.SchedulerOutput, scheduled: list[tuple[RequestState, int]]) -> PreparedStep:
        if not scheduled:
            return PreparedStep(step)
        inputs = build_step_inputs(scheduled, self.block_size, self.num_kv_blocks)
        return PreparedStep(step, scheduled, inputs, self.step_inputs.prepare(inputs, scheduled))

    def launch(self, prepared: PreparedStep) -> LaunchedStep:
        if prepared.error is not None or prepared.inputs is None:
            return LaunchedStep(prepared)
        try:
            if lacking := fill_pending_tokens(prepared.inputs):
                # The step before sampled nothing for them (it failed): they alone go without a token.
                log.warning("step %d: %d requests lack their last token", prepared.step.step_id, len(lacking))
                prepared = self._prepared(prepared.step, [(s, n) for s, n in prepared.scheduled if s not in lacking])
                if prepared.inputs is None:
                    return LaunchedStep(prepared)
            inputs = prepared.inputs
            model_inputs = self.step_inputs.launch(inputs, prepared.attention_metadata, prepared.scheduled)
            hidden = self.model.forward(model_inputs, self.kv_cache, self.attention)
            for state, num_scheduled in prepared.scheduled:
                state.num_computed_tokens += num_scheduled
            if not inputs.sampling_requests:
                return LaunchedStep(prepared)
            for state in inputs.sampling_requests:
                state.awaiting_token = True
            logits = self.model.compute_logits(_sampling_rows(hidden, inputs.logits_indices))
            self.clock.launched()
            return LaunchedStep(prepared, logits, model_inputs=model_inputs)
        except Exception as exc:
            log.exception("step %d failed", prepared.step.step_id)
            return LaunchedStep(prepared, error=f"{type(exc).__name__}: {exc}")

    def finish(self, launched: LaunchedStep) -> wire.StepResult:
        prepared = launched.prepared
        step_id = prepared.step.step_id
        error = launched.error or prepared.error
        sampling = prepared.inputs.sampling_requests if prepared.inputs is not None else []
        try:
            if error is None and launched.logits is not None:
                draw = self.sampler.draw(launched.logits, sampling)
                self.step_inputs.record(launched.model_inputs, draw)
                sampled = draw.fetch()  # waits for the device: the step's one copy to the host
                self.clock.finished()
                for state, token in zip(sampling, sampled):
                    state.token_ids.append(token.token_id)
                return wire.StepResult(step_id=step_id, sampled=sampled, refused=self._refusals(prepared.step))
        except Exception as exc:
            log.exception("step %d failed", step_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for state in sampling:
                state.awaiting_token = False
        if error:
            return wire.StepResult(step_id=step_id, error=error)
        return wire.StepResult(step_id=step_id, refused=self._refusals(prepared.step))

    def _refusals(self, step: wire.SchedulerOutput) -> dict[str, str]:
        """Why each refused request of `step` goes without a token."""
        if not self.refused_requests:
            return {}
        request_ids = [r.request_id for r in step.new_requests] + [r.request_id for r in step.running_requests]
        return {i: self.refused_requests[i] for i in request_ids if i in self.refused_requests}

    def forward(self, inputs: StepInputs) -> paddle.Tensor:
        """Write the step's KV into the cache; hidden states [tokens, hidden] after the final norm."""
        model_inputs = ModelInputs(self.attention.prepare(inputs), host_ids=inputs.input_ids)
        return self.model.forward(model_inputs, self.kv_cache, self.attention)

    def remaining_s(self, launched: LaunchedStep) -> float:
        """How long the device may still compute `launched` (0 on a CPU: the forward has finished when
        launch returns); the worker loop waits that long for the next step and prepares it meanwhile."""
        return self.clock.remaining_s() if launched.logits is not None else 0.0

    def _update_states(self, step: wire.SchedulerOutput) -> list[tuple[RequestState, int]]:
        """Apply the step's deltas; return (state, tokens to compute) of every scheduled request."""
        if step.reset:  # a new scheduler: whatever this worker holds belongs to no request any more
            self.requests.clear()
            self.refused_requests.clear()
            self.step_inputs.clear()
        for request_id in (*step.finished_request_ids, *step.preempted_request_ids):
            self.requests.pop(request_id, None)
            self.refused_requests.pop(request_id, None)
            self.step_inputs.release(request_id)
        scheduled = []
        for new in step.new_requests:
            if problem := sampling_problem(new.sampling, self.model_info.vocab_size):
                log.warning("refused request %s: %s", new.request_id, problem)
                self.refused_requests[new.request_id] = problem
                continue
            state = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling=new.sampling,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
            )
            self.requests[new.request_id] = state
            scheduled.append((state, new.num_scheduled_tokens))
        for running in step.running_requests:
            state = self.requests.get(running.request_id)
            if state is None and running.request_id in self.refused_requests:
                continue
            if state is None:
                raise StepError(f"request {running.request_id} is unknown to this worker")
            state.block_ids.extend(running.new_block_ids)
            scheduled.append((state, running.num_scheduled_tokens))
        return [(state, count) for state, count in scheduled if count > 0]


def _sampling_rows(hidden: paddle.Tensor, logits_indices) -> paddle.Tensor:
    """The rows of `hidden` whose logits are sampled: `hidden` itself where every row is (a step of decodes:
    the indices, increasing and distinct, are then 0..rows-1), a copy of those rows otherwise."""
    if len(logits_indices) == hidden.shape[0]:
        return hidden
    return take_rows(hidden, paddle.to_tensor(logits_indices))


def _free_and_total_memory(device: str) -> tuple[int, int] | None:
    """(free, total) bytes of a GPU once Paddle's cache of freed blocks is returned; None on a CPU."""
    if device == "cpu":
        return None
    paddle.device.cuda.empty_cache()
    return paddle.cuda.mem_get_info(device)
