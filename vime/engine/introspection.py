"""What an engine reports about itself: `/get_model_info`'s body (how a trainer places an engine it
did not start, and checks its model) and `/metrics`' Prometheus text, one row per series, so a new
series is a row."""

from __future__ import annotations

import socket
from typing import Any


def model_info(e: Any, model_path: str) -> dict[str, Any]:
    """`e`: the `LLMEngine`, read between two steps."""
    from vime.transport import cuda_ipc  # torch: loaded with the engine, not with this module

    mc = e.model_config
    moe = mc.moe
    return {
        "model_path": model_path,
        "model_type": mc.model_type,
        "weight_version": e.weight_version,
        "device": str(e.device),
        "device_uuid": cuda_ipc.device_uuid(e.device),
        "hostname": socket.gethostname(),
        "tp_size": 1,
        "dtype": e.cfg.dtype,
        "quantization": e.cfg.quantization,
        "vocab_size": mc.vocab_size,
        "eos_token_ids": list(mc.eos_token_ids),
        # a mixture-of-experts model's routing: what `routed_experts` rows hold (MoE layers x top_k)
        "num_experts": 0 if moe is None else moe.num_experts,
        "num_experts_per_tok": 0 if moe is None else moe.top_k,
        "moe_layers": [] if moe is None else list(moe.layers),
        "max_num_seqs": e.cfg.max_num_seqs,
        "max_num_batched_tokens": e.cfg.max_num_batched_tokens,
        "num_kv_blocks": e.allocator.num_blocks,
        "block_size": e.cfg.block_size,
        "max_seq_len": e.max_seq_len,
        "paused": e.paused,
        "memory_released": not e.kv_cache.allocated,
    }


def metrics_text(e: Any) -> str:
    """`e`: the `LLMEngine`; its stats, scheduler and allocator as they are between two steps."""
    s = e.stats
    rows = [
        ("num_running", "gauge", "sequences in the running batch", len(e.scheduler.running)),
        ("num_waiting", "gauge", "sequences waiting to be scheduled", len(e.scheduler.waiting)),
        ("kv_blocks_free", "gauge", "free KV cache blocks", e.allocator.num_free),
        ("kv_blocks_total", "gauge", "KV cache blocks", e.allocator.num_blocks),
        ("weight_version", "gauge", "version of the weights in use", e.weight_version),
        ("paused", "gauge", "1 while generation is paused", int(e.paused)),
        ("steps_total", "counter", "model steps run", s.steps),
        ("prompt_tokens_total", "counter", "prompt tokens received (x n)", s.prompt_tokens),
        ("computed_tokens_total", "counter", "tokens run through the model, recomputed too", s.computed_tokens),
        ("generated_tokens_total", "counter", "tokens generated", s.generated_tokens),
        ("requests_finished_total", "counter", "requests finished (stop or length)", s.finished_requests),
        ("requests_aborted_total", "counter", "requests aborted", s.aborted_requests),
        ("preemptions_total", "counter", "sequences preempted for lack of KV blocks", e.scheduler.num_preemptions),
        (
            "prefix_cache_hit_tokens_total",
            "counter",
            "tokens with KV from the prefix cache",
            e.scheduler.num_cached_tokens,
        ),
    ]
    return "".join(
        f"# HELP vime_engine_{n} {h}\n# TYPE vime_engine_{n} {t}\nvime_engine_{n} {v}\n" for n, t, h, v in rows
    )
