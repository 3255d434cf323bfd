"""The test control plane: a Go module building the real Kubernetes binaries (build.sh),
and the pod runner that plays the container runtime for kwok's simulated pods."""
