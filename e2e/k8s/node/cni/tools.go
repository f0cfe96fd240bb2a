//go:build tools

// Package tools pins the CNI plugins of the real node (bridge, host-local, loopback, portmap);
// nothing of ours is compiled here.
package tools

import (
	_ "github.com/containernetworking/plugins/plugins/ipam/host-local"
	_ "github.com/containernetworking/plugins/plugins/main/bridge"
	_ "github.com/containernetworking/plugins/plugins/main/loopback"
	_ "github.com/containernetworking/plugins/plugins/meta/portmap"
)
