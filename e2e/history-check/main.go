// Command history-check decides whether a history of calls to dlock's lock server is
// linearizable against a model of a lease lock with global fencing tokens, using porcupine.
//
//	history-check [-timeout 10m] [-margin-ms 100] [-html-max-ops 20000] HISTORY.jsonl
//
// The history is JSON lines written by the workload of dlock/tests/it/history.rs: one line per
// call (client, op, key, session, times, answer) and one per fault injected (drawn in the
// visualisation only). The verdict goes to stdout; porcupine's HTML visualisation is written next
// to the history (HISTORY.html). Exit status: 0 linearizable, 1 a violation (the operations
// that could not be placed are named), 2 bad input, 3 the check ran out of time.
//
// What the model says is in docs/testing.md#history-check; in short, per key: at most one
// holder, an acquire succeeds only on a free key, renew and release only for the live grant's
// session and token, a read shows the live grant, a revocation ends it, an ended session holds
// nothing and never comes back; a grant ends by itself only once its TTL (or its session's) can
// have passed; and across every key, tokens strictly increase in real time and a revocation's
// floor is above every token issued before it. An answer whose outcome is unknown (503
// OUTCOME_UNKNOWN, 500, no answer) is an operation that may or may not have taken effect, at
// any time after it was sent.
package main

import (
	"bufio"
	"encoding/json"
	"flag"
	"fmt"
	"hash/fnv"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"time"

	"github.com/anishathalye/porcupine"
)

// Record is one line of the history.
type Record struct {
	// A call: who, what, with which arguments.
	Client  int    `json:"client"`
	Op      string `json:"op"` // open, heartbeat, end, acquire, renew, release, read, revoke
	Key     string `json:"key,omitempty"`
	Session string `json:"session,omitempty"`
	// The token sent (renew, release) or expected (revoke, 0 for none).
	Token int64 `json:"token,omitempty"`
	// The TTL asked for (acquire, renew), in ms.
	TTLMillis int64 `json:"ttl_ms,omitempty"`
	// What the client knows at the call: its session lives at least until then (ns since the
	// epoch): the last heartbeat or open that succeeded, sent at t, plus the session's TTL.
	SessionUntil int64 `json:"session_until,omitempty"`
	Call         int64 `json:"call"`
	// Null when no answer came that settles the outcome.
	Return *int64 `json:"ret"`
	// ok, fail (a definite refusal: nothing changed unless the model says so), unknown.
	Status string `json:"status"`
	Code   string `json:"code,omitempty"`
	Out    Out    `json:"out"`

	// A fault line instead of a call: what, from start to end (ns).
	Fault string `json:"fault,omitempty"`
	Start int64  `json:"start,omitempty"`
	End   int64  `json:"end,omitempty"`

	line int
}

// Out is what a successful answer said.
type Out struct {
	Token        int64  `json:"token,omitempty"`
	Held         bool   `json:"held,omitempty"`
	Session      string `json:"session,omitempty"`
	RevokedToken int64  `json:"revoked_token,omitempty"`
	Floor        int64  `json:"floor,omitempty"`
	NewSession   string `json:"new_session,omitempty"`
}

// input is what a partition's step sees: the record and which model judges it.
type input struct {
	tokens bool // the global token partition, else the key's
	r      *Record
}

// state is one possible state of a partition. Key partitions use the holder fields and Dead;
// the token partition uses MaxToken. Comparable with ==.
type state struct {
	Holder string // the holding session; "" when free
	Token  int64  // its token; 0 when granted by an acquire whose answer never came
	// The grant cannot have ended by its TTL (or its session's) before this (ns).
	NotBefore int64
	// Sessions known to be over (ended, or answered as expired or unknown), sorted, joined.
	Dead     string
	MaxToken int64
}

var margin int64 = 100 * int64(time.Millisecond)

func (s state) dead(session string) bool {
	if s.Dead == "" {
		return false
	}
	for _, d := range strings.Split(s.Dead, ",") {
		if d == session {
			return true
		}
	}
	return false
}

