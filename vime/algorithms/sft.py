"""The supervised loss (slime's `--loss-type sft_loss`): the negative log-likelihood of the
loss-masked tokens, on the trainer RL uses.

A warm start before RL trains the same model, packing, chunked LM head and checkpoints as the RL
run that follows, so the SFT loss is one more per-token term: `vime.algorithms.objective.Objective`
aggregates it as it aggregates the policy term (the step's token mean, or with
--no-calculate-per-token-loss the mean of each sample's token mean), so micro-batches and head
chunks add up to the step's loss. It reads no advantage, old log-prob, reference or reward:
the flags that shape those would do nothing here, and are refused (`refused`).

Tensor methods only, no `import torch` (the config reads the checks).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

    from vime.algorithms.settings import AlgorithmConfig


class SFTLoss:
    """−log π(token) on every loss token; its mean is the cross-entropy of the data's answers."""

    @staticmethod
    def per_token(log_probs: Tensor) -> Tensor:
        return -log_probs  # [tokens]

    @staticmethod
    def refused(algo: AlgorithmConfig) -> list[tuple[bool, str]]:
        """RL's flags that an SFT step would ignore, as (condition, one-line error) checks for
        `Config.validate`: given to an SFT run they are a mistake, never a silent no-op."""
        why = "--loss-type sft_loss trains the data's answers by their likelihood and"
        rl_only = [
            (algo.kl_loss_coef != 0, "--kl-loss-coef", "loads no reference model"),
            (algo.entropy_coef != 0, "--entropy-coef", "adds no entropy bonus"),
            (
                algo.advantage_estimator != "grpo",
                f"--advantage-estimator {algo.advantage_estimator}",
                "has no advantages",
            ),
            (
                algo.use_tis or algo.use_rs or algo.m2_threshold is not None,
                "--use-tis/--use-rs/--m2-threshold",
                "weighs no token by a ratio",
            ),
            (
                algo.off_policy_correction not in ("auto", "none"),
                f"--off-policy-correction {algo.off_policy_correction}",
                "weighs no token by a ratio",
            ),
            (algo.use_opsm, "--use-opsm", "masks no sequence by its drift"),
            (algo.eps_clip_c is not None, "--eps-clip-c", "clips nothing"),
            (algo.use_rollout_logprobs, "--use-rollout-logprobs", "reads no old log-probs"),
            (algo.custom_tis_function_path is not None, "--custom-tis-function-path", "weighs no token by a ratio"),
            (algo.custom_advantage_function_path is not None, "--custom-advantage-function-path", "has no advantages"),
            (algo.use_opd, "--use-opd", "adds no teacher's term"),
        ]
        return [(bad, f"{why} {does}: drop {flag}") for bad, flag, does in rl_only]
