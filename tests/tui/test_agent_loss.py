"""One box's agent dying never takes the dashboard down: two real local boxes, one agent
killed with -9 under a running app, which stays up, goes on updating the other box and
shows the dead one as failed."""

from __future__ import annotations

import os
import signal

from devbox.backends.local import LocalBackend
from devbox.boxes import BoxState
from devbox.config import Config
from tests.conftest import User
from tests.tui.test_app import until
from tests.tui.test_real_boxes import as_user  # noqa: F401  (a fixture)
from tui.app import make_app
from tui.screens.boxes import BoxesScreen
from tui.widgets.boxtable import BoxTable


async def test_a_dead_agent_is_one_boxs_state_not_the_apps_end(as_user: User) -> None:  # noqa: F811
    doomed = as_user.up("doomed")
    as_user.up("steady")
    # Slow relisting: the dead box's stream meets the lost connection before the list says
    # the box failed (the order that crashed the app).
    app = make_app(backend=LocalBackend(config=Config()), rate=10.0, list_interval=5.0)
    async with app.run_test(size=(140, 40)):
        views = app.store.views
        await until(lambda: {"doomed", "steady"} <= views.keys(), timeout=30)
        await until(lambda: all(views[n].sample for n in ("doomed", "steady")), timeout=30)
        os.kill(int(doomed["extra"]["pid"]), signal.SIGKILL)
        await until(lambda: views["doomed"].link.startswith("lost"), timeout=30)
        assert app.is_running and isinstance(app.screen, BoxesScreen)
        steady = views["steady"]
        assert steady.sample is not None
        seq = steady.sample["seq"]
        await until(lambda: steady.sample is not None and steady.sample["seq"] > seq + 5)
        await until(lambda: views["doomed"].box.state is BoxState.FAILED, timeout=30)
        await until(
            lambda: "failed" in app.screen.query_one("#boxes", BoxTable).cell("doomed", "STATE")
        )
        assert app.is_running and "doomed" not in app.streams
        seq = steady.sample["seq"]
        await until(lambda: steady.sample is not None and steady.sample["seq"] > seq + 5)
    assert app.return_code in (None, 0)
