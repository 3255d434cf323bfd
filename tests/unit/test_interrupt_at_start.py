"""ctrl-c while Python is still loading devbox: nothing has started, so no traceback."""

from __future__ import annotations

import subprocess
import sys

# Python's SIGINT handler raises KeyboardInterrupt at the next bytecode, wherever that is:
# here, as `python -m devbox` imports the CLI (the moment a quick ctrl-c lands).
INTERRUPTED_IMPORT = """
import builtins, runpy, sys
real = builtins.__import__
def interrupted(name, *args, **kwargs):
    if name == "devbox.cli":
        raise KeyboardInterrupt
    return real(name, *args, **kwargs)
builtins.__import__ = interrupted
sys.argv = ["devbox", "ls"]
runpy.run_module("devbox", run_name="__main__", alter_sys=True)
"""


def test_ctrl_c_while_devbox_loads_exits_130_quietly() -> None:
    result = subprocess.run(
        [sys.executable, "-c", INTERRUPTED_IMPORT], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 130
    assert result.stderr == ""
