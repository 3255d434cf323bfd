"""The devbox agent: the daemon inside each box (SSH server, sessions, telemetry)."""