func (s state) withDead(session string) state {
	if s.dead(session) {
		return s
	}
	all := []string{session}
	if s.Dead != "" {
		all = append(all, strings.Split(s.Dead, ",")...)
	}
	sort.Strings(all)
	s.Dead = strings.Join(all, ",")
	if s.Holder == session {
		s.Holder, s.Token, s.NotBefore = "", 0, 0
	}
	return s
}

func (s state) free() state {
	s.Holder, s.Token, s.NotBefore = "", 0, 0
	return s
}

func ret(r *Record) int64 { return *r.Return }

// grantBound: a grant made or renewed by r lives at least until the earlier of its own TTL from
// the call and the session's known life.
func grantBound(r *Record) int64 {
	b := r.Call + r.TTLMillis*int64(time.Millisecond)
	if r.SessionUntil != 0 && r.SessionUntil < b {
		b = r.SessionUntil
	}
	return b
}

// sessionMayBeOver: the session of r may have lapsed by the time r was answered.
func sessionMayBeOver(s state, r *Record) bool {
	return s.dead(r.Session) || r.SessionUntil == 0 || ret(r)+margin >= r.SessionUntil
}

func isSessionGone(code string) bool {
	return code == "SESSION_EXPIRED" || code == "SESSION_UNKNOWN"
}

// lastReturn is, per session, the latest return of any of its calls (the end of the history
// for one whose outcome is unknown).
var lastReturn = map[string]int64{}

// prune forgets the dead sessions whose calls all returned before t: each of them is placed
// before a call made at t, so no later step asks about them. It keeps the states small.
func prune(s state, t int64) state {
	if s.Dead == "" {
		return s
	}
	var keep []string
	for _, d := range strings.Split(s.Dead, ",") {
		if lastReturn[d] >= t {
			keep = append(keep, d)
		}
	}
	s.Dead = strings.Join(keep, ",")
	return s
}

// stepKey: the successors of s under r on one key, after the holder's grant may have lapsed.
func stepKey(s state, r *Record) []state {
	s = prune(s, r.Call)
	var out []state
	candidates := []state{s}
	if s.Holder != "" && ret(r) >= s.NotBefore-margin {
		candidates = append(candidates, s.free())
	}
	for _, c := range candidates {
		out = append(out, applyKey(c, r)...)
	}
	return out
}

