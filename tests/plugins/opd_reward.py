"""A reward that says nothing: with it, an OPD run learns from the teacher alone (tests/unit/algorithms/test_opd.py)."""


def zero_reward(args, sample) -> float:
    return 0.0
