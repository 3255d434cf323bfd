"""What the agent says to the box's user where they work: the attached session (screen's
wall, tmux's display-message) and every other terminal of the box. The autoscaler's
warnings, a hung box, what was saved before a release. Blocking: call it off the loop."""

from __future__ import annotations

import logging
import os

from agent.server import BoxIdentity
from devbox import protocol, terminals

log = logging.getLogger("devbox.agent")


def tell(box: BoxIdentity, text: str, *, all_processes: bool) -> int:
    """Show `text` in the session and the box's other terminals; how many terminals.
    `all_processes`: every process this PID namespace shows is the box's (a pod)."""
    mux = box.multiplexer
    mux.tell(box.name, text)
    table = terminals.Processes()
    if all_processes:
        shown = table.every()
    else:
        shown = table.below([os.getpid(), *table.marked(f"{protocol.BOX_ENV}={box.name}")])
    programs = terminals.multiplexer_programs(*([mux.path] if mux.path else []))
    told = terminals.tell(text, table=table, box=shown, multiplexers=programs)
    log.info("told the session and %d other terminal(s): %s", told, text)
    return told
