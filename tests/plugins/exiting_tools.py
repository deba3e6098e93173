"""A user's tool that ends its own process as it is told to, loaded by dotted path
(`--tools exiting_tools:exiting_tool`). Its module imports little, since each of the tool's worker
processes imports it (vime/rollout/tools/workers.py)."""

from __future__ import annotations

import os
import signal
import sys

from vime.rollout.tools.calls import Tool


def exiting_tool() -> Tool:
    def end(arguments: dict) -> str:
        how = arguments["how"]
        if how == "os._exit":
            os._exit(3)
        if how == "sys.exit":
            sys.exit(4)
        if how == "signal":
            os.kill(os.getpid(), signal.SIGKILL)
        if how == "group":
            os.killpg(0, signal.SIGTERM)
        if how == "orphan":  # a process out of its worker's group, that outlived the run
            import subprocess

            return str(subprocess.Popen(["sleep", "300"], start_new_session=True).pid)
        return "still here"

    return Tool("end", "ends its process", {"type": "object"}, end)
