"""The devbox agent: the daemon inside each box (SSH server, sessions, telemetry)."""

# Before any agent module imports asyncssh: its import trips cryptography's deprecations
# of algorithms the agent never offers, which would open every agent log. (agent.main's
# own first import of it also skips asyncssh's library search: devbox.sshlib.)
from devbox import sshlib

sshlib.quiet()
