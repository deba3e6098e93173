"""Synchronous GRPO: generate → train → push weights. `python train.py --help` lists the flags."""

import sys

from vime.cli import guarded, train_main

if __name__ == "__main__":
    sys.exit(guarded(lambda argv: train_main(argv, "sync"), sys.argv[1:]))
