"""`get_env`, with tau-bench's signature: the toy domain named `env_name`, its `task_split`'s
tasks, and the scripted user (see tau_bench/__init__.py)."""

from __future__ import annotations

from tau_bench.envs.base import Env
from tau_bench.envs.shop import DOMAINS
from tau_bench.envs.user import UserStrategy


def get_env(
    env_name: str,
    user_strategy: str | UserStrategy,
    user_model: str,
    task_split: str,
    user_provider: str | None = None,
    task_index: int | None = None,
) -> Env:
    if env_name not in DOMAINS:
        raise ValueError(f"unknown environment {env_name!r}; the stand-in has {', '.join(DOMAINS)}")
    data, tools, tasks, wiki = DOMAINS[env_name]
    if task_split not in tasks:
        raise ValueError(f"unknown task split {task_split!r} for {env_name}; the stand-in has {', '.join(tasks)}")
    strategy = user_strategy.value if isinstance(user_strategy, UserStrategy) else user_strategy
    return Env(data, tools, tasks[task_split], wiki, strategy, user_model, user_provider, task_index)
