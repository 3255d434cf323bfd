"""devbox: a personal GPU box in one command.

Importing this package must stay cheap: `devbox --help` and the ProxyCommand
bridge run on every ssh connection, so nothing heavy is imported here.
"""

from __future__ import annotations

__version__ = "0.1.0"
