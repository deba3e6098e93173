"""slime's OPD post-process that kills the served teacher once the run's first step has been
scored (tests/unit/rollout/test_opd_served.py sets `teacher`): a teacher that dies mid-run, as a real one can."""

from __future__ import annotations

from typing import Any

from vime.rollout.on_policy_distillation import post_process_rewards

teacher: Any = None  # the engine handle the test launched
calls = 0  # the start-up check calls it once, then each step


def post_process_then_kill(args: Any, samples: list, **kwargs: Any) -> Any:
    global calls
    out = post_process_rewards(args, samples, **kwargs)
    calls += 1
    if calls == 2 and teacher is not None:  # step 1 scored: the teacher goes
        teacher.proc.kill()
        teacher.proc.wait()
    return out
