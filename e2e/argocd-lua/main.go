// Command argocd-lua runs an Argo CD health script (health.lua) against every case of its
// health_test.yaml in gopher-lua, the Lua Argo CD runs it in, the way Argo CD's own health
// test (util/lua/health_test.go, TestLuaHealthScript, v3.6.2) does: each case's input is read
// with sigs.k8s.io/yaml into an object, the script is found from the object's group and kind,
// run, and its status and message compared with the case's healthStatus.
//
// Every case runs twice: with all of gopher-lua's libraries, as Argo CD's test and its built-in
// scripts run, and with only the libraries Argo CD opens for an argocd-cm
// `resource.customizations` entry that does not set `useOpenLibs: true` (package, base, table
// and its own os subset: no string, math or coroutine), which is how docs/argocd.md ships it.
//
//	argocd-lua DIR    DIR holds health.lua and health_test.yaml, e.g. argocd/dlock.io/_
package main

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"reflect"
	"strings"

	"sigs.k8s.io/yaml"
)

type testStructure struct {
	Tests []individualTest `json:"tests"`
}

type individualTest struct {
	InputPath    string        `json:"inputPath"`
	HealthStatus *HealthStatus `json:"healthStatus"`
}

var modes = []struct {
	name        string
	useOpenLibs bool
}{
	{"Argo CD's test runner: all libraries", true},
	{"argocd-cm: useOpenLibs unset", false},
}

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: argocd-lua DIR (the directory of health.lua and health_test.yaml)")
		os.Exit(2)
	}
	dir := os.Args[1]
	if err := run(dir); err != nil {
		fmt.Fprintf(os.Stderr, "argocd-lua: %v\n", err)
		os.Exit(1)
	}
}

func run(dir string) error {
	scriptBytes, err := os.ReadFile(filepath.Join(dir, "health.lua"))
	if err != nil {
		return err
	}
	testBytes, err := os.ReadFile(filepath.Join(dir, "health_test.yaml"))
	if err != nil {
		return err
	}
	var tests testStructure
	if err := yaml.Unmarshal(testBytes, &tests); err != nil {
		return fmt.Errorf("health_test.yaml: %w", err)
	}
	if len(tests.Tests) == 0 {
		return fmt.Errorf("%s has no tests", filepath.Join(dir, "health_test.yaml"))
	}
	// The directory names the group and kind the script serves, as under Argo CD's
	// resource_customizations/: argocd/dlock.io/_ serves dlock.io/*, `_` standing for any name.
	abs, err := filepath.Abs(dir)
	if err != nil {
		return err
	}
	pattern := strings.ReplaceAll(filepath.Base(filepath.Dir(abs))+"/"+filepath.Base(abs), "_", "*")

	runs, failed := 0, 0
	for _, test := range tests.Tests {
		obj, err := getObj(filepath.Join(dir, test.InputPath))
		if err != nil {
			return err
		}
		// GetHealthScript: the built-in script whose directory pattern matches the object's
		// group/kind; with none, Argo CD reports no health from the script.
		key := configMapKey(obj)
		if ok, _ := path.Match(pattern, key); !ok {
			fmt.Printf("FAIL %s: no health script for %s (the script serves %s)\n", test.InputPath, key, pattern)
			runs += len(modes)
			failed += len(modes)
			continue
		}
		for _, mode := range modes {
			runs++
			result, err := executeHealthLua(obj, string(scriptBytes), mode.useOpenLibs)
			switch {
			case err != nil:
				fmt.Printf("FAIL %s (%s): %s\n", test.InputPath, mode.name, strings.TrimSpace(err.Error()))
			case !reflect.DeepEqual(test.HealthStatus, result):
				fmt.Printf("FAIL %s (%s):\n  got  %s\n  want %s\n", test.InputPath, mode.name, show(result), show(test.HealthStatus))
			default:
				continue
			}
			failed++
		}
	}
	fmt.Printf("argocd-lua: %d/%d passed (%d cases of %s, each with %d sets of libraries)\n",
		runs-failed, runs, len(tests.Tests), filepath.Join(dir, "health_test.yaml"), len(modes))
	if failed > 0 {
		return fmt.Errorf("%d of %d failed", failed, runs)
	}
	return nil
}

// getObj reads a case's input as Argo CD's test does: YAML to JSON to map[string]any, so every
// number is a float64.
func getObj(file string) (map[string]any, error) {
	yamlBytes, err := os.ReadFile(file)
	if err != nil {
		return nil, err
	}
	obj := make(map[string]any)
	if err := yaml.Unmarshal(yamlBytes, &obj); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return obj, nil
}

// configMapKey is Argo CD's GetConfigMapKey: group/kind, or the kind alone for the core group.
func configMapKey(obj map[string]any) string {
	apiVersion, _ := obj["apiVersion"].(string)
	kind, _ := obj["kind"].(string)
	group, _, found := strings.Cut(apiVersion, "/")
	if !found || group == "" {
		return kind
	}
	return group + "/" + kind
}

func show(status *HealthStatus) string {
	if status == nil {
		return "nothing"
	}
	s := fmt.Sprintf("status %q, message %q", status.Status, status.Message)
	if status.DeletionMessage != "" {
		s += fmt.Sprintf(", deletionMessage %q", status.DeletionMessage)
	}
	return s
}
