module dlock.io/e2e/k8s/node/pause

go 1.26.0
