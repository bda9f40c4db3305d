"""Execute scheduler steps: keep per-request state, run one forward over the mixed batch, sample."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import numpy as np
import paddle

from service.contract import wire
from service.contract.config import Settings
from service.contract.limits import sampling_problem
from worker.inputs.model_inputs import ModelInputs
from worker.inputs.step_inputs import RequestState, StepError, StepInputs, build_step_inputs, fill_pending_tokens
from worker.layers.row_gather import take_rows
from worker.sample.grammar import GrammarMatchers, GrammarRefused, PendingMatcher
from worker.sample.sampler import GREEDY_TEMPERATURE, plain_greedy
from worker.sample.token_mask import TokenMask, masked_argmax
from worker.startup import assemble_worker

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
    mask: TokenMask | None = None  # the grammar masks of the constrained sampling rows masked before the draw
    mask_s: float = 0.0  # filling them
    checked_rows: list[int] = field(default_factory=list)  # constrained greedy rows drawn first, checked after
    refused_rows: set[int] = field(default_factory=set)  # rows whose grammar was refused once built: no token


class ModelRunner:
    """The model, its paged KV cache and the state of the requests the scheduler has sent."""

    def __init__(self, settings: Settings):
        parts = assemble_worker(settings)
        self.device = parts.device
        self.model = parts.model
        self.model_info = parts.model_info
        self.block_size = parts.block_size
        self.num_kv_blocks = parts.num_kv_blocks
        self.kv_cache = parts.kv_cache
        self.attention = parts.attention
        self.step_inputs = parts.step_inputs
        self.sampler = parts.sampler
        self.clock = parts.clock
        self.kernels = parts.reported
        self.kv_cache_move = parts.kv_cache_move  # the thread moving the KV cache into 2 MiB pages, or None
        self.requests: dict[str, RequestState] = {}
        self.grammars = GrammarMatchers(self.model_info)
        # Requests refused for their own parameters, and why: never computed (no token; each result that skips
        # one says why, and the scheduler ends it alone with that reason), until the scheduler says they finished.
        self.refused_requests: dict[str, str] = {}

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
            # The masks fill while the device computes (on a GPU these kernels are only queued).
            started = time.perf_counter()
            refused_rows, checked_rows, mask = self._grammar_rows(inputs.sampling_requests)
            mask_s = time.perf_counter() - started if mask is not None else 0.0
            return LaunchedStep(
                prepared,
                logits,
                model_inputs=model_inputs,
                mask=mask,
                mask_s=mask_s,
                checked_rows=checked_rows,
                refused_rows=refused_rows,
            )
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
                mask = launched.mask
                draw = self.sampler.draw(launched.logits, sampling, mask)
                mask_s = launched.mask_s + draw.mask_s
                self.step_inputs.record(launched.model_inputs, draw.tokens)
                sampled = draw.fetch()  # waits for the device: the step's one copy to the host
                self.clock.finished()
                started = time.perf_counter()
                if launched.checked_rows:
                    self._redraw_refused(launched.logits, sampling, launched.checked_rows, sampled)
                if launched.refused_rows:  # they drew, but their requests end, refused, without the token
                    kept = [row for row in range(len(sampling)) if row not in launched.refused_rows]
                else:
                    kept = range(len(sampling))
                for row in kept:
                    sampling[row].token_ids.append(sampled[row].token_id)
                constrained = sorted([*launched.checked_rows, *([] if mask is None else mask.rows)])
                for row in constrained:
                    self.grammars.advance(sampling[row].matcher, sampled[row].token_id, sampled[row].request_id)
                if constrained:
                    mask_s += time.perf_counter() - started
                return wire.StepResult(
                    step_id=step_id,
                    sampled=[sampled[row] for row in kept] if launched.refused_rows else sampled,
                    refused=self._refusals(prepared.step),
                    grammar_mask_s=mask_s,
                    num_constrained=len(constrained),
                )
        except Exception as exc:
            log.exception("step %d failed", step_id)
            error = f"{type(exc).__name__}: {exc}"
        finally:
            for state in sampling:
                state.awaiting_token = False
        if error:
            return wire.StepResult(step_id=step_id, error=error)
        return wire.StepResult(step_id=step_id, refused=self._refusals(prepared.step))

    def _grammar_rows(self, sampling: list[RequestState]) -> tuple[set[int], list[int], TokenMask | None]:
        """The step's constrained sampling rows, in one pass (a step without any pays one scan): the rows whose
        grammar's template was building and is refused now (GrammarMatchers.begin; their requests refused as at
        arrival: they draw, but get no token), the greedy rows that draw before their grammar is asked
        (sample/grammar.py: where the next inputs are built on the host, so a refused token is drawn again first),
        and the masks of the others."""
        rows = [row for row, state in enumerate(sampling) if state.matcher is not None]
        if not rows:
            return set(), [], None
        refused = set()
        for row in rows:
            state = sampling[row]
            if isinstance(state.matcher, PendingMatcher):
                try:
                    state.matcher = self.grammars.resolve(state.matcher)
                except GrammarRefused as exc:
                    log.warning("refused request %s: %s", state.request_id, exc)
                    self.refused_requests[state.request_id] = str(exc)
                    self.requests.pop(state.request_id, None)
                    state.matcher = None
                    refused.add(row)
        draw_first = self.step_inputs.tokens_on_host
        checked, masked = [], []
        for row in rows:
            if row not in refused:
                greedy = sampling[row].sampling.temperature < GREEDY_TEMPERATURE
                (checked if draw_first and greedy else masked).append(row)
        if not masked:
            return refused, checked, None
        bitmask = self.grammars.fill([sampling[row].matcher for row in masked])
        return refused, checked, TokenMask(np.array(masked, dtype=np.int64), bitmask)

    def _redraw_refused(
        self, logits: paddle.Tensor, sampling: list[RequestState], rows: list[int], sampled: list[wire.SampledToken]
    ) -> None:
        """Each of `rows` (greedy, drawn without their masks) whose token its grammar refuses draws again under
        its mask: the argmax of the allowed tokens, in place in `sampled`. On a CPU a row that asks for nothing
        else (plain_greedy) takes it from the logits in place (NumPy over DLPack: no copy, no op); others draw
        again through the sampler, on their rows alone."""
        refused = [row for row in rows if not self.grammars.accepts(sampling[row].matcher, sampled[row].token_id)]
        if not refused:
            return
        bitmask = self.grammars.fill([sampling[row].matcher for row in refused])
        on_host = logits.place.is_cpu_place()
        by_argmax = [i for i, row in enumerate(refused) if on_host and plain_greedy(sampling[row].sampling)]
        if by_argmax:
            host_logits = np.from_dlpack(logits)
            tokens = masked_argmax(host_logits[[refused[i] for i in by_argmax]], bitmask[by_argmax])
            for i, token_id in zip(by_argmax, tokens):
                sampled[refused[i]] = wire.SampledToken(sampled[refused[i]].request_id, int(token_id))
        if by_draw := [i for i in range(len(refused)) if i not in set(by_argmax)]:
            draw_rows = [refused[i] for i in by_draw]
            redrawn = self.sampler.draw(
                take_rows(logits, paddle.to_tensor(draw_rows, dtype="int64")),
                [sampling[row] for row in draw_rows],
                TokenMask(np.arange(len(by_draw)), bitmask[by_draw]),
            ).fetch()
            for row, token in zip(draw_rows, redrawn):
                sampled[row] = token

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
            try:
                matcher = self._matcher(new)
            except GrammarRefused as exc:
                log.warning("refused request %s: %s", new.request_id, exc)
                self.refused_requests[new.request_id] = str(exc)
                continue
            state = RequestState(
                request_id=new.request_id,
                token_ids=list(new.token_ids),
                num_prompt_tokens=new.num_prompt_tokens,
                sampling=new.sampling,
                block_ids=list(new.block_ids),
                num_computed_tokens=new.num_computed_tokens,
                matcher=matcher,
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

    def _matcher(self, new: wire.NewRequest):
        """The request's grammar matcher at its output so far (a resumed request replays it), a PendingMatcher
        while its grammar's template builds, or None."""
        if new.sampling.grammar is None:
            return None
        return self.grammars.begin(new.sampling.grammar, list(new.token_ids[new.num_prompt_tokens :]))


def _sampling_rows(hidden: paddle.Tensor, logits_indices) -> paddle.Tensor:
    """The rows of `hidden` whose logits are sampled: `hidden` itself where every row is (a step of decodes:
    the indices, increasing and distinct, are then 0..rows-1), a copy of those rows otherwise."""
    if len(logits_indices) == hidden.shape[0]:
        return hidden
    return take_rows(hidden, paddle.to_tensor(logits_indices))
