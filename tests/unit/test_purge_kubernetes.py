"""`down --purge` on Kubernetes: a home there is the owner's, shared by all their boxes, so
releasing one box never deletes it; the refusal comes before anything is stopped."""

from __future__ import annotations

import pytest

from devbox.backends.kubernetes import KubernetesBackend
from devbox.config import Config
from devbox.errors import UsageError


def test_purge_is_refused_before_the_cluster_is_touched() -> None:
    backend = KubernetesBackend(config=Config(backend="kubernetes"))
    asked: list[str] = []
    with pytest.raises(UsageError, match="shared by all your boxes"):
        backend.release("mine", purge=True, confirm=asked.append)
    assert asked == []  # nothing to confirm: nothing would be deleted
    assert backend._cluster is None  # no connection was even made
