"""`from vime.utils.async_utils import run`: a coroutine run to its end from synchronous code, as
vllm-project/vime's rollout functions call their async halves (examples/fully_async).

vime runs all rollout I/O on one process-wide loop in a thread of its own
(vime/rollout/async_loop.py), where the engines' clients keep their connections; `run` is that
loop's, so a plug-in's coroutine and vime's requests share it, as they share vllm-project/vime's.
"""

from vime.rollout.async_loop import run

__all__ = ["run"]
