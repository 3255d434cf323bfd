from __future__ import annotations

try:
    from devbox.cli import main
except KeyboardInterrupt:  # ctrl-c while Python still loads devbox: nothing was started yet
    raise SystemExit(130) from None

raise SystemExit(main())
