"""The settings of the trainer: LoRA, the optimizer and its batches."""

from __future__ import annotations

from dataclasses import dataclass

from vime.config.fields import setting


@dataclass
class TrainerFields:
    # --- LoRA ---
    lora_rank: int = setting(
        0,
        "train LoRA adapters of this rank on the target layers, the base frozen (0 = full fine-tuning); pushes and "
        "checkpoints carry the merged weights, checkpoints also the adapter in PEFT's layout (adapter/)",
        group="lora",
    )
    lora_alpha: float = setting(16.0, "LoRA's alpha: the adapter's update is scaled by alpha / rank", group="lora")
    lora_dropout: float = setting(
        0.0,
        "dropout on the adapters' input while training; above 0 the training forward differs from the one that "
        "scored the old log-probs, so the importance ratio is not 1 even on-policy",
        group="lora",
    )
    target_modules: list = setting(
        ["all-linear"],
        "layers that get adapters, by their names' last parts (q_proj k_proj v_proj o_proj gate_proj up_proj "
        "down_proj), or all-linear (every linear layer but the LM head)",
        group="lora",
        nargs="+",
    )
    exclude_modules: list = setting(
        [], "layers left without adapters, by last part or whole dotted name", group="lora", nargs="+"
    )
    # --- optimizer ---
    optimizer: str = setting(
        "adam",
        "adam (AdamW: Megatron's adam, weight decay decoupled) or sgd (with --sgd-momentum)",
        ("adam", "sgd"),
        group="optimizer",
    )
    lr: float = setting(1e-6, "peak learning rate", group="optimizer")
    lr_decay_style: str = setting(
        "constant",
        "learning rate after warm-up: constant, or decayed to --min-lr over --lr-decay-iters, linearly or on a cosine",
        ("constant", "linear", "cosine"),
        group="optimizer",
    )
    lr_warmup_iters: int = setting(
        0, "optimizer steps of linear warm-up from 0 to --lr (step 0 runs at 0, as in Megatron)", group="optimizer"
    )
    lr_warmup_fraction: float | None = setting(
        None,
        "warm-up as a share of the decay's optimizer steps (Megatron's; slime's SFT scripts give 0.1): instead of --lr-warmup-iters",
        group="optimizer",
    )
    lr_decay_iters: int | None = setting(
        None,
        "optimizer steps over which the learning rate decays, warm-up included (default: every optimizer step of the run)",
        group="optimizer",
    )
    min_lr: float = setting(0.0, "learning rate at the end of the decay", group="optimizer")
    weight_decay: float = setting(
        0.0,
        "weight decay of the weight matrices, not of biases and norm weights, as in Megatron (decoupled with adam, an L2 term with sgd)",
        group="optimizer",
    )
    adam_beta1: float = setting(0.9, "AdamW beta1", group="optimizer")
    adam_beta2: float = setting(0.98, "AdamW beta2", group="optimizer")
    adam_eps: float = setting(1e-8, "AdamW epsilon", group="optimizer")
    sgd_momentum: float = setting(0.9, "momentum of --optimizer sgd", group="optimizer")
    clip_grad: float = setting(1.0, "gradient norm clip", group="optimizer")
    global_batch_size: int | None = setting(
        None, "samples per optimizer step (default: one step per rollout)", group="optimizer"
    )
    num_steps_per_rollout: int | None = setting(
        None,
        "optimizer steps per rollout: sets --global-batch-size to the rollout's samples divided by it",
        group="optimizer",
    )
    max_tokens_per_gpu: int = setting(
        4096,
        "micro-batch token budget (real tokens per forward/backward on one GPU): larger micro-batches run the GPU "
        "closer to its peak (bench/RESULTS.md measures the trainer at 8192-16384) at the cost of activation memory; "
        "the gradient is the same for any budget",
        group="optimizer",
    )
    micro_batch_size: int | None = setting(
        None,
        "samples per micro-batch at most, besides the --max-tokens-per-gpu budget (the gradient is the same for any split)",
        group="optimizer",
    )
    gradient_checkpointing: bool = setting(False, "recompute activations in backward", group="optimizer")
    gradient_checkpointing_layers: int | None = setting(
        None,
        "with --gradient-checkpointing: recompute only the first N decoder layers (default: all of them)",
        group="optimizer",
    )
    compile: bool | None = setting(
        None,
        "torch.compile each decoder layer of the trainer's model: on by default when the trainer is on CUDA. One compile serves every layer; micro-batches are padded up to one of 16 sizes, all compiled in a warm-up before step 1, so nothing compiles mid-run (speed: bench/RESULTS.md)",
        group="optimizer",
    )
    attention_kernel: str = setting(
        "auto",
        "the trainer's packed attention on CUDA: fa2 (torch's varlen FlashAttention-2), fa4 (FlashAttention-4 from the "
        "optional flash-attn-4 package, Hopper and sm100 GPUs, checked against float32 attention at load) or sdpa "
        "(one SDPA call per sequence); auto is fa4 where it is installed and passes its check (a 7-14% faster step "
        "on an H200: bench/RESULTS.md), else fa2 where it runs, else sdpa. float32 attention (CPU) is always sdpa",
        ("auto", "fa4", "fa2", "sdpa"),
        group="optimizer",
    )
    logprob_chunk_size: int = setting(
        4096,
        "tokens per chunk when log-probs are computed from hidden states: caps the logits memory at chunk x vocabulary (bf16: 2 bytes each); smaller chunks are slower (bench/RESULTS.md)",
        group="optimizer",
    )
    seed: int = setting(1234, "trainer seed", group="optimizer")
    max_bad_steps: int = setting(
        3,
        "stop the run after this many steps in a row whose rewards, advantages, loss or gradient norm were not finite (each such optimizer step is skipped)",
        group="optimizer",
    )
