// Command grafana-dashboard reads a Grafana dashboard the way Grafana's own schema does: with the
// types of grafana-foundation-sdk, generated from Grafana's dashboard model, decoding strictly (a
// field the model does not know is an error), then the model's own validation. It also checks what
// the model leaves open: every panel is of a panel type Grafana ships, and every query is a
// Prometheus query with an expression, on the dashboard's data source variable.
//
//	grafana-dashboard DASHBOARD.json
//
// It prints one line per query, `<panel title>\t<expr>`, and exits 1 with every finding on
// stderr. scripts/check-dashboard runs it on the chart's dashboard.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"strings"

	"github.com/grafana/grafana-foundation-sdk/go/cog"
	"github.com/grafana/grafana-foundation-sdk/go/cog/plugins"
	"github.com/grafana/grafana-foundation-sdk/go/dashboard"
	"github.com/grafana/grafana-foundation-sdk/go/prometheus"
)

func main() {
	if len(os.Args) != 2 {
		fmt.Fprintln(os.Stderr, "usage: grafana-dashboard DASHBOARD.json")
		os.Exit(2)
	}
	findings, queries, err := check(os.Args[1])
	if err != nil {
		fmt.Fprintf(os.Stderr, "%s: %v\n", os.Args[1], err)
		os.Exit(1)
	}
	for _, f := range findings {
		fmt.Fprintf(os.Stderr, "%s: %s\n", os.Args[1], f)
	}
	if len(findings) > 0 {
		os.Exit(1)
	}
	for _, q := range queries {
		fmt.Println(q)
	}
}

func check(path string) ([]string, []string, error) {
	raw, err := os.ReadFile(path)
	if err != nil {
		return nil, nil, err
	}
	plugins.RegisterDefaultPlugins()
	var board dashboard.Dashboard
	if err := noErrors(board.UnmarshalJSONStrict(raw)); err != nil {
		return nil, nil, fmt.Errorf("not a dashboard of Grafana's model: %w", err)
	}
	if err := noErrors(board.Validate()); err != nil {
		return nil, nil, fmt.Errorf("refused by the dashboard model's validation: %w", err)
	}
	var findings, queries []string
	panels := 0
	var visit func(p *dashboard.Panel)
	visit = func(p *dashboard.Panel) {
		panels++
		title := "(untitled)"
		if p.Title != nil {
			title = *p.Title
		}
		if _, known := cog.ConfigForPanelcfgVariant(p.Type); !known {
			findings = append(findings, fmt.Sprintf("panel %q: type %q is not a panel Grafana ships", title, p.Type))
		}
		if p.Type != "text" && len(p.Targets) == 0 {
			findings = append(findings, fmt.Sprintf("panel %q has no query", title))
		}
		for i, target := range p.Targets {
			query, ok := target.(*prometheus.Dataquery)
			if !ok {
				findings = append(findings, fmt.Sprintf("panel %q target %d is a %q query, not Prometheus", title, i, target.DataqueryType()))
				continue
			}
			if strings.TrimSpace(query.Expr) == "" {
				findings = append(findings, fmt.Sprintf("panel %q target %d has no expr", title, i))
			}
			ds := query.Datasource
			if ds == nil {
				ds = p.Datasource
			}
			if ds == nil || ds.Uid == nil || *ds.Uid != "${datasource}" {
				findings = append(findings, fmt.Sprintf("panel %q target %d is not on the ${datasource} variable", title, i))
			}
			queries = append(queries, title+"\t"+strings.ReplaceAll(query.Expr, "\n", " "))
		}
	}
	// The model's strict decoder (v0.0.22) drops each panel it decoded without error:
	// PanelOrRowPanel takes the panel's empty list of errors for an error and returns before
	// keeping the panel. So the panels are read again here, one by one: a row's panels are its own.
	var layout struct {
		Panels []struct {
			Type   string            `json:"type"`
			Panels []json.RawMessage `json:"panels"`
		} `json:"panels"`
	}
	var rawPanels struct {
		Panels []json.RawMessage `json:"panels"`
	}
	if err := json.Unmarshal(raw, &layout); err != nil {
		return nil, nil, err
	}
	if err := json.Unmarshal(raw, &rawPanels); err != nil {
		return nil, nil, err
	}
	decode := func(at string, text json.RawMessage) {
		var strict, p dashboard.Panel
		if err := noErrors(strict.UnmarshalJSONStrict(text)); err != nil {
			findings = append(findings, fmt.Sprintf("%s: %v", at, err))
			return
		}
		// The strict decoder also drops each query it decoded without error, for the same
		// reason; it has checked every field, so the content is read with the plain one.
		if err := json.Unmarshal(text, &p); err != nil {
			findings = append(findings, fmt.Sprintf("%s: %v", at, err))
			return
		}
		visit(&p)
	}
	for i, item := range layout.Panels {
		if item.Type != "row" {
			decode(fmt.Sprintf("panels[%d]", i), rawPanels.Panels[i])
			continue
		}
		for j, inner := range item.Panels {
			decode(fmt.Sprintf("panels[%d].panels[%d]", i, j), inner)
		}
	}
	if panels == 0 {
		return nil, nil, errors.New("the dashboard has no panel")
	}
	return findings, queries, nil
}

// noErrors is err, or nil when err is the model's empty list of errors, which its decoder and
// validator return as a non-nil error.
func noErrors(err error) error {
	if errs, ok := err.(cog.BuildErrors); ok && len(errs) == 0 {
		return nil
	}
	return err
}
