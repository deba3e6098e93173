"""Asynchronous GRPO: generation of step N+1 overlaps training of step N.

With `--rollout-function-path vime.rollout.fully_async_rollout.generate_rollout_fully_async`
a continuous worker keeps generations in flight across steps. `--help` lists the flags.
"""

import sys

from vime.cli import guarded, train_main

if __name__ == "__main__":
    sys.exit(guarded(lambda argv: train_main(argv, "async"), sys.argv[1:]))
