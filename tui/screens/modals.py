"""Modal dialogs: claim a box, confirm a release. They return what the user chose; the
app's workers act on it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Input, Label, Select

from devbox.errors import DevboxError
from devbox.names import validate_name


@dataclass(frozen=True)
class ClaimRequest:
    name: str | None
    gpus: int
    profile: str
    backend: str


class ClaimScreen(ModalScreen[ClaimRequest | None]):
    BINDINGS: ClassVar[list[BindingType]] = [Binding("escape", "cancel", "Cancel")]

    def __init__(self, *, backend: str) -> None:
        super().__init__()
        self.default_backend = backend

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label("Claim a box", classes="title")
            yield Input(placeholder="name (empty: a generated one)", id="name")
            yield Input(value="0", placeholder="GPUs", id="gpus", type="integer")
            yield Input(value="default", placeholder="profile", id="profile")
            yield Select(
                [("local", "local"), ("kubernetes", "kubernetes")],
                value=self.default_backend,
                allow_blank=False,
                id="backend",
            )
            yield Label("", id="error")
            with Horizontal(classes="buttons"):
                yield Button("Claim", variant="primary", id="ok")
                yield Button("Cancel", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#name", Input).focus()

    def request(self) -> ClaimRequest:
        """What the form says, or a DevboxError naming the bad field."""
        name = self.query_one("#name", Input).value.strip() or None
        if name is not None:
            validate_name(name)
        gpus_text = self.query_one("#gpus", Input).value.strip() or "0"
        try:
            gpus = int(gpus_text)
        except ValueError:
            raise DevboxError(f"GPU count must be a whole number, not {gpus_text!r}") from None
        if gpus < 0:
            raise DevboxError(f"GPU count must not be negative (got {gpus})")
        profile = self.query_one("#profile", Input).value.strip() or "default"
        backend = str(self.query_one("#backend", Select).value)
        return ClaimRequest(name=name, gpus=gpus, profile=profile, backend=backend)

    def submit(self) -> None:
        try:
            request = self.request()
        except DevboxError as exc:
            self.query_one("#error", Label).update(f"[red]{exc.message}[/red]")
            return
        self.dismiss(request)

    def on_button_pressed(self, event: Button.Pressed) -> None:
        if event.button.id == "ok":
            self.submit()
        else:
            self.dismiss(None)

    def on_input_submitted(self, event: Input.Submitted) -> None:
        self.submit()

    def action_cancel(self) -> None:
        self.dismiss(None)


class ConfirmScreen(ModalScreen[bool]):
    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("y", "answer(True)", "Yes"),
        Binding("n,escape", "answer(False)", "No"),
    ]

    def __init__(self, question: str) -> None:
        super().__init__()
        self.question = question

    def compose(self) -> ComposeResult:
        with Vertical(id="dialog"):
            yield Label(self.question, classes="title")
            with Horizontal(classes="buttons"):
                yield Button("Yes (y)", variant="error", id="yes")
                yield Button("No (n)", id="no")

    def on_mount(self) -> None:
        self.query_one("#no", Button).focus()

    def on_button_pressed(self, event: Button.Pressed) -> None:
        self.dismiss(event.button.id == "yes")

    def action_answer(self, yes: bool) -> None:
        self.dismiss(yes)
