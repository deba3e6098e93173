"""Where things run: devices and transports for the trainer and the engines (`placement.py`), a Ray
cluster's share of that (`ray.py`: engines as actors) and trainer ranks as Ray actors
(`ray_ranks.py`). Every backend's placement ends in the helpers here."""