func applyKey(s state, r *Record) []state {
	unknown := r.Status == "unknown"
	ok := r.Status == "ok"
	gone := r.Status == "fail" && isSessionGone(r.Code)
	if gone {
		// The session is over: it holds nothing from now on. Refused only while the client
		// knows the session must still live.
		if !sessionMayBeOver(s, r) {
			return nil
		}
		return []state{s.withDead(r.Session)}
	}
	switch r.Op {
	case "acquire":
		switch {
		case ok:
			if s.Holder != "" || s.dead(r.Session) {
				return nil
			}
			s.Holder, s.Token, s.NotBefore = r.Session, r.Out.Token, grantBound(r)
			return []state{s}
		case unknown:
			g := s
			g.Holder, g.Token, g.NotBefore = r.Session, 0, grantBound(r)
			return unknownOutcome(s, s.Holder == "" && !s.dead(r.Session), g)
		case r.Code == "LOCK_CONTENDED":
			if s.Holder == "" {
				return nil
			}
			return []state{s}
		default:
			return []state{s}
		}
	case "renew":
		mine := s.Holder == r.Session && (s.Token == r.Token || s.Token == 0)
		switch {
		case ok:
			if !mine || s.dead(r.Session) || r.Out.Token != r.Token {
				return nil
			}
			s.Token, s.NotBefore = r.Token, grantBound(r)
			return []state{s}
		case r.Code == "LOCK_LOST":
			if s.Holder == r.Session && s.Token == r.Token {
				return nil
			}
			return []state{s}
		default: // unknown: a renew only ever extends, which the bound already allows for
			return []state{s}
		}
	case "release":
		mine := s.Holder == r.Session && (s.Token == r.Token || s.Token == 0)
		switch {
		case ok:
			if !mine {
				return nil
			}
			return []state{s.free()}
		case unknown:
			return unknownOutcome(s, mine, s.free())
		case r.Code == "LOCK_LOST":
			if s.Holder == r.Session && s.Token == r.Token {
				return nil
			}
			return []state{s}
		default:
			return []state{s}
		}
	case "read":
		switch {
		case ok && !r.Out.Held, r.Status == "fail" && r.Code == "NOT_FOUND":
			if s.Holder != "" {
				return nil
			}
			return []state{s}
		case ok:
			if s.Holder != r.Out.Session || (s.Token != 0 && s.Token != r.Out.Token) {
				return nil
			}
			s.Token = r.Out.Token
			return []state{s}
		default:
			return []state{s}
		}
	case "revoke":
		matches := s.Holder != "" && (r.Token == 0 || s.Token == 0 || s.Token == r.Token)
		switch {
		case ok:
			if !matches || (s.Token != 0 && s.Token != r.Out.RevokedToken) {
				return nil
			}
			return []state{s.free()}
		case unknown:
			return unknownOutcome(s, matches, s.free())
		case r.Code == "NOT_FOUND":
			if s.Holder != "" {
				return nil
			}
			return []state{s}
		case r.Code == "FENCED_OUT":
			if s.Holder == "" || (s.Token != 0 && s.Token == r.Token) {
				return nil
			}
			return []state{s}
		default:
			return []state{s}
		}
	case "end":
		switch {
		case ok:
			if s.dead(r.Session) {
				return nil
			}
			return []state{s.withDead(r.Session)}
		case unknown:
			return []state{s, s.withDead(r.Session)}
		default:
			return []state{s}
		}
	case "heartbeat":
		if ok && s.dead(r.Session) {
			return nil
		}
		return []state{s}
	}
	return []state{s}
}

// unknownOutcome: the successors of s under a call whose outcome is unknown: it may not have
// taken effect (s) and, when it could have (could), may have (after).
func unknownOutcome(s state, could bool, after state) []state {
	if could {
		return []state{s, after}
	}
	return []state{s}
}

// stepTokens: across every key, a granted token is above every token granted (or floor set)
// before the grant; a revocation's floor is above every token granted before it.
func stepTokens(s state, r *Record) []state {
	switch r.Op {
	case "acquire":
		if r.Out.Token <= s.MaxToken {
			return nil
		}
		s.MaxToken = r.Out.Token
	case "revoke":
		if r.Out.Floor <= s.MaxToken || r.Out.Floor < r.Out.RevokedToken {
			return nil
		}
		s.MaxToken = r.Out.Floor
	}
	return []state{s}
}

// constrains: whether r's step on a key can be anything but the identity (see applyKey). A call
// that constrains nothing is left out of the key's partition: it could be placed anywhere, and
// an unknown one kept open to the end of the history only slows the search down.
func constrains(r *Record) bool {
	switch r.Status {
	case "ok":
		return true
	case "unknown":
		return r.Op == "acquire" || r.Op == "release" || r.Op == "revoke" || r.Op == "end"
	}
	if isSessionGone(r.Code) {
		return true
	}
	switch r.Op {
	case "acquire":
		return r.Code == "LOCK_CONTENDED"
	case "renew", "release":
		return r.Code == "LOCK_LOST"
	case "read":
		return r.Code == "NOT_FOUND"
	case "revoke":
		return r.Code == "NOT_FOUND" || r.Code == "FENCED_OUT"
	}
	return false
}

