"""Every input and output name the inflight models declare, with Triton types and shapes (`auto_complete_config`
adds them all): ours, TensorRT-LLM's aliases and its LLM API's `sampling_param_*`, vLLM backend's, and the inputs
we refuse unless at their default. `protocol.py` reads requests by these names.

Names follow TensorRT-LLM's `ensemble` (`text_input`, `max_tokens`, `stream`, ...); every input and output name of
TensorRT-LLM's `tensorrt_llm`, `ensemble` and `tensorrt_llm_bls` models is here.
"""
from __future__ import annotations

# name: (triton dtype, dims); every input but the prompt is optional.
INPUTS = {
    "text_input": ("TYPE_STRING", [1]),  # as vLLM's backend and TensorRT-LLM's ensemble declare it
    "input_ids": ("TYPE_INT32", [-1]),
    "input_lengths": ("TYPE_INT32", [1]),  # must not exceed input_ids' length; the ids past it are padding
    "messages": ("TYPE_STRING", [1]),  # instead of a prompt: OpenAI-format chat messages, JSON
    "max_tokens": ("TYPE_INT32", [1]),
    "stream": ("TYPE_BOOL", [1]),
    "stream_interval": ("TYPE_INT32", [1]),  # streamed responses carry at least this many tokens (the last: the rest)
    "temperature": ("TYPE_FP32", [1]),
    "top_k": ("TYPE_INT32", [1]),
    "top_p": ("TYPE_FP32", [1]),
    "seed": ("TYPE_UINT64", [1]),
    "end_id": ("TYPE_INT32", [1]),  # -1: no end token (TensorRT-LLM's meaning)
    "pad_id": ("TYPE_INT32", [1]),  # pads output_ids where rows of one response differ in length
    "stop_words": ("TYPE_STRING", [-1]),  # matched on the text
    "stop_words_list": ("TYPE_INT32", [2, -1]),  # TensorRT-LLM's token sequences: [flat ids, end offsets]
    "bad_words": ("TYPE_STRING", [-1]),  # tokenized without special tokens, as TensorRT-LLM's preprocessing
    "bad_words_list": ("TYPE_INT32", [2, -1]),
    "exclude_input_in_output": ("TYPE_BOOL", [1]),
    "min_tokens": ("TYPE_INT32", [1]),
    "num_return_sequences": ("TYPE_INT32", [1]),
    "priority": ("TYPE_INT32", [1]),
    "repetition_penalty": ("TYPE_FP32", [1]),
    "presence_penalty": ("TYPE_FP32", [1]),
    "frequency_penalty": ("TYPE_FP32", [1]),
    "return_perf_metrics": ("TYPE_BOOL", [1]),
    "return_log_probs": ("TYPE_BOOL", [1]),  # TensorRT-LLM: output_log_probs, cum_log_probs
    "return_context_logits": ("TYPE_BOOL", [1]),
    "return_generation_logits": ("TYPE_BOOL", [1]),
    "sampling_parameters": ("TYPE_STRING", [1]),  # vLLM backend: JSON in vLLM SamplingParams names
    "embedding_bias": ("TYPE_FP32", [-1]),  # TensorRT-LLM's: [vocab], added to the logits (logit_bias.py)
    "embedding_bias_words": ("TYPE_STRING", [-1]),  # its ensemble's: each word's tokens get its weight
    "embedding_bias_weights": ("TYPE_FP32", [-1]),
    "return_finish_reason": ("TYPE_BOOL", [1]),  # vLLM backend: these three on every response (always on the final)
    "return_num_input_tokens": ("TYPE_BOOL", [1]),
    "return_num_output_tokens": ("TYPE_BOOL", [1]),
    "return_cumulative_logprob": ("TYPE_BOOL", [1]),  # vLLM backend and TensorRT-LLM's LLM API
    "return_logprobs": ("TYPE_BOOL", [1]),  # vLLM backend: per-token JSON, with vLLM's `logprobs` parameter
    "return_stop_reason": ("TYPE_BOOL", [1]),  # TensorRT-LLM's LLM API
}
ALIASES = {  # TensorRT-LLM's other names -> ours
    "streaming": ("stream", ("TYPE_BOOL", [1])),
    "request_output_len": ("max_tokens", ("TYPE_INT32", [1])),
    "runtime_top_k": ("top_k", ("TYPE_INT32", [1])),
    "runtime_top_p": ("top_p", ("TYPE_FP32", [1])),
    "random_seed": ("seed", ("TYPE_UINT64", [1])),
    "min_length": ("min_tokens", ("TYPE_INT32", [1])),
    "sampling_param_temperature": ("temperature", ("TYPE_FP32", [1])),  # TensorRT-LLM's LLM-API model
    "sampling_param_top_k": ("top_k", ("TYPE_INT32", [1])),
    "sampling_param_top_p": ("top_p", ("TYPE_FP32", [1])),
    "sampling_param_frequency_penalty": ("frequency_penalty", ("TYPE_FP32", [1])),
    "sampling_param_presence_penalty": ("presence_penalty", ("TYPE_FP32", [1])),
    "sampling_param_max_tokens": ("max_tokens", ("TYPE_INT32", [1])),
    "sampling_param_stop": ("stop_words", ("TYPE_STRING", [-1])),
    "sampling_param_seed": ("seed", ("TYPE_UINT64", [1])),
    "sampling_param_exclude_input_from_output": ("exclude_input_in_output", ("TYPE_BOOL", [1])),
}
# Declared so that clients that send them work, and refused unless at their default: name -> (dtype, dims,
# default). A default of None: only absent or empty passes; otherwise absent, empty, or every element equal to it.
UNSUPPORTED = {
    "beam_width": ("TYPE_INT32", [1], 1),
    "sampling_param_best_of": ("TYPE_INT32", [1], 1),
    "runtime_top_p_decay": ("TYPE_FP32", [1], 1.0),
    "stop": ("TYPE_BOOL", [1], False),
    "decoder_text_input": ("TYPE_STRING", [1], ""),
    "decoder_input_ids": ("TYPE_INT32", [-1], None),
    "decoder_input_lengths": ("TYPE_INT32", [1], 0),
    "draft_input_ids": ("TYPE_INT32", [-1], None),
    "draft_logits": ("TYPE_FP32", [-1, -1], None),
    "draft_acceptance_threshold": ("TYPE_FP32", [1], None),
    "num_draft_tokens": ("TYPE_INT32", [1], 0),
    "use_draft_logits": ("TYPE_BOOL", [1], False),
    "encoder_input_features": ("TYPE_FP16", [-1, -1], None),
    "encoder_output_lengths": ("TYPE_INT32", [1], 0),
    "cross_attention_mask": ("TYPE_BOOL", [-1, -1], None),
    "skip_cross_attn_blocks": ("TYPE_BOOL", [1], False),
    "prompt_embedding_table": ("TYPE_FP16", [-1, -1], None),
    "prompt_vocab_size": ("TYPE_INT32", [1], 0),
    "prompt_table_extra_id": ("TYPE_UINT64", [1], None),
    "prompt_table_extra_ids": ("TYPE_UINT64", [-1], None),
    "mrope_rotary_cos_sin": ("TYPE_FP32", [-1], None),
    "mrope_position_deltas": ("TYPE_INT64", [1], None),
    "lora_task_id": ("TYPE_UINT64", [1], None),
    "lora_weights": ("TYPE_FP16", [-1, -1], None),
    "lora_config": ("TYPE_INT32", [-1, 3], None),
    "context_phase_params": ("TYPE_UINT8", [-1], None),
    "retention_token_range_starts": ("TYPE_INT32", [-1], None),
    "retention_token_range_ends": ("TYPE_INT32", [-1], None),
    "retention_token_range_priorities": ("TYPE_INT32", [-1], None),
    "retention_token_range_durations_ms": ("TYPE_INT32", [-1], None),
    "retention_decode_priority": ("TYPE_INT32", [1], None),
    "retention_decode_duration_ms": ("TYPE_INT32", [1], None),
    "guided_decoding_guide_type": ("TYPE_STRING", [1], ""),
    "guided_decoding_guide": ("TYPE_STRING", [1], ""),
    "lookahead_window_size": ("TYPE_INT32", [1], None),
    "lookahead_ngram_size": ("TYPE_INT32", [1], None),
    "lookahead_verification_set_size": ("TYPE_INT32", [1], None),
    "image_input": ("TYPE_FP16", [-1, 3, -1, -1], None),
    "image_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1], None),
    "image_url_input": ("TYPE_STRING", [1], ""),
    "video_bytes_input": ("TYPE_UINT8", [-1, -1, -1, -1], None),
    "image": ("TYPE_STRING", [-1], None),  # vLLM backend's (base64 images)
    "embedding_request": ("TYPE_STRING", [1], ""),  # vLLM backend's, reserved for its OpenAI frontend
}
# Beam-search and top-p-decay knobs: they change nothing while beam_width is 1 and runtime_top_p_decay 1.0 (both
# enforced above), in TensorRT-LLM as here, so any value is accepted.
INERT = {
    "len_penalty": ("TYPE_FP32", [1]),
    "length_penalty": ("TYPE_FP32", [1]),
    "early_stopping": ("TYPE_BOOL", [1]),
    "beam_search_diversity_rate": ("TYPE_FP32", [1]),
    "runtime_top_p_min": ("TYPE_FP32", [1]),
    "runtime_top_p_reset_ids": ("TYPE_INT32", [1]),
}

