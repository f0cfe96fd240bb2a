//go:build tools

// Package tools pins the upstream etcd server; nothing of ours is compiled here.
package tools

import _ "go.etcd.io/etcd/server/v3"
