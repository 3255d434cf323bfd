"""`devbox run`: detached experiments in a box, each with a record of what ran and how it ended.

In the box: `record` (the record and the runs folder), `boxside` (the helper the client
runs over SSH: start, list, log, kill, attach) and `wrapper` (the process in the run's
screen/tmux window). On the laptop: `sync` (the working tree into the box), `remote` (the
helper over SSH) and `commands` (the CLI). Nothing in the box-side modules imports more
than the standard library, so the helper starts in tens of milliseconds.
"""