func partition(history []porcupine.Operation) [][]porcupine.Operation {
	byKey := map[string][]porcupine.Operation{}
	var keys []string
	var sessionWide, tokens []porcupine.Operation
	for _, op := range history {
		r := op.Input.(input).r
		if !constrains(r) {
			continue
		}
		switch r.Op {
		case "end", "heartbeat":
			sessionWide = append(sessionWide, op)
		case "acquire", "renew", "release", "read", "revoke":
			if _, seen := byKey[r.Key]; !seen {
				keys = append(keys, r.Key)
			}
			byKey[r.Key] = append(byKey[r.Key], op)
			if r.Status == "ok" && (r.Op == "acquire" || r.Op == "revoke") {
				t := op
				t.Input = input{tokens: true, r: r}
				tokens = append(tokens, t)
			}
		}
	}
	sort.Strings(keys)
	var out [][]porcupine.Operation
	for _, k := range keys {
		ops := append([]porcupine.Operation{}, byKey[k]...)
		// Ending a session and its heartbeats concern every key the session may hold.
		ops = append(ops, sessionWide...)
		sort.SliceStable(ops, func(i, j int) bool { return ops[i].Call < ops[j].Call })
		out = append(out, ops)
	}
	if len(tokens) > 0 {
		out = append(out, tokens)
	}
	return out
}

func describe(r *Record) string {
	var b strings.Builder
	fmt.Fprintf(&b, "%s", r.Op)
	if r.Key != "" {
		fmt.Fprintf(&b, " %s", r.Key)
	}
	if r.Session != "" {
		fmt.Fprintf(&b, " s=%s", short(r.Session))
	}
	if r.Token != 0 {
		fmt.Fprintf(&b, " t=%d", r.Token)
	}
	switch r.Status {
	case "ok":
		b.WriteString(" → ok")
		switch r.Op {
		case "acquire", "renew":
			fmt.Fprintf(&b, " token %d", r.Out.Token)
		case "read":
			if r.Out.Held {
				fmt.Fprintf(&b, " held by s=%s token %d", short(r.Out.Session), r.Out.Token)
			} else {
				b.WriteString(" free")
			}
		case "revoke":
			fmt.Fprintf(&b, " revoked %d floor %d", r.Out.RevokedToken, r.Out.Floor)
		}
	case "unknown":
		fmt.Fprintf(&b, " → unknown (%s)", r.Code)
	default:
		fmt.Fprintf(&b, " → %s", r.Code)
	}
	return b.String()
}

func short(s string) string {
	if len(s) > 8 {
		return s[:8]
	}
	return s
}

func model() porcupine.Model {
	nm := porcupine.NondeterministicModel{
		Partition: partition,
		Init:      func() []interface{} { return []interface{}{state{}} },
		Step: func(st, in, _ interface{}) []interface{} {
			s := st.(state)
			i := in.(input)
			var next []state
			if i.tokens {
				next = stepTokens(s, i.r)
			} else {
				next = stepKey(s, i.r)
			}
			out := make([]interface{}, len(next))
			for k, n := range next {
				out[k] = n
			}
			return out
		},
		Hash: func(st interface{}) uint64 {
			s := st.(state)
			h := fnv.New64a()
			fmt.Fprintf(h, "%s|%d|%d|%s|%d", s.Holder, s.Token, s.NotBefore, s.Dead, s.MaxToken)
			return h.Sum64()
		},
		DescribeOperation: func(in, _ interface{}) string { return describe(in.(input).r) },
		DescribeState: func(st interface{}) string {
			s := st.(state)
			if s.MaxToken != 0 || (s.Holder == "" && s.Dead == "") {
				if s.MaxToken != 0 {
					return fmt.Sprintf("highest token %d", s.MaxToken)
				}
				return "free"
			}
			if s.Holder == "" {
				return "free"
			}
			return fmt.Sprintf("s=%s token %d", short(s.Holder), s.Token)
		},
	}
	return nm.ToModel()
}

