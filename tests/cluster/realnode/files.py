"""The real node's configuration: containerd's, the CNI network's, the kubelet's, and the
kubelet's own identity (a client certificate signed with the test cluster's CA)."""

from __future__ import annotations

import datetime
import json
import warnings

from tests import nvml_sim
from tests.cluster.realnode import (
    BRIDGE,
    CGROUP_ROOT,
    NODE,
    NODE_IP,
    OVERLAID,
    PAUSE_IMAGE,
    SERVICE_RANGE,
    SUBNET,
    TAINT_KEY,
    Paths,
)


def write_files(paths: Paths, *, server: str) -> None:
    root = paths.root
    for d in (paths.kubelet_dir, paths.cni_conf, paths.gpus, paths.images, root / "cni/ipam"):
        d.mkdir(parents=True, exist_ok=True)
    for name in OVERLAID.values():
        for part in ("upper", "work"):
            (root / "overlay" / name / part).mkdir(parents=True, exist_ok=True)
    paths.containerd_config.write_text(
        f"""version = 2
root = "{root}/containerd/root"
state = "{root}/containerd/state"
disabled_plugins = [
  "io.containerd.snapshotter.v1.aufs", "io.containerd.snapshotter.v1.btrfs",
  "io.containerd.snapshotter.v1.devmapper", "io.containerd.snapshotter.v1.zfs",
  "io.containerd.tracing.processor.v1.otlp", "io.containerd.internal.v1.tracing",
]
[grpc]
  address = "{paths.containerd_sock}"
[plugins."io.containerd.internal.v1.opt"]
  path = "{root}/containerd/opt"
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "{PAUSE_IMAGE}"
  netns_mounts_under_state_dir = true
  # These machines withhold CAP_SYS_RESOURCE, so no process may lower its OOM score below
  # ours; without this runc fails to start every sandbox (it asks for -998).
  restrict_oom_score_adj = true
  stream_server_address = "127.0.0.1"
  [plugins."io.containerd.grpc.v1.cri".cni]
    bin_dir = "/usr/lib/cni"
    conf_dir = "{paths.cni_conf}"
  [plugins."io.containerd.grpc.v1.cri".containerd]
    snapshotter = "overlayfs"
    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]
        SystemdCgroup = false
"""
    )
    conflist = {
        "cniVersion": "1.0.0",
        "name": "devbox-test-node",
        "plugins": [
            {
                "type": "bridge",
                "bridge": BRIDGE,
                # The bridge already has its address (we gave it): the plugin must neither
                # make it a gateway out nor turn on IP forwarding or masquerading.
                "isGateway": False,
                "ipMasq": False,
                "hairpinMode": False,
                "ipam": {
                    "type": "host-local",
                    "ranges": [
                        [
                            {
                                "subnet": f"{SUBNET}.0/24",
                                "rangeStart": f"{SUBNET}.10",
                                "gateway": NODE_IP,
                            }
                        ]
                    ],
                    # Only the service range goes to the node: nothing leaves the machine.
                    "routes": [{"dst": SERVICE_RANGE}],
                    "dataDir": str(root / "cni/ipam"),
                },
            }
        ],
    }
    (paths.cni_conf / "10-devbox-test-node.conflist").write_text(json.dumps(conflist, indent=1))
    kubelet = {
        "apiVersion": "kubelet.config.k8s.io/v1beta1",
        "kind": "KubeletConfiguration",
        "address": NODE_IP,
        "port": 10250,
        "readOnlyPort": 0,
        "healthzPort": 0,
        # The API server proves itself with its client certificate (kwokctl's admin cert,
        # given to it as --kubelet-client-certificate); anonymous requests get nothing.
        "authentication": {
            "anonymous": {"enabled": False},
            "webhook": {"enabled": True},
            "x509": {"clientCAFile": str(paths.pki / "ca.crt")},
        },
        "authorization": {"mode": "Webhook"},
        "containerRuntimeEndpoint": f"unix://{paths.containerd_sock}",
        # These hosts are cgroup v1 (hybrid), without systemd as init and without swap.
        "cgroupDriver": "cgroupfs",
        "cgroupRoot": f"/{CGROUP_ROOT}",
        "failCgroupV1": False,
        "failSwapOn": False,
        "protectKernelDefaults": True,
        "registerWithTaints": [{"key": TAINT_KEY, "value": "true", "effect": "NoSchedule"}],
        # A CI machine's disk may be fuller than a node's would be: evict only when it is
        # truly out, and never collect the images we imported (there is no registry).
        "evictionHard": {
            "memory.available": "50Mi",
            "nodefs.available": "1%",
            "imagefs.available": "1%",
            "nodefs.inodesFree": "1%",
        },
        "imageGCHighThresholdPercent": 100,
        "imageGCLowThresholdPercent": 99,
        "serializeImagePulls": False,
        "resolvConf": "",
        "clusterDomain": "cluster.local",
        "maxPods": 50,
        "nodeStatusUpdateFrequency": "4s",
        "syncFrequency": "10s",
    }
    import yaml  # here, not at the top: `down` runs with any python3

    paths.kubelet_config.write_text(yaml.safe_dump(kubelet))
    write_node_kubeconfig(paths, server=server)
    nvml_sim.build(paths.nvml)


def write_node_kubeconfig(paths: Paths, *, server: str) -> None:
    """The kubelet's own identity, system:node:NAME in system:nodes, so the Node
    authorizer and NodeRestriction hold it to its own node, as in a real cluster."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    with warnings.catch_warnings():
        # kwokctl's CA has a negative serial number, which cryptography only warns about.
        warnings.simplefilter("ignore")
        ca_cert = x509.load_pem_x509_certificate((paths.pki / "ca.crt").read_bytes())
    ca_key = serialization.load_pem_private_key((paths.pki / "ca.key").read_bytes(), None)
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(
            x509.Name(
                [
                    x509.NameAttribute(NameOID.ORGANIZATION_NAME, "system:nodes"),
                    x509.NameAttribute(NameOID.COMMON_NAME, f"system:node:{NODE}"),
                ]
            )
        )
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=30))
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        .sign(ca_key, hashes.SHA256())  # type: ignore[arg-type]
    )
    pem = serialization.Encoding.PEM
    (paths.root / "kubelet.crt").write_bytes(cert.public_bytes(pem))
    key_file = paths.root / "kubelet.key"
    key_file.write_bytes(
        key.private_bytes(
            pem, serialization.PrivateFormat.TraditionalOpenSSL, serialization.NoEncryption()
        )
    )
    key_file.chmod(0o600)
    kubeconfig = {
        "apiVersion": "v1",
        "kind": "Config",
        "clusters": [
            {
                "name": "test",
                "cluster": {"server": server, "certificate-authority": str(paths.pki / "ca.crt")},
            }
        ],
        "users": [
            {
                "name": NODE,
                "user": {
                    "client-certificate": str(paths.root / "kubelet.crt"),
                    "client-key": str(key_file),
                },
            }
        ],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": NODE}}],
        "current-context": "test",
    }
    import yaml

    paths.kubelet_kubeconfig.write_text(yaml.safe_dump(kubeconfig))
    paths.kubelet_kubeconfig.chmod(0o600)
