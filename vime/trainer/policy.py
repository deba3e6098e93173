"""The policy being trained, as the trainer runs it: the HF model in float32 master weights, its
LoRA adapters, activation checkpointing and per-layer compile, and the token scorer that FSDP2
wraps (the forward every loss reads). Frozen models (the KL's reference, the OPD teacher) are
loaded and wrapped the same way. The pieces are `vime.trainer.model`'s; this file applies them
in their order."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import nn

from vime.config import ConfigError, TrainerConfig
from vime.trainer.expert_parallel import shard_experts
from vime.trainer.lora import LoraSpec, add_adapters
from vime.trainer.model import TokenScorer, checkpoint_layers, load_model, wrap
from vime.trainer.moe import MoeShape
from vime.trainer.ranks import Ranks
from vime.trainer.routing import Routing


class Policy:
    """The trained model (`model`) and its scorer (`scorer`: the `TokenScorer` around it, wrapped
    by FSDP2 on a sharded trainer), built once at start."""

    def __init__(self, trainer: TrainerConfig, model_path: str | Path, ranks: Ranks, replay: bool = False) -> None:
        """`replay`: --use-rollout-routing-replay (a mixture of experts' routers replay the engine's)."""
        self.ranks = ranks
        self.attention_kernel = trainer.attention_kernel
        self.chunk_size = trainer.logprob_chunk_size
        self.model = load_model(model_path, ranks.device, trainer.attention_kernel)
        self.moe = MoeShape.of(self.model)  # None for a dense model
        # its routers, before compile sees them: replay, mismatch, the balance loss (routing.py)
        self.routing = Routing.install(self.moe, self.model, replay) if self.moe is not None else None
        # --expert-model-parallel-size: each rank keeps its share of the experts (expert_parallel.py)
        self.mesh, self.expert_params = None, set()
        if trainer.expert_model_parallel_size > 1:
            self.mesh, self.expert_params = self._split_experts(trainer.expert_model_parallel_size)
        # LoRA: the base frozen, adapters on the target layers (vime/trainer/lora.py); what leaves
        # the trainer (pushes, checkpoints' safetensors) is the merged weight under the HF name
        self.lora = LoraSpec.of(trainer)
        self.lora_modules: set[str] = set()  # the layers that carry adapters
        if self.lora is not None:
            try:
                self.lora_modules = set(add_adapters(self.model, self.lora, trainer.seed))
            except ValueError as e:
                raise ConfigError(str(e)) from None
        if trainer.gradient_checkpointing:
            checkpoint_layers(self.model, trainer.gradient_checkpointing_layers)
        all_names = {n for n, _ in self.model.named_parameters(remove_duplicate=False)}
        param_names = {n for n, _ in self.model.named_parameters()}
        self.tied_aliases = all_names - param_names  # tied names, e.g. lm_head.weight
        # what a checkpoint holds besides parameters (none in Llama/Qwen: their rotary tables are not persistent)
        self.buffers = [n for n in self.model.state_dict() if n not in all_names]
        self.compiled: bool = trainer.compile if trainer.compile is not None else ranks.device.type == "cuda"
        if self.compiled:
            # per layer, before FSDP wraps them (as torchtitan does): the layers share one code
            # object, so one compile serves all of them, and packed lengths vary: dynamic shapes
            for layer in self.model.get_decoder().layers:
                layer.compile(dynamic=True)
        self.scorer = self._wrap(TokenScorer(self.model, self.chunk_size, self.routing), self.expert_params)

    def frozen(self, model_path: str | Path) -> nn.Module:
        """A frozen model's scorer (the KL's reference, the OPD teacher), wrapped as the policy's
        and never compiled."""
        model = load_model(model_path, self.ranks.device, self.attention_kernel, trained=False)
        model.requires_grad_(False)
        model.eval()
        return self._wrap(TokenScorer(model, self.chunk_size))

    def _wrap(self, scorer: TokenScorer, experts: set[nn.Parameter] | None = None) -> nn.Module:
        if not self.ranks.sharded:
            return scorer
        return wrap(scorer, self.ranks.device, self.ranks.world, self.mesh, experts or set())

    def _split_experts(self, size: int) -> tuple[Any, set[nn.Parameter]]:
        """The trainer's mesh and the experts split over it; the size must be every rank (the
        config checked it where it could; a rank count known only here is checked here)."""
        from torch.distributed.device_mesh import init_device_mesh

        if self.moe is None:
            raise ConfigError(f"--expert-model-parallel-size {size}: the model is dense, it has no experts to split")
        if size != self.ranks.world or self.moe.num_experts % size:
            raise ConfigError(
                f"--expert-model-parallel-size {size}: vime splits each layer's {self.moe.num_experts} experts evenly "
                f"over all of the trainer's {self.ranks.world} rank(s): give {self.ranks.world} (if it divides them) or 1"
            )
        mesh = init_device_mesh(self.ranks.device.type, (self.ranks.world,))
        return mesh, shard_experts(self.moe, self.model, mesh)
