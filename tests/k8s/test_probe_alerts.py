"""Model alerts on Kubernetes: a training process in the pod reports an alert to the
agent's probe socket; the agent annotates its pod, and `devbox ls` shows it."""

from __future__ import annotations

import json
import time

from tests.k8s.conftest import KubeUser

# A stand-in for devbox.probe in the pod (no torch there): the socket's wire format, from
# the path the agent puts in every session's environment.
FAKE_TRAINER = r"""
import json, os, socket, time
s = socket.socket(socket.AF_UNIX)
s.connect(os.environ["DEVBOX_PROBE_SOCKET"])
def send(kind, **body):
    s.sendall(json.dumps({"v": 1, "type": kind, **body}).encode() + b"\n")
send("probe-hello", pid=os.getpid(), cmd="fake", layers=["fc"], every=1)
alert = {"kind": "nan", "layer": "fc", "step": 7, "message": "NaN in the output of fc"}
send("probe-stats", pid=os.getpid(), step=7, t=time.time(), watched=False, layers=[],
     alerts=[alert])
time.sleep(1)
print("sent")
"""


def test_an_alert_in_the_pod_shows_in_ls(kube: KubeUser) -> None:
    kube.devbox("up", "pa", "--no-attach", check=True)
    (box,) = json.loads(kube.devbox("ls", "--json", check=True).stdout)
    assert box["alerts"] == ""
    sent = kube.devbox("ssh", "pa", "--", "python3", "-", input=FAKE_TRAINER.encode(), check=True)
    assert sent.stdout.strip() == b"sent", sent.stderr
    deadline = time.monotonic() + 30
    while True:
        (box,) = json.loads(kube.devbox("ls", "--json", check=True).stdout)
        if box["alerts"]:
            break
        assert time.monotonic() < deadline, box
        time.sleep(0.5)
    assert box["alerts"] == "nan:fc"
    table = kube.devbox("ls", check=True).stdout.decode().splitlines()
    assert table[0].split()[-1] == "ALERTS" and table[1].split()[-1] == "nan:fc"
