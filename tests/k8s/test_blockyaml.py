"""The kubeconfig YAML read without PyYAML (devbox.backends.kubernetes.blockyaml): what it
reads equals yaml.safe_load's reading, and what it does not read it hands back
(Unsupported), never reading it differently. No cluster needed."""

from __future__ import annotations

import random
import string
from pathlib import Path
from typing import Any

import pytest
import yaml

from devbox.backends.kubernetes import blockyaml, kubeconfig

KUBECTL = """\
apiVersion: v1
clusters:
- cluster:
    certificate-authority-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0tCk1JSUM=
    server: https://127.0.0.1:32764
  name: kwok-devbox
- cluster:
    insecure-skip-tls-verify: true
    server: https://10.0.0.1:6443/prefix
    tls-server-name: kubernetes.default.svc
  name: other
contexts:
- context:
    cluster: kwok-devbox
    namespace: lab
    user: kwok-devbox
  name: kwok-devbox
current-context: kwok-devbox
kind: Config
preferences: {}
users:
- name: kwok-devbox
  user:
    client-certificate-data: LS0tLS1CRUdJTiBDRVJUSUZJQ0FURS0tLS0t
    client-key-data: LS0tLS1CRUdJTiBFQyBQUklWQVRFIEtFWS0tLS0t
- name: tokens
  user:
    token: abc.def-ghi_jkl
    tokenFile: /var/run/secrets/token
"""

# Indented sequences, comments, quotes, CRLF, nulls, empty collections, nested lists.
OTHER_STYLES = [
    "clusters:\n  - name: a\n    cluster:\n      server: 'https://x:1'\n",
    "# a comment\nkind: Config  \n\n\nusers:\n-   name: u\n    user: {}\n",
    "a: \"double quoted\"\nb: 'it''s'\nc: ~\nd:\ne: []\nf: null\ng: FALSE\n",
    "a:\r\n  b: c\r\n  d:\r\n  - e\r\n  - f\r\n",
    "list:\n- a\n- b: c\n  d: e\n-\n  - nested\n",
    "list:\n-\n  k: v\n- x\n",
    "",
    "# only a comment\n",
    "a: b/c:d@e=f+g~h,i%j(k)\n",
    "empty:\nnext: v\n",
]

# PyYAML reads these as other than strings, or they are outside the subset: handed back.
HANDED_BACK = [
    "port: 6443\n",
    "a: 1.5\n",
    "a: yes\n",
    "a: On\n",
    "a: 2024-01-01\n",
    "a: .inf\n",
    "a: -x\n",
    "a: &anchor v\nb: *anchor\n",
    "a: !!str v\n",
    "a: |\n  block\n",
    "a: >\n  folded\n",
    "a: [1, 2]\n",
    "a: {b: c}\n",
    'a: "esc\\n"\n',
    "a: v # trailing comment\n",
    "a: plain\n  continued\n",
    "---\na: b\n",
    "a:\tb\n",
    "a: b: c\n",
    "'quoted key': v\n",
    "1: v\n",
    "yes: v\n",
    "a: v:\n",
    "- - a\n",
    "just a scalar\n",
    "a: %x\n",
    "a: @x\n",
    "a: `x\n",
]


@pytest.mark.parametrize("text", [KUBECTL, *OTHER_STYLES])
def test_reads_as_pyyaml_does(text: str) -> None:
    assert blockyaml.load(text) == yaml.safe_load(text)


@pytest.mark.parametrize("text", HANDED_BACK)
def test_hands_back_what_it_does_not_read(text: str) -> None:
    with pytest.raises(blockyaml.Unsupported):
        blockyaml.load(text)


def _random_doc(rng: random.Random, depth: int = 0) -> Any:
    def word() -> str:
        alphabet = string.ascii_letters + string.digits + "-_./:@ "
        return rng.choice(string.ascii_letters) + "".join(
            rng.choice(alphabet) for _ in range(rng.randrange(12))
        )

    kind = rng.randrange(5 if depth < 3 else 2)
    if kind == 0:
        return word()
    if kind == 1:
        return rng.choice([True, False, None, "", "null", "true", "yes", "01", "-1"])
    if kind in (2, 3):
        return {word().replace(" ", ""): _random_doc(rng, depth + 1) for _ in range(3)}
    return [_random_doc(rng, depth + 1) for _ in range(rng.randrange(4))]


@pytest.mark.parametrize("seed", range(300))
def test_whatever_pyyaml_writes_in_block_style_is_read_alike_or_handed_back(seed: int) -> None:
    rng = random.Random(seed)
    doc = {"root": _random_doc(rng), "more": _random_doc(rng)}
    for text in (
        yaml.safe_dump(doc, default_flow_style=False),
        yaml.safe_dump(doc, default_flow_style=False, indent=4),
    ):
        try:
            read = blockyaml.load(text)
        except blockyaml.Unsupported:
            continue
        assert read == yaml.safe_load(text) == doc, text


def test_a_kubeconfig_outside_the_subset_is_still_read(tmp_path: Path) -> None:
    path = tmp_path / "config"
    path.write_text(
        "clusters: [{name: c, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t0k3n}}]\n"
        "contexts: [{name: x, context: {cluster: c, user: u}}]\n"
        "current-context: x\n"
    )
    endpoint = kubeconfig.load(path=str(path))
    assert (endpoint.server, endpoint.token) == ("https://127.0.0.1:6443", "t0k3n")
