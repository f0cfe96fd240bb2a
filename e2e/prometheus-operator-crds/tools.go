//go:build tools

// Package tools pins what scripts/prometheus-operator-crds builds and reads: controller-gen, which
// generates the Prometheus Operator's CustomResourceDefinitions from its API types the way its own
// build does, and those API types.
package tools

import (
	_ "github.com/prometheus-operator/prometheus-operator/pkg/apis/monitoring/v1"
	_ "sigs.k8s.io/controller-tools/cmd/controller-gen"
)
