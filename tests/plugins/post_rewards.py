"""A --custom-reward-post-process-path of slime's form (tests/unit/rollout/test_opd_served.py): every call is
appended to the file named by $VIME_TEST_POST_LOG, and the rewards it returns are not the reward
function's (opd_reward.zero_reward's 0): 1 for every other sample, so a run whose weights move
trained on them."""

from __future__ import annotations

import json
import os


def alternate(args, samples, **kwargs):
    raw = [s.get_reward_value(args) for s in samples]
    with open(os.environ["VIME_TEST_POST_LOG"], "a") as f:
        f.write(json.dumps({"n": len(samples), "raw": raw}) + "\n")
    return raw, [float(i % 2) for i in range(len(samples))]
