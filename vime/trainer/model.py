"""The trained model's pieces, built once by the actor: the HF model loaded in float32, its
activation checkpointing, the token scorer (the forward the losses read) and FSDP2's wrapping."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import Tensor, nn

from vime.trainer.logprobs import ChunkLoss, chunked_log_probs, chunked_loss
from vime.trainer.packing import PackedBatch, register_packed_attention


class TokenScorer(nn.Module):
    """HF causal LM → log-probs (and entropies) of the response tokens of a packed batch.

    A module of its own so that, under FSDP2, it is the root unit: its forward unshards the
    embedding, final norm and LM head that the chunked head reads directly.
    """

    def __init__(self, hf: nn.Module, chunk_size: int) -> None:
        super().__init__()
        self.hf = hf
        self.chunk_size = chunk_size

    def forward(
        self, mb: PackedBatch, temperature: float, with_entropy: bool, loss_fn: ChunkLoss | None = None
    ) -> tuple[Tensor, Tensor | None] | Tensor:
        """(log-probs, entropies) of the scored tokens; given a `loss_fn`, that loss of them
        instead, its gradient taken in the forward (`chunked_loss`)."""
        hidden = self.hf.get_decoder()(
            input_ids=mb.input_ids,
            position_ids=mb.position_ids,
            use_cache=False,
            cu_seq_lens_q=mb.cu_seqlens,
            max_length_q=mb.max_seqlen,
        ).last_hidden_state[0]
        head = self.hf.get_output_embeddings()
        if getattr(head, "bias", None) is not None:
            raise NotImplementedError("the chunked LM head assumes no bias (true of the Llama/Qwen families)")
        if loss_fn is not None:
            return chunked_loss(
                hidden[mb.select], head.weight, mb.targets, loss_fn, temperature, with_entropy, self.chunk_size
            )
        return chunked_log_probs(hidden[mb.select], head.weight, mb.targets, temperature, with_entropy, self.chunk_size)


def load_model(model_path: str | Path, device: torch.device) -> nn.Module:
    """An HF causal LM in float32 master weights everywhere; on CUDA, FSDP2 computes in bf16 (`wrap`)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(model_path), dtype=torch.float32, attn_implementation=register_packed_attention()
    )
    model.config.use_cache = False  # training never decodes; a KV cache only costs memory
    return model.to(device)


def checkpoint_layers(model: nn.Module, n: int | None) -> None:
    """Recompute the activations of the first `n` decoder layers in the backward (all of them
    when None): Megatron's `--recompute-method block --recompute-num-layers n`, which trades
    less recompute for the memory of the later layers' activations. transformers' decoder
    layers each carry their own `gradient_checkpointing` flag, which `*_checkpointing_enable`
    sets on all of them; the later ones are turned off again."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:  # transformers 5's name; the old one warns there
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if n is not None:
        for layer in model.get_decoder().layers[n:]:
            layer.gradient_checkpointing = False


def wrap(scorer: TokenScorer, device: torch.device, world: int) -> nn.Module:
    """FSDP2 the way torchtitan does it: one unit per decoder layer, the rest in the root."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if device.type == "cuda"
        else MixedPrecisionPolicy()
    )
    layers = list(scorer.hf.get_decoder().layers)
    for i, layer in enumerate(layers):
        # the last layer's parameters are needed again at once by the backward: keep them; on
        # one rank resharding frees nothing (the shard is the whole tensor) and the backward's
        # re-gather would only cast every weight to bf16 again
        fully_shard(layer, mp_policy=mp, reshard_after_forward=world > 1 and i < len(layers) - 1)
    fully_shard(scorer, mp_policy=mp, reshard_after_forward=False)
    return scorer


def full_tensor(tensor: Tensor) -> Tensor:
    """The whole tensor of a (possibly FSDP2-sharded) parameter; every rank calls. One rank
    holds the whole tensor already: a gather would cost a collective and a copy."""
    if hasattr(tensor, "full_tensor"):
        return tensor.to_local() if tensor.device_mesh.size() == 1 else tensor.full_tensor()
    return tensor
