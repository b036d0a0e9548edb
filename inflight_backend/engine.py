"""The in-flight batch manager's step: schedule, run the model once on the packed tokens, sample, stream.

`InflightEngine` is single-threaded and knows nothing of Triton: the loop in `batch_loop.py` drives it, and
tests and benchmarks can drive it in-process.
"""
from __future__ import annotations

import itertools
import time
from dataclasses import replace

import numpy as np

from .block_manager import BlockManager, blocks_for
from .chat import ChatTemplate
from .checkpoint import load_config, load_tokenizer
from .models.llama_config import LlamaConfig
from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, NoText, byte_fallback_ids, special_ids
from .output_text import OutputText
from .outputs import RequestOutput, RequestTimes
from .runners.base import ModelRunner
from .runners.step_inputs import context_rows
from .request import PromptLimits, PromptTooLarge, Request, RequestError, RequestStatus, SamplingParams
from .request_limits import RequestLimits
from .sampler import Sampler
from .token_rules import TokenInfo, apply_logit_rules, ends_with, token_infos
from .scheduler import Scheduler, SchedulerConfig
from .stats import EngineStats


_BYTES_PER_TOKEN = 32  # default max_prompt_bytes per token of context: above any real tokenizer's average


class InflightEngine:
    def __init__(self, config: EngineConfig, runner: ModelRunner | None = None) -> None:
        self.config = config
        self.model_config = load_config(config.checkpoint)
        self.tokenizer = load_tokenizer(config.checkpoint)
        self.chat_template = ChatTemplate.from_checkpoint(config.checkpoint)
        self.max_model_len = self.model_config.max_position_embeddings
        num_blocks = config.num_kv_blocks or config.max_batch_size * blocks_for(self.max_model_len,
                                                                                 config.block_size)
        self.blocks = BlockManager(num_blocks, config.block_size, config.enable_kv_cache_reuse)
        self.scheduler = Scheduler(SchedulerConfig.from_engine_config(config), self.blocks)
        self.runner = runner or _make_runner(config, num_blocks, self.model_config)
        self.request_limits = RequestLimits(self.runner.vocab_size, self.max_model_len, config.block_size,
                                            num_blocks, config.max_num_tokens, config.enable_chunked_prefill,
                                            context_logits=config.engine != "tensorrt")
        self.sampler = Sampler()
        self.stats = EngineStats(kv_blocks_total=num_blocks)
        self._requests: dict[str, Request] = {}
        self._texts: dict[str, OutputText] = {}
        self._special_ids = special_ids(self.tokenizer)
        self._byte_ids = byte_fallback_ids(self.tokenizer)
        self._context_logits: dict[str, list] = {}  # return_context_logits: the prompt's rows so far
        self._num_raw_logits = 0  # open requests that need their rows' logits before the rules change them
        self._num_all_logits = 0  # open requests whose steps need every logit exact (not a greedy screen's)
        self._seeds = itertools.count(config.seed * 1_000_003)

    @property
    def eos_ids(self) -> tuple[int, ...]:
        return self.model_config.eos_token_ids

    def has_unfinished(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def open_request_ids(self) -> list[str]:
        return list(self._requests)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`. Safe from any thread; encode_batch releases the GIL (encode holds it), so a
        long prompt being tokenized does not stall the engine and responder threads. A prompt over
        max_prompt_tokens is refused before its ids become a Python list (millions of objects, built and later
        freed under the GIL)."""
        encoding = self.tokenizer.encode_batch([text])[0]
        limit = self.prompt_limits().max_tokens
        if len(encoding) > limit:
            raise PromptTooLarge(f"the prompt is {len(encoding)} tokens; the limit is {limit} (max_prompt_tokens)")
        return encoding.ids

    def encode_chat(self, messages: list[dict]) -> tuple[str, list[int]]:
        """Messages rendered with the checkpoint's chat template, and the text's ids (no special tokens added: the
        template writes them). Safe from any thread."""
        if self.chat_template is None:
            raise RequestError("input 'messages': this model's checkpoint has no chat template "
                               "(tokenizer_config.json)")
        text = self.chat_template.render(messages)
        encoding = self.tokenizer.encode_batch([text], add_special_tokens=False)[0]
        return text, encoding.ids

    def prompt_limits(self) -> PromptLimits:
        """What the entry checks before decoding and tokenizing a prompt (parameters, else from the context)."""
        return PromptLimits(self.config.max_prompt_bytes or _BYTES_PER_TOKEN * self.max_model_len,
                            self.config.max_prompt_tokens or self.max_model_len - 1)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        """Raise RequestError if this request can never be served (request_limits.py). Safe from any thread."""
        self.request_limits.check(prompt_ids, params)

    def add_request(self, req_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, share_prompt_with: str | None = None) -> None:
        """`share_prompt_with`: an open request with the same prompt (another sequence of it): once that one has
        computed the prompt, this one takes its full blocks instead of computing them again."""
        self.validate(prompt_ids, params)
        if req_id in self._requests:
            raise RequestError(f"request id {req_id!r} is already running")
        if not params.greedy and params.seed is None:
            params = replace(params, seed=next(self._seeds))
        request = Request(req_id, list(prompt_ids), params, priority=priority)
        source = self._requests.get(share_prompt_with) if share_prompt_with is not None else None
        if source is not None and source.prompt_ids == request.prompt_ids and not params.return_context_logits:
            request.prefix_source = source
        if arrival_time is not None:
            request.arrival_time = arrival_time
        self._requests[req_id] = request
        self._num_raw_logits += params.needs_raw_logits
        self._num_all_logits += params.needs_all_logits
        detok = (IncrementalDetokenizer(self.tokenizer, self._special_ids, prompt_ids, self._byte_ids)
                 if params.detokenize or params.stop_words else NoText())
        self._texts[req_id] = OutputText(detok, params.stop_words, cut=not params.include_stop_str_in_output)
        self.scheduler.add(request)

    def abort(self, req_id: str, status: RequestStatus = RequestStatus.FINISHED_CANCELLED) -> RequestOutput | None:
        """End a request between steps and free its blocks; returns its final output, or None if unknown."""
        request = self._requests.get(req_id)
        if request is None:
            return None
        output = self._finish(request, status, [], "")
        self.stats.record_queues(self.scheduler)
        return output

    def step(self) -> list[RequestOutput]:
        """One iteration: schedule, run once on the packed tokens, sample, update. Returns new outputs."""
        start = time.perf_counter()
        sched = self.scheduler.schedule()
        scheduled = modelled = time.perf_counter()
        outputs: list[RequestOutput] = []
        if not sched.is_empty:
            screened = self.runner.screens_greedy and not self._num_all_logits
            try:
                logits = self.runner.execute(sched, greedy_only=True) if screened else self.runner.execute(sched)
            except Exception as exc:  # the model failed: end this step's requests; the waiting ones go on
                return self._fail_step(sched, exc)
            modelled = time.perf_counter()
            sampled = [item.request for item in sched.scheduled if item.sample]
            if logits.shape[0] > len(sampled):
                self._collect_context_logits(sched, logits[len(sampled):])
                logits = logits[:len(sampled)]
            params = [r.params for r in sampled]
            raw_rows = [row for row, p in enumerate(params) if p.needs_raw_logits] if self._num_raw_logits else []
            raw = logits[raw_rows].float() if raw_rows else None  # a copy, before the rules change the rows
            apply_logit_rules(logits, sampled, self.eos_ids)
            if screened:
                try:
                    self.runner.refine_greedy(logits)
                except Exception as exc:
                    return self._fail_step(sched, exc)
            token_ids, failed = self.sampler.sample(logits, [r.req_id for r in sampled], params)
            now = time.monotonic()
            bad = {sampled[row].req_id: why for row, why in failed.items()} if failed else None
            infos = None
            if raw is not None:
                kept = [j for j, row in enumerate(raw_rows) if bad is None or row not in failed]
                rows = [raw_rows[j] for j in kept]
                found = token_infos(raw if len(kept) == len(raw_rows) else raw[kept], [token_ids[row] for row in rows],
                                    [params[row] for row in rows])
                infos = {sampled[row].req_id: info for row, info in zip(rows, found)}
            plain = infos is None and not self._context_logits  # nothing but the token to report
            for request in self.scheduler.update(sched, token_ids):
                if bad is not None and request.req_id in bad:
                    outputs.append(self._fail_sampled(request, bad[request.req_id]))
                    continue
                try:
                    outputs.append(self._advance(request, now) if plain else self._postprocess(request, now, infos))
                except Exception as exc:  # a failure here ends this request alone
                    outputs.append(self.fail(request, f"processing the output failed: {type(exc).__name__}: {exc}"))
        end = time.perf_counter()
        self.scheduler.step_took(sched, end - start)
        self.stats.record(sched, self.scheduler, (start, scheduled, modelled, end))
        return outputs

    def _fail_step(self, sched, exc: Exception) -> list[RequestOutput]:
        message = f"engine step failed: {type(exc).__name__}: {exc}"
        return [self.fail(item.request, message) for item in sched.scheduled]

    def fail(self, request: Request, message: str) -> RequestOutput:
        """End one request with an error between steps; its blocks are freed."""
        output = self._finish(request, RequestStatus.FINISHED_ERROR, [], "")
        output.error = message
        self.stats.record_queues(self.scheduler)
        return output

    def fail_all(self, message: str) -> list[RequestOutput]:
        """End every unfinished request with an error."""
        return [self.fail(r, message) for r in list(self._requests.values())]

    def _fail_sampled(self, request: Request, message: str) -> RequestOutput:
        request.output_ids.pop()  # the placeholder the scheduler appended for the row that could not be sampled
        return self.fail(request, message)

    def _postprocess(self, request: Request, now: float, infos: dict[str, TokenInfo] | None) -> RequestOutput:
        """_advance, plus what the request asked to know about the token: its log-probabilities or logits, and
        (with the first token) the prompt's logits."""
        context = None
        if request.req_id in self._context_logits and request.num_context_logits == request.num_prompt_tokens:
            context = self._context_logits.pop(request.req_id)  # the prompt's logits, complete: they go now
        output = self._advance(request, now)
        if infos is not None:
            output.token_info = infos.get(request.req_id)
        if context is not None:
            output.context_logits = np.stack(context)
        return output

    def _collect_context_logits(self, sched, rows) -> None:
        """The prompt logits computed this step (after the sampled rows, in schedule order), kept per request."""
        rows = rows.float().cpu().numpy()
        at = 0
        for item in sched.scheduled:
            positions = context_rows(item)
            if positions:
                self._context_logits.setdefault(item.request.req_id, []).extend(rows[at:at + len(positions)])
                item.request.num_context_logits = positions.stop
                at += len(positions)

    def _advance(self, request: Request, now: float) -> RequestOutput:
        """The new token's text and whether the request ends."""
        if request.first_token_time is None:
            request.first_token_time = now
        request.last_token_time = now
        token = request.output_ids[-1]
        out_text = self._texts[request.req_id]
        text = out_text.detok.add(token)
        p = request.params
        stop = self._stop(request, token, text, out_text) if len(request.output_ids) >= p.min_tokens else None
        held = out_text.holds
        if held:  # the text that could begin a stop string waits until it cannot
            text = out_text.release(stop and stop[0])
        if stop is not None:
            output = self._finish(request, RequestStatus.FINISHED_STOPPED, [token], text,
                                  flush=stop[0] < 0 or not held)
            output.stop_reason = stop[1]
            return output
        if len(request.output_ids) >= p.max_tokens:
            return self._finish(request, RequestStatus.FINISHED_LENGTH, [token], text)
        return RequestOutput(request.req_id, [token], text, token_time=now)

    def _stop(self, request: Request, token: int, delta: str,
              out_text: OutputText) -> tuple[int, str | None] | None:
        """None: go on. Else (where, why): where -1 for a token, or the index in the request's text where a stop
        string starts; why: the stop string or token id (None for the end token)."""
        p = request.params
        if (token == p.end_id) if p.end_id is not None else (token in self.eos_ids):
            return -1, None
        if p.stop_token_seqs and any(ends_with(request.output_ids, seq) for seq in p.stop_token_seqs):
            return -1, str(token)
        return out_text.stop_string(delta) if delta and p.stop_words else None

    def _finish(self, request: Request, status: RequestStatus, token_ids: list[int], text: str,
                flush: bool = True) -> RequestOutput:
        self.scheduler.finish(request, status)
        self.sampler.forget(request.req_id)
        del self._requests[request.req_id]
        self._num_raw_logits -= request.params.needs_raw_logits
        self._num_all_logits -= request.params.needs_all_logits
        text += self._texts.pop(request.req_id).rest(status, flush)
        self._context_logits.pop(request.req_id, None)
        times = RequestTimes(request.arrival_time, request.first_scheduled_time, request.first_token_time,
                             request.last_token_time, time.monotonic())
        request.prefix_source = None  # (no chain of finished requests kept alive)
        return RequestOutput(request.req_id, token_ids, text, status.finish_reason, request.num_prompt_tokens,
                             len(request.output_ids), token_time=request.last_token_time or 0.0, times=times,
                             num_shared_blocks=request.num_shared_blocks,
                             num_cached_tokens=request.num_shared_blocks * self.blocks.block_size)


def _make_runner(config: EngineConfig, num_blocks: int, model: LlamaConfig) -> ModelRunner:
    if config.engine == "null":
        from .runners.null_runner import NullRunner

        return NullRunner(model.vocab_size, model.eos_token_ids)
    if config.engine == "tensorrt":
        from .runners.tensorrt_runner import TensorRTRunner

        return TensorRTRunner(config.engine_path, num_blocks, config.block_size)
    from .runners.torch_runner import TorchRunner

    device = config.resolved_device()
    dtype = config.dtype if config.dtype != "auto" else ("bfloat16" if device == "cuda" else "float32")
    return TorchRunner(config.checkpoint, num_blocks, config.block_size, device, dtype, config.attention_backend,
                       config.linear_backend, config.amx_gemm, config.cuda_graphs, config.max_batch_size,
                       config.greedy_screen, config.cuda_fused_ops)
