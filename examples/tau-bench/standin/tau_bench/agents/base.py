"""tau-bench's agent base class, which slime's tau-bench agent imports."""

from typing import Any


class Agent:
    def solve(self, env: Any, task_index: int | None = None, max_num_steps: int = 30) -> Any:
        raise NotImplementedError
