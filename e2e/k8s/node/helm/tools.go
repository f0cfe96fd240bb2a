//go:build tools

// Package tools pins the helm command the real-node scenarios install the chart with, as the
// README says (`helm install dlock charts/dlock …`); nothing of ours is compiled here.
package tools

import (
	_ "helm.sh/helm/v4/cmd/helm"
)
