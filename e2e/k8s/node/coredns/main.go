// Command coredns is the real node's cluster DNS: CoreDNS with only the plugins a Kubernetes
// cluster's Corefile uses (kubernetes, bind, forward, cache, errors, log, health, ready, reload,
// loadbalance), so that the test bed builds a fraction of upstream's dependency graph. It runs
// as a process of the host beside the kubelet (scripts/k8s-up --real-node), reading the API
// server through a kubeconfig, and answers on the node's address, the kubelet's clusterDNS.
package main

import (
	_ "github.com/coredns/coredns/core/dnsserver"
	"github.com/coredns/coredns/coremain"
	_ "github.com/coredns/coredns/plugin/bind"
	_ "github.com/coredns/coredns/plugin/cache"
	_ "github.com/coredns/coredns/plugin/errors"
	_ "github.com/coredns/coredns/plugin/forward"
	_ "github.com/coredns/coredns/plugin/health"
	_ "github.com/coredns/coredns/plugin/kubernetes"
	_ "github.com/coredns/coredns/plugin/loadbalance"
	_ "github.com/coredns/coredns/plugin/log"
	_ "github.com/coredns/coredns/plugin/ready"
	_ "github.com/coredns/coredns/plugin/reload"
)

func main() {
	coremain.Run()
}
