//go:build tools

// Package tools pins KWOK's controller and kwokctl; nothing of ours is compiled here.
package tools

import (
	_ "sigs.k8s.io/kwok/cmd/kwok"
	_ "sigs.k8s.io/kwok/cmd/kwokctl"
)
