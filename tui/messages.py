"""What a screen asks of the app. Screens post these to the app (`self.app.post_message`:
straight to it, so a screen that is closing still gets its word through) and the app's `@on`
handlers act (push a screen, start a worker). No screen calls the app or imports it: the
screens sit below the app, and the app is the one place that starts I/O."""

from __future__ import annotations

from textual.message import Message


class BoxMessage(Message):
    """A request about one box, by name."""

    def __init__(self, box: str) -> None:
        super().__init__()
        self.box = box


class OpenBox(BoxMessage):
    """Show the box's screen (GPUs, processes, runs)."""


class EnterBox(BoxMessage):
    """Suspend the dashboard and attach the box's session in this terminal."""


class ReleaseBox(BoxMessage):
    """Ask, then release the box."""


class KeepBox(BoxMessage):
    """Hold the box against idle release (`devbox keep`)."""


class OpenModel(BoxMessage):
    """Show the model screen of the box's probed training."""


class CloseModel(BoxMessage):
    """The model screen is gone: stop asking for its histograms."""


class RunMessage(BoxMessage):
    """A request about one run of a box."""

    def __init__(self, box: str, run_id: str) -> None:
        super().__init__(box)
        self.run_id = run_id


class OpenRunLog(RunMessage):
    """Show the run's output, following it."""


class AttachRun(RunMessage):
    """Attach the run's window in this terminal."""


class ClaimBox(Message):
    """Ask what to claim, then claim it."""
