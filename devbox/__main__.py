from __future__ import annotations

from devbox.cli import main

raise SystemExit(main())
