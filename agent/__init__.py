"""The devbox agent: the daemon inside each box (SSH server, sessions, telemetry)."""

# Before any agent module imports asyncssh: its import trips cryptography's deprecations
# of algorithms the agent never offers, which would open every agent log.
from devbox.libwarnings import quiet_asyncssh

quiet_asyncssh()
