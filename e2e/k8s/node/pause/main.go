// Command pause is the sandbox (pause) container of the real node's pods: it holds the pod's
// namespaces, reaps the zombies it inherits as PID 1, and exits on SIGINT or SIGTERM. It does what
// Kubernetes' own pause.c does, built from Go so that the test bed needs no C toolchain and no
// registry (scripts/k8s-bin --node builds it, scripts/real-node imports it into containerd).
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	if len(os.Args) > 1 && os.Args[1] == "-v" {
		os.Stdout.WriteString("pause (dlock test bed)\n")
		return
	}
	signals := make(chan os.Signal, 8)
	signal.Notify(signals, syscall.SIGINT, syscall.SIGTERM, syscall.SIGCHLD)
	for s := range signals {
		if s != syscall.SIGCHLD {
			os.Exit(0)
		}
		for {
			pid, err := syscall.Wait4(-1, nil, syscall.WNOHANG, nil)
			if pid <= 0 || err != nil {
				break
			}
		}
	}
}
