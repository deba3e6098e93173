"""vime: RL post-training for language models, sync and async, measured side by side."""

__version__ = "0.1.0"
