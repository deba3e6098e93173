"""Putting a run together: `assemble(cfg) -> RunContext` (`assemble.py`, `context.py`) checks the
inputs, freezes the config and starts the trainer and the engines; where they run is the
launcher's (`launcher.py`: `local.py` processes on this machine, `ray.py` Ray actors, with
`ray_ranks.py` for trainer ranks); devices and weight transports are `vime/backends/placement.py`'s,
where every backend's placement ends, below the launchers that call it."""