func read(path string) ([]*Record, []*Record, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, nil, err
	}
	defer f.Close()
	var calls, faults []*Record
	sc := bufio.NewScanner(f)
	sc.Buffer(make([]byte, 1<<20), 1<<20)
	n := 0
	for sc.Scan() {
		n++
		line := strings.TrimSpace(sc.Text())
		if line == "" {
			continue
		}
		r := &Record{line: n}
		dec := json.NewDecoder(strings.NewReader(line))
		dec.DisallowUnknownFields()
		if err := dec.Decode(r); err != nil {
			return nil, nil, fmt.Errorf("%s:%d: %v", path, n, err)
		}
		if r.Fault != "" {
			faults = append(faults, r)
			continue
		}
		switch r.Op {
		case "open", "heartbeat", "end", "acquire", "renew", "release", "read", "revoke":
		default:
			return nil, nil, fmt.Errorf("%s:%d: unknown op %q", path, n, r.Op)
		}
		switch r.Status {
		case "ok", "fail":
			if r.Return == nil {
				return nil, nil, fmt.Errorf("%s:%d: a %s answer needs ret", path, n, r.Status)
			}
		case "unknown":
		default:
			return nil, nil, fmt.Errorf("%s:%d: status %q is none of ok, fail, unknown", path, n, r.Status)
		}
		if r.Return != nil && *r.Return < r.Call {
			return nil, nil, fmt.Errorf("%s:%d: ret before call", path, n)
		}
		if r.Op != "open" && r.Op != "read" && r.Op != "revoke" && r.Session == "" {
			return nil, nil, fmt.Errorf("%s:%d: %s needs a session", path, n, r.Op)
		}
		calls = append(calls, r)
	}
	if err := sc.Err(); err != nil {
		return nil, nil, err
	}
	return calls, faults, nil
}

func main() {
	timeout := flag.Duration("timeout", 10*time.Minute, "give up (exit 3) after this long")
	htmlMax := flag.Int("html-max-ops", 20000, "draw the whole history only up to this many operations (a violation is always drawn)")
	marginMs := flag.Int64("margin-ms", 100, "slack on every lease bound, for the clocks' granularity")
	flag.Usage = func() {
		fmt.Fprintf(os.Stderr, "usage: history-check [-timeout 10m] [-margin-ms 100] [-html-max-ops 20000] HISTORY.jsonl\n")
		flag.PrintDefaults()
	}
	flag.Parse()
	if flag.NArg() != 1 {
		flag.Usage()
		os.Exit(2)
	}
	margin = *marginMs * int64(time.Millisecond)
	path := flag.Arg(0)
	calls, faults, err := read(path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "history-check: %v\n", err)
		os.Exit(2)
	}
	if len(calls) == 0 {
		fmt.Fprintf(os.Stderr, "history-check: %s holds no calls\n", path)
		os.Exit(2)
	}
	// An operation whose outcome is unknown stays open to the end of the history: it may take
	// effect at any time after its call, or never.
	var end int64
	for _, r := range calls {
		if r.Return != nil && *r.Return > end {
			end = *r.Return
		}
		if r.Call > end {
			end = r.Call
		}
	}
	end++
	unknown := 0
	history := make([]porcupine.Operation, 0, len(calls))
	for _, r := range calls {
		if r.Status == "unknown" {
			e := end
			r.Return = &e
			unknown++
		}
		if r.Session != "" && *r.Return > lastReturn[r.Session] {
			lastReturn[r.Session] = *r.Return
		}
		history = append(history, porcupine.Operation{
			ClientId: r.Client, Input: input{r: r}, Call: r.Call, Output: nil, Return: *r.Return,
			Metadata: fmt.Sprintf("line %d", r.line),
		})
	}
	m := model()
	parts := partition(history)
	// Each partition on its own, all at once: which ones fail, and nothing more (cheap).
	single := m
	single.Partition = nil
	started := time.Now()
	results := make([]porcupine.CheckResult, len(parts))
	var wg sync.WaitGroup
	for i, ops := range parts {
		wg.Add(1)
		go func() {
			defer wg.Done()
			results[i] = porcupine.CheckOperationsTimeout(single, ops, *timeout)
		}()
	}
	wg.Wait()
	took := time.Since(started)
	result := porcupine.Ok
	var failing [][]porcupine.Operation
	for i, r := range results {
		switch {
		case r == porcupine.Illegal:
			result = porcupine.Illegal
			failing = append(failing, parts[i])
		case r == porcupine.Unknown && result == porcupine.Ok:
			result = porcupine.Unknown
		}
	}

	// The visualisation (and, on a violation, the calls it is stuck at): of the failing
	// partitions, or of the whole history when it is small enough to be drawn (recording the
	// partial linearizations costs time and memory quadratic in a partition's length).
	html := strings.TrimSuffix(path, filepath.Ext(path)) + ".html"
	drawn := failing
	if result != porcupine.Illegal && len(history) <= *htmlMax {
		drawn = parts
	}
	var info porcupine.LinearizationInfo
	if drawn != nil {
		viz := single
		viz.Partition = func([]porcupine.Operation) [][]porcupine.Operation { return drawn }
		_, info = porcupine.CheckOperationsVerbose(viz, history, *timeout)
		var annotations []porcupine.Annotation
		for _, f := range faults {
			annotations = append(annotations, porcupine.Annotation{
				Tag: "faults", Start: f.Start, End: f.End, Description: f.Fault,
				BackgroundColor: "#f4c7c3",
			})
		}
		info.AddAnnotations(annotations)
		if err := porcupine.VisualizePath(m, info, html); err != nil {
			fmt.Fprintf(os.Stderr, "history-check: writing %s: %v\n", html, err)
		}
	}

	counts := map[string]int{}
	for _, r := range calls {
		counts[r.Op+" "+r.Status]++
	}
	var summary []string
	for k, v := range counts {
		summary = append(summary, fmt.Sprintf("%s %d", k, v))
	}
	sort.Strings(summary)
	fmt.Printf("history %s: %d operations (%d with unknown outcome), %d faults, %d partitions\n",
		path, len(calls), unknown, len(faults), len(parts))
	fmt.Printf("  %s\n", strings.Join(summary, ", "))
	if drawn != nil {
		fmt.Printf("  visualisation: %s\n", html)
	} else {
		fmt.Printf("  no visualisation: %d operations, more than -html-max-ops %d\n", len(history), *htmlMax)
	}
	switch result {
	case porcupine.Ok:
		fmt.Printf("verdict: linearizable (checked in %d ms)\n", took.Milliseconds())
	case porcupine.Unknown:
		fmt.Printf("verdict: unknown, the check ran out of time after %s (raise -timeout)\n", took.Round(time.Millisecond))
		os.Exit(3)
	default:
		fmt.Printf("verdict: NOT linearizable (checked in %d ms)\n", took.Milliseconds())
		explain(drawn, info)
		os.Exit(1)
	}
}

