//go:build tools

// Package testcluster only pins the Kubernetes control-plane and etcd main
// packages so that `go mod tidy` keeps them in go.mod/go.sum. build.sh builds
// them into a cache directory outside the repository.
package testcluster

import (
	_ "go.etcd.io/etcd/server/v3"
	_ "k8s.io/kubernetes/cmd/kube-apiserver"
	_ "k8s.io/kubernetes/cmd/kube-controller-manager"
	_ "k8s.io/kubernetes/cmd/kube-scheduler"
	_ "k8s.io/kubernetes/cmd/kubectl"
	_ "k8s.io/kubernetes/cmd/kubelet"
)
