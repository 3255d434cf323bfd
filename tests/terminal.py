"""A real terminal for tests: a private tmux server runs the program; we type, read the screen."""

from __future__ import annotations

import subprocess
import time
import uuid
from pathlib import Path


class Terminal:
    def __init__(
        self, env: dict[str, str], socket_dir: Path, *, width: int = 120, height: int = 40
    ) -> None:
        self.env = dict(env)
        self.socket = str(socket_dir / f"t{uuid.uuid4().hex[:8]}")
        self.width, self.height = width, height
        self.windows = 0

    def _tmux(self, *args: str) -> str:
        result = subprocess.run(
            ["tmux", "-S", self.socket, *args],
            env=self.env,
            capture_output=True,
            text=True,
            timeout=10,
        )
        return result.stdout

    def start(self, command: str) -> str:
        """Run `command` in a new window; returns its target. The window stays after exit."""
        self.windows += 1
        target = f"w{self.windows}"
        alive = (
            subprocess.run(
                ["tmux", "-S", self.socket, "has-session", "-t", "t"],
                env=self.env,
                capture_output=True,
            ).returncode
            == 0
        )
        if not alive:
            self._tmux(
                "new-session",
                "-d",
                "-s",
                "t",
                "-n",
                target,
                "-x",
                str(self.width),
                "-y",
                str(self.height),
                f"{command}; echo EXIT=$?; sleep 600",
            )
        else:
            self._tmux(
                "new-window", "-d", "-t", "t", "-n", target, f"{command}; echo EXIT=$?; sleep 600"
            )
        return f"t:{target}"

    def send(self, target: str, *keys: str) -> None:
        self._tmux("send-keys", "-t", target, *keys)

    def type(self, target: str, line: str) -> None:
        self.send(target, "-l", line)
        self.send(target, "Enter")

    def screen(self, target: str) -> str:
        return self._tmux("capture-pane", "-p", "-t", target)

    def wait_for(self, target: str, text: str, timeout: float = 15) -> str:
        deadline = time.monotonic() + timeout
        while True:
            shown = self.screen(target)
            if text in shown:
                return shown
            if time.monotonic() > deadline:
                raise AssertionError(f"{text!r} not on screen after {timeout}s:\n{shown}")
            time.sleep(0.05)

    def resize(self, target: str, width: int, height: int) -> None:
        self._tmux("resize-window", "-t", target, "-x", str(width), "-y", str(height))

    def kill_window(self, target: str) -> None:
        self._tmux("kill-window", "-t", target)

    def close(self) -> None:
        self._tmux("kill-server")
