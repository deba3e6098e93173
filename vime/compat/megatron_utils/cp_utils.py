"""`from vime.backends.megatron_utils.cp_utils import all_gather_with_cp, slice_log_prob_with_cp`.

Under Megatron's context parallelism each rank holds two chunks of a sequence's response, and
these two helpers move between a rank's chunks and the whole response. vime has no context
parallelism: every rank holds whole sequences (the custom TIS hook gets each one whole), so the
context-parallel group has one member and both are the identity, as Megatron's are then. They
still check that what they are given is one whole response, which is what vime hands over.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

CP_SIZE = 1  # vime never splits a sequence over ranks


def _whole(values: Any, total_length: int, response_length: int, name: str) -> None:
    if len(values) != response_length or not 0 < response_length <= total_length:
        raise ValueError(
            f"{name}: {len(values)} values for a response of {response_length} tokens (sequence of {total_length}): "
            "vime hands a custom TIS function whole responses, one value per response token"
        )


def all_gather_with_cp(values: Tensor, total_length: int, response_length: int) -> Tensor:
    """The whole response's values from this rank's chunks: with one rank, what it holds."""
    _whole(values, total_length, response_length, "all_gather_with_cp")
    return values


def slice_log_prob_with_cp(
    values: Tensor | list[float], total_length: int, response_length: int, *_: Any, **__: Any
) -> Tensor | list[float]:
    """This rank's chunks of a whole response's values: with one rank, all of them."""
    _whole(values, total_length, response_length, "slice_log_prob_with_cp")
    return values


__all__ = ["CP_SIZE", "all_gather_with_cp", "slice_log_prob_with_cp"]