// explain names, for each partition that could not be linearized, the operations at which every
// attempt got stuck: those not in the longest linearizable prefix that were called before any
// of the rest had to have taken effect.
func explain(parts [][]porcupine.Operation, info porcupine.LinearizationInfo) {
	partials := info.PartialLinearizations()
	for p, ops := range parts {
		best := map[int]bool{}
		for _, lin := range partials[p] {
			if len(lin) > len(best) {
				best = map[int]bool{}
				for _, id := range lin {
					best[id] = true
				}
			}
		}
		if len(best) == len(ops) {
			continue
		}
		name := "key " + ops[0].Input.(input).r.Key
		if ops[0].Input.(input).tokens {
			name = "the global token order"
		}
		for _, op := range ops {
			if r := op.Input.(input).r; !op.Input.(input).tokens && r.Key != "" {
				name = "key " + r.Key
				break
			}
		}
		var rest []int
		firstReturn := int64(1<<63 - 1)
		for id, op := range ops {
			if !best[id] {
				rest = append(rest, id)
				if op.Return < firstReturn {
					firstReturn = op.Return
				}
			}
		}
		fmt.Printf("  violation on %s: %d of %d operations linearize; stuck at:\n", name, len(best), len(ops))
		for _, id := range rest {
			op := ops[id]
			if op.Call > firstReturn {
				continue
			}
			r := op.Input.(input).r
			fmt.Printf("    line %d, client %d: %s\n", r.line, r.Client, describe(r))
		}
	}
}
