// Copyright The Prometheus Authors
// Licensed under the Apache License, Version 2.0 (the "License");
// you may not use this file except in compliance with the License.
// You may obtain a copy of the License at
//
// http://www.apache.org/licenses/LICENSE-2.0
//
// Unless required by applicable law or agreed to in writing, software
// distributed under the License is distributed on an "AS IS" BASIS,
// WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
// See the License for the specific language governing permissions and
// limitations under the License.

// Command rulecheck is the rule half of promtool, for Headroom's chart-check:
//
//	rulecheck check rules FILE...   # as `promtool check rules FILE...`
//	rulecheck test rules FILE...    # as `promtool test rules FILE...`
//
// with promtool's default flags (the duplicate-rules lint, not fatal; no
// feature flags) and its exit codes. It imports only the packages these two
// commands use (model/rulefmt, promql, rules, promql/promqltest), not
// promtool's service discoveries, so it builds in a fraction of promtool's
// time. checkRules, checkRuleGroups, checkDuplicates, ruleMetric and
// parseTime are adapted from Prometheus v0.316.0's cmd/promtool/main.go and
// query.go (Apache-2.0, see the notice above); unittest.go is its
// unittest.go.
package main

import (
	"errors"
	"fmt"
	"log/slog"
	"math"
	"os"
	"sort"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/common/model"
	"github.com/prometheus/common/promslog"

	"github.com/prometheus/prometheus/model/labels"
	"github.com/prometheus/prometheus/model/rulefmt"
	"github.com/prometheus/prometheus/promql/parser"
	"github.com/prometheus/prometheus/promql/promqltest"
	"github.com/prometheus/prometheus/rules"
)

const (
	successExitCode = 0
	failureExitCode = 1
	usageExitCode   = 2
)

func init() {
	// As promtool: UTF-8 metric and label names.
	//nolint:staticcheck
	model.NameValidationScheme = model.UTF8Validation
}

func main() {
	if len(os.Args) < 4 || os.Args[2] != "rules" || (os.Args[1] != "check" && os.Args[1] != "test") {
		fmt.Fprintln(os.Stderr, "usage: rulecheck check rules FILE...\n       rulecheck test rules FILE...")
		os.Exit(usageExitCode)
	}
	files := os.Args[3:]
	p := parser.NewParser(parser.Options{})
	switch os.Args[1] {
	case "check":
		failed, hasErrors := checkRules(files, p, promslog.New(&promslog.Config{}))
		if failed && hasErrors {
			os.Exit(failureExitCode)
		}
		os.Exit(successExitCode)
	case "test":
		os.Exit(RulesUnitTest(promqltest.LazyLoaderOpts{
			EnableAtModifier:     true,
			EnableNegativeOffset: true,
		}, p, false, files...))
	}
}

var errLint = errors.New("lint error")

// checkRules validates rule files.
func checkRules(files []string, p parser.Parser, logger *slog.Logger) (bool, bool) {
	failed := false
	hasErrors := false
	for _, f := range files {
		fmt.Println("Checking", f)
		rgs, errs := rulefmt.ParseFile(f, false, model.UTF8Validation, p, logger)
		if errs != nil {
			failed = true
			fmt.Fprintln(os.Stderr, "  FAILED:")
			for _, e := range errs {
				fmt.Fprintln(os.Stderr, e.Error())
				hasErrors = hasErrors || !errors.Is(e, errLint)
			}
			if hasErrors {
				continue
			}
		}
		if n, errs := checkRuleGroups(rgs); errs != nil {
			fmt.Fprintln(os.Stderr, "  FAILED:")
			for _, e := range errs {
				fmt.Fprintln(os.Stderr, e.Error())
			}
			failed = true
			for _, err := range errs {
				hasErrors = hasErrors || !errors.Is(err, errLint)
			}
		} else {
			fmt.Printf("  SUCCESS: %d rules found\n", n)
		}
		fmt.Println()
	}
	return failed, hasErrors
}

// checkRuleGroups counts the rules and runs the duplicate-rules lint.
func checkRuleGroups(rgs *rulefmt.RuleGroups) (int, []error) {
	numRules := 0
	for _, rg := range rgs.Groups {
		numRules += len(rg.Rules)
	}

	dRules := checkDuplicates(rgs.Groups)
	if len(dRules) != 0 {
		var errMessage strings.Builder
		fmt.Fprintf(&errMessage, "%d duplicate rule(s) found.\n", len(dRules))
		for _, n := range dRules {
			fmt.Fprintf(&errMessage, "Metric: %s\nLabel(s):\n", n.metric)
			n.label.Range(func(l labels.Label) {
				fmt.Fprintf(&errMessage, "\t%s: %s\n", l.Name, l.Value)
			})
		}
		errMessage.WriteString("Might cause inconsistency while recording expressions")
		return 0, []error{fmt.Errorf("%w %s", errLint, errMessage.String())}
	}

	return numRules, nil
}

type compareRuleType struct {
	metric string
	label  labels.Labels
}

type compareRuleTypes []compareRuleType

func (c compareRuleTypes) Len() int           { return len(c) }
func (c compareRuleTypes) Swap(i, j int)      { c[i], c[j] = c[j], c[i] }
func (c compareRuleTypes) Less(i, j int) bool { return compare(c[i], c[j]) < 0 }

func compare(a, b compareRuleType) int {
	if res := strings.Compare(a.metric, b.metric); res != 0 {
		return res
	}

	return labels.Compare(a.label, b.label)
}

func checkDuplicates(groups []rulefmt.RuleGroup) []compareRuleType {
	var duplicates []compareRuleType
	var cRules compareRuleTypes

	for _, group := range groups {
		for _, rule := range group.Rules {
			cRules = append(cRules, compareRuleType{
				metric: ruleMetric(rule),
				label:  rules.FromMaps(group.Labels, rule.Labels),
			})
		}
	}
	if len(cRules) < 2 {
		return duplicates
	}
	sort.Sort(cRules)

	last := cRules[0]
	for i := 1; i < len(cRules); i++ {
		if compare(last, cRules[i]) == 0 {
			// Don't add a duplicated rule multiple times.
			if len(duplicates) == 0 || compare(last, duplicates[len(duplicates)-1]) != 0 {
				duplicates = append(duplicates, cRules[i])
			}
		}
		last = cRules[i]
	}

	return duplicates
}

func ruleMetric(rule rulefmt.Rule) string {
	if rule.Alert != "" {
		return rule.Alert
	}
	return rule.Record
}

func parseTime(s string) (time.Time, error) {
	if t, err := strconv.ParseFloat(s, 64); err == nil {
		s, ns := math.Modf(t)
		return time.Unix(int64(s), int64(ns*float64(time.Second))).UTC(), nil
	}
	if t, err := time.Parse(time.RFC3339Nano, s); err == nil {
		return t, nil
	}
	return time.Time{}, fmt.Errorf("cannot parse %q to a valid timestamp", s)
}
