"""The built-in engine as a backend: starting its server from the trainer's process (`launch.py`)
and placing its engines, here or as Ray actors (`place.py`)."""
