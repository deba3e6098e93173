"""The flag names of slime's argument list (`slime/utils/arguments.py` of THUDM/slime at 624b824,
read by hand: names only) and the Megatron flags slime's dense-model run scripts pass besides, for
tests/test_slime_flags.py: each must be vime's, or a row of vime/compat/ that says what vime does
with it. Megatron's MoE flags (`--num-experts`, `--moe-*`) are another table's."""

SLIME_ARGUMENTS = """
actor-num-gpus-per-node actor-num-nodes advantage-estimator allgather-cp apply-chat-template
apply-chat-template-kwargs async-save balance-by-flops balance-data buffer-filter-path
calculate-per-token-loss check-weight-update-equal ci-disable-kl-checker ci-load-grad-norm ci-save-grad-norm
ci-test ci-train-rollout-logprob-abs-diff-threshold clip-grad colocate custom-advantage-function-path
custom-config-path custom-convert-samples-to-train-data-path custom-eval-rollout-log-function-path
custom-generate-function-path custom-loss-function-path custom-megatron-before-log-prob-hook-path
custom-megatron-before-train-step-hook-path custom-megatron-init-path custom-model-provider-path
custom-pg-loss-reducer-function-path custom-reward-post-process-path custom-rm-path
custom-rollout-log-function-path custom-tis-function-path custom-update-weight-post-write-path
data-pad-size-multiplier data-source-path debug-rollout-only debug-train-only
disable-compute-advantages-and-returns disable-grpo-std-normalization disable-rewards-normalization
disable-rollout-global-dataset disable-wandb-random-suffix distributed-backend distributed-timeout-minutes
dump-details dynamic-sampling-filter-path enable-mtp-training entropy-coef eps-clip eps-clip-c eps-clip-high
eval-config eval-function-path eval-input-key eval-interval eval-label-key eval-max-context-len
eval-max-prompt-len eval-max-response-len eval-min-new-tokens eval-prompt-data eval-reward-key
eval-temperature eval-tool-key eval-top-k eval-top-p fetch-trajectory-retry-times freeze-indexer
freeze-params-name-list gamma get-mismatch-metrics global-batch-size group-rm hf-checkpoint http-proxy
input-key keep-old-actor kl-coef kl-loss-coef kl-loss-type label-key lambd load load-debug-rollout-data
load-debug-rollout-data-subsample load-forge-rollout-data log-correct-samples log-multi-turn log-passrate
log-probs-chunk-size log-probs-max-tokens-per-gpu log-reward-category loss-mask-type loss-type lr
mask-offpolicy-in-partial-rollout max-tokens-per-gpu megatron-config-path megatron-deepgemm-forward-layers
megatron-deepgemm-forward-modules megatron-deepgemm-moe-forward-layers megatron-deepgemm-moe-forward-modules
memory-recorder memory-snapshot-dir memory-snapshot-num-steps metadata-key micro-batch-size
min-batch-collection-ratio model-name mtp-loss-scaling-factor mtp-num-layers multimodal-keys
n-samples-per-eval-prompt n-samples-per-prompt no-save-optim normalize-advantages num-critic-only-steps
num-epoch num-gpus-per-node num-rollout num-steps-per-rollout offload offload-rollout offload-train
only-train-params-name-list opd-kl-coef opd-teacher-ckpt-step opd-teacher-load opd-type opsm-delta
over-sampling-batch-size padded-vocab-size partial-rollout profile-target prompt-data qwen-gdn-backend
recompute-loss-function record-memory-history ref-ckpt-step ref-load ref-update-interval release-train
reset-optimizer-states reward-key rm-type rm-url rollout-all-samples-process-path rollout-batch-size
rollout-buffer-url rollout-data-postprocess-path rollout-data-transport rollout-external-engine-addrs
rollout-function-path rollout-health-check-first-wait rollout-health-check-interval
rollout-health-check-timeout rollout-max-context-len rollout-max-prompt-len rollout-max-response-len
rollout-num-gpus rollout-num-gpus-per-engine rollout-sample-filter-path rollout-sample-hook-path rollout-seed
rollout-shuffle rollout-skip-special-tokens rollout-stop rollout-stop-token-ids rollout-task-type
rollout-temperature rollout-top-k rollout-top-p save save-debug-rollout-data save-debug-train-data save-hf
save-interval seed skip-eval-before-train start-rollout-id tb-experiment-name tb-project-name tis-clip
tis-clip-low tool-key train-backend train-env-vars update-weight-buffer-size update-weight-delta-checksum
update-weight-delta-encoding update-weight-disk-dir update-weight-disk-keep-files
update-weight-local-checkpoint-dir update-weight-mode update-weight-transport update-weights-interval
use-distributed-post use-dynamic-batch-size use-fault-tolerance use-kl-loss use-opd use-opsm
use-rollout-entropy use-rollout-logprobs use-rollout-routing-replay use-routing-replay use-stateless-adam
use-tensorboard use-tis use-unbiased-kl use-wandb value-clip wandb-always-use-train-step wandb-dir wandb-group
wandb-host wandb-key wandb-mode wandb-project wandb-run-id wandb-team
""".split()  # noqa: SIM905 (names as read, a line of slime's list at a time)

MEGATRON_IN_SCRIPTS = """
apply-layernorm-1p attention-output-gate bf16 decoder-first-pipeline-num-layers
decoder-last-pipeline-num-layers deterministic-mode enable-experimental fp8-format fp8-param-gather fp8-recipe
kv-lora-rank mscale mscale-all-dim multi-latent-attention no-check-for-nan-in-loss-and-grad
no-gradient-accumulation-fusion no-masked-softmax-fusion no-offload-rollout no-offload-train
no-position-embedding no-rope-fusion optimizer-cpu-offload overlap-cpu-optimizer-d2h-h2d post-mlp-layernorm
post-self-attn-layernorm prefill-num-servers q-lora-rank qk-head-dim qk-pos-emb-head-dim rotary-interleaved
rotary-scaling-factor spec transformer-impl use-distributed-optimizer use-gated-attention
use-precision-aware-optimizer use-rope-scaling v-head-dim
""".split()  # noqa: SIM905 (names as read, a line of slime's list at a time)

# slime's later flags: those its argument list at 002fa9d adds to the list above (its straw
# rollout-data queue, score centering, rollout sessions), the LoRA flags of its
# scripts/run-qwen3-30B-A3B-lora.sh, and the flags its examples' READMEs name (DrGRPO's
# --pg-loss-divisor, true_on_policy's --true-on-policy-mode), and the older --rollout-num-gpus-per-node
# of its scripts/run-llama3.1-8B.sh, its router's (examples/reproducibility's --use-slime-router) and its
# self-distillation's (examples/on_policy_distillation/run-qwen3-8B-opsd.sh)
SLIME_LATER = """
async-strategy buffer-sort-by-staleness flush-cache-interval force-fp8-ue8m0-scale pg-loss-type
rollout-cleanup-timeout rollout-data-dir rollout-io-concurrency rollout-queue-lease-seconds
rollout-queue-online-gc rollout-queue-run-id rollout-queue-segment-mib rollout-session-id
rollout-storage-declaration rollout-storage-profile routing-replay-prefetch-microbatches score-centering-top-k
use-score-centering
use-lora lora-target-preset lora-rank lora-alpha save-lora lora-weight-decay finetune lora-load
lora-save-merged-hf lora-learning-rate
pg-loss-divisor true-on-policy-mode rollout-num-gpus-per-node use-slime-router slime-router-middleware-paths
opsd-beta opsd-jsd-clip opsd-privileged-info-key
""".split()  # noqa: SIM905 (names as read)