OUTPUTS = {
    "text_output": ("TYPE_STRING", [-1]),
    "output_ids": ("TYPE_INT32", [-1]),
    "finish_reason": ("TYPE_STRING", [1]),
    "num_input_tokens": ("TYPE_UINT32", [1]),  # vLLM backend's type
    "num_output_tokens": ("TYPE_UINT32", [1]),
    "num_cached_tokens": ("TYPE_UINT32", [1]),  # prompt tokens served from computed blocks (prefix cache)
    "sequence_length": ("TYPE_INT32", [-1]),
    "batch_index": ("TYPE_INT32", [1]),
    "sequence_index": ("TYPE_INT32", [1]),
    "output_log_probs": ("TYPE_FP32", [-1]),
    "cum_log_probs": ("TYPE_FP32", [-1]),
    "cumulative_logprob": ("TYPE_FP32", [-1]),
    "logprobs": ("TYPE_STRING", [-1]),
    "stop_reason": ("TYPE_STRING", [-1]),
    "context_logits": ("TYPE_FP32", [-1, -1]),
    "generation_logits": ("TYPE_FP32", [-1, -1]),
}
PERF_OUTPUTS = {  # with return_perf_metrics, on the final response
    "arrival_time_ns": ("TYPE_INT64", [1]),  # CLOCK_MONOTONIC nanoseconds of the request's life
    "first_scheduled_time_ns": ("TYPE_INT64", [1]),
    "first_token_time_ns": ("TYPE_INT64", [1]),
    "last_token_time_ns": ("TYPE_INT64", [1]),
    "kv_cache_alloc_new_blocks": ("TYPE_INT32", [1]),
    "kv_cache_reused_blocks": ("TYPE_INT32", [1]),
    "kv_cache_alloc_total_blocks": ("TYPE_INT32", [1]),
    "acceptance_rate": ("TYPE_FP32", [1]),  # no speculative decoding: always 0
    "total_accepted_draft_tokens": ("TYPE_INT32", [1]),
    "total_draft_tokens": ("TYPE_INT32", [1]),
}
NEVER_SENT = {"context_phase_params": ("TYPE_UINT8", [-1])}  # TensorRT-LLM's disaggregated serving


def all_inputs() -> dict[str, tuple[str, list[int]]]:
    return {**INPUTS, **{alias: spec for alias, (_, spec) in ALIASES.items()},
            **{name: (dtype, dims) for name, (dtype, dims, _) in UNSUPPORTED.items()}, **INERT}


def all_outputs() -> dict[str, tuple[str, list[int]]]:
    return {**OUTPUTS, **PERF_OUTPUTS, **NEVER_SENT}
