//go:build tools

// Package kwoktools pins the kwok and kwokctl main packages so that
// `go mod tidy` keeps them. kwok lives in its own module so that it keeps the
// dependency set it was released with (k8s.io/* v0.36.1).
package kwoktools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
	_ "sigs.k8s.io/kwok/cmd/kwokctl"
)
