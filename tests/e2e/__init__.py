"""Whole runs: train.py, train_async.py, `vime` and slime's launch started as a user starts them
(or `train_here`, the same entry in this process), checked by what the run did and wrote."""
