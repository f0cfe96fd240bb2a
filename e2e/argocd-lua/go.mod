module dlock.io/e2e/argocd-lua

go 1.26.0

// gopher-lua, gopher-json and sigs.k8s.io/yaml (and its YAML parser) at the versions Argo CD
// v3.6.2 pins in its go.mod; scripts/check-argocd-lua keys its cache by gopher-lua's version.
require (
	github.com/yuin/gopher-lua v1.1.2
	layeh.com/gopher-json v0.0.0-20190114024228-97fed8db8427
	sigs.k8s.io/yaml v1.6.0
)

require go.yaml.in/yaml/v2 v2.4.4 // indirect
