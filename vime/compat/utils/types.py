"""`from vime.utils.types import Sample`: vime's Sample (vime/rollout/types.py), which has
vllm-project/vime's `Sample.Status` and `append_response_tokens`."""

from vime.rollout.types import RolloutOutput, Sample, Status

__all__ = ["RolloutOutput", "Sample", "Status"]
