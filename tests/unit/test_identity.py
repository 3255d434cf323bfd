"""The owner label and home folder derived from a user's Kubernetes name."""

from __future__ import annotations

import re

from devbox.protocol import home_folder, owner_label

LABEL = re.compile(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,61}[A-Za-z0-9])?")


def test_labels_are_valid_readable_and_never_shared() -> None:
    names = ["alice", "jürgen", "jörgen", "王伟", "李娜", "a" * 63 + "x", "a" * 63 + "y",
             "system:serviceaccount:lab:bot", "alice@example.org", "-", ""]  # fmt: skip
    labels = [owner_label(n) for n in names]
    assert all(LABEL.fullmatch(label) for label in labels), labels
    assert len(set(labels)) == len(names)
    assert owner_label("jürgen").startswith("jurgen-") and owner_label("王伟").startswith("u-")
    assert owner_label("alice") == owner_label("alice")


def test_home_folders_are_one_to_one_and_stay_in_the_volume() -> None:
    names = ["a/b", "a%2Fb", "a%b", "..", ".", "/", "alice"]
    folders = [home_folder(n) for n in names]
    assert len(set(folders)) == len(names)
    assert all("/" not in f and f.startswith("u-") and f not in (".", "..") for f in folders)
    assert home_folder("https://idp.example/#alice") == "u-https:%2F%2Fidp.example%2F#alice"
