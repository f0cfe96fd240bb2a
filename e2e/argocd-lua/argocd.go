package main

// How Argo CD runs a health script, reproduced from Argo CD v3.6.2, util/lua/lua.go
// (github.com/argoproj/argo-cd): VM.runLuaWithResourceActionParameters, VM.ExecuteHealthLua,
// decodeValue and isValidHealthStatusCode, with the same gopher-lua, gopher-json and options.
// Left out: the compiled-script cache (a cache of the same compiled function, no change in
// behaviour) and action parameters (an empty `actionParams` table here, as for every health
// check). Importing the package itself is not practical: v3.6 needs Go 1.27, v3.5 needs a
// gitops-engine pseudo-version the module proxy does not serve, and either pulls in most of
// Argo CD's dependency tree.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"time"

	lua "github.com/yuin/gopher-lua"
	luajson "layeh.com/gopher-json"
)

// HealthStatus is gitops-engine's health.HealthStatus (pkg/health/health.go), JSON tags and all.
type HealthStatus struct {
	Status          string `json:"status,omitempty"`
	Message         string `json:"message,omitempty"`
	DeletionMessage string `json:"deletionMessage,omitempty"`
}

const invalidHealthStatus = "Lua returned an invalid health status"

// runLua is runLuaWithResourceActionParameters without parameters. useOpenLibs is the VM's
// UseOpenLibs: true in Argo CD's own health test and for its built-in scripts, false for an
// argocd-cm `resource.customizations` entry unless that entry sets `useOpenLibs: true`.
func runLua(obj map[string]any, script string, useOpenLibs bool) (*lua.LState, error) {
	l := lua.NewState(lua.Options{
		SkipOpenLibs: !useOpenLibs,
	})
	// As in Argo CD: closed before the caller reads the result off the stack.
	defer l.Close()
	for _, pair := range []struct {
		n string
		f lua.LGFunction
	}{
		{lua.LoadLibName, lua.OpenPackage},
		{lua.BaseLibName, lua.OpenBase},
		{lua.TabLibName, lua.OpenTable},
		// Argo CD's 'safe' version of the OS library
		{lua.OsLibName, OpenSafeOs},
	} {
		if err := l.CallByParam(lua.P{
			Fn:      l.NewFunction(pair.f),
			NRet:    0,
			Protect: true,
		}, lua.LString(pair.n)); err != nil {
			panic(err)
		}
	}
	l.PreloadModule(lua.OsLibName, SafeOsLoader)

	ctx, cancel := context.WithTimeout(context.Background(), 1*time.Second)
	defer cancel()
	l.SetContext(ctx)

	l.SetGlobal("actionParams", l.CreateTable(0, 0))
	l.SetGlobal("obj", decodeValue(l, obj))

	fn, err := l.LoadString(script)
	if err == nil {
		l.Push(fn)
		err = l.PCall(0, lua.MultRet, nil)
	}
	if apiErr, ok := errors.AsType[*lua.ApiError](err); ok {
		if apiErr.Type == lua.ApiErrorRun {
			apiErr.StackTrace = ""
			err = apiErr
		}
	}
	return l, err
}

// executeHealthLua is VM.ExecuteHealthLua: the returned table goes through gopher-json and
// encoding/json, so a non-string status or message fails as it does in Argo CD.
func executeHealthLua(obj map[string]any, script string, useOpenLibs bool) (*HealthStatus, error) {
	l, err := runLua(obj, script, useOpenLibs)
	if err != nil {
		return nil, err
	}
	returnValue := l.Get(-1)
	if returnValue.Type() == lua.LTTable {
		jsonBytes, err := luajson.Encode(returnValue)
		if err != nil {
			return nil, err
		}
		healthStatus := &HealthStatus{}
		err = json.Unmarshal(jsonBytes, healthStatus)
		if err != nil {
			// An empty table encodes as an empty array
			if _, ok := errors.AsType[*json.UnmarshalTypeError](err); ok {
				return &HealthStatus{}, nil
			}
			return nil, err
		}
		if !isValidHealthStatusCode(healthStatus.Status) {
			return &HealthStatus{Status: "Unknown", Message: invalidHealthStatus}, nil
		}
		return healthStatus, nil
	} else if returnValue.Type() == lua.LTNil {
		return nil, nil
	}
	return nil, fmt.Errorf("expect table output from Lua script, not %s", returnValue.Type().String())
}

func isValidHealthStatusCode(status string) bool {
	switch status {
	case "Unknown", "Progressing", "Suspended", "Healthy", "Degraded", "Missing":
		return true
	}
	return false
}

// decodeValue is Argo CD's: every number becomes a gopher-lua number (a float64), a json.Number
// a string, anything else unknown nil.
func decodeValue(l *lua.LState, value any) lua.LValue {
	switch converted := value.(type) {
	case bool:
		return lua.LBool(converted)
	case float64:
		return lua.LNumber(converted)
	case string:
		return lua.LString(converted)
	case json.Number:
		return lua.LString(converted)
	case int:
		return lua.LNumber(converted)
	case int32:
		return lua.LNumber(converted)
	case int64:
		return lua.LNumber(converted)
	case []any:
		arr := l.CreateTable(len(converted), 0)
		for _, item := range converted {
			arr.Append(decodeValue(l, item))
		}
		return arr
	case map[string]any:
		tbl := l.CreateTable(0, len(converted))
		for key, item := range converted {
			tbl.RawSetH(lua.LString(key), decodeValue(l, item))
		}
		return tbl
	case nil:
		return lua.LNil
	}
	return lua.LNil
}
