"""slime's `slime.utils.external_utils`: what its Python launchers (`python tests/test_*.py`,
`examples/*/run_*.py`) import to prepare a model and start a run (`command_utils`), with vime's
meaning: the run is vime's `train.py` / `train_async.py`, a model download that cannot happen
(offline) is one line naming the directory to fill, and nothing Megatron needs is made.
`downloads.py` holds the download part, which `slime.utils.misc.exec_command` uses too.
"""
