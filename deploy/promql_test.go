package deploy

import (
	"fmt"
	"slices"
	"strings"
	"testing"
	"unicode"
)

// A small PromQL reader: enough to check that an expression is well formed
// (balanced brackets, matchers of the form label op "string", known
// functions, durations in ranges) and to pull out the metric selectors, the
// label matchers on them and the grouping labels. It is not a full parser;
// promtool check rules does the full check of the alert rules when present.

type tokKind int

const (
	tIdent tokKind = iota
	tNumber
	tString
	tVar // Grafana variable: $x, ${x}, [[x]]
	tPunct
)

type token struct {
	kind tokKind
	val  string
	pos  int
}

func isIdentStart(r byte) bool { return r == '_' || r == ':' || unicode.IsLetter(rune(r)) }
func isIdentChar(r byte) bool  { return isIdentStart(r) || (r >= '0' && r <= '9') }

func lex(src string) ([]token, error) {
	var out []token
	i := 0
	for i < len(src) {
		c := src[i]
		switch {
		case c == ' ' || c == '\t' || c == '\n' || c == '\r':
			i++
		case c == '#':
			for i < len(src) && src[i] != '\n' {
				i++
			}
		case c == '"' || c == '\'' || c == '`':
			j := i + 1
			for ; j < len(src) && src[j] != c; j++ {
				if src[j] == '\\' && c != '`' {
					j++
				}
			}
			if j >= len(src) {
				return nil, fmt.Errorf("unterminated string at %d", i)
			}
			out = append(out, token{tString, src[i+1 : j], i})
			i = j + 1
		case c == '$':
			j := i + 1
			if j < len(src) && src[j] == '{' {
				k := strings.IndexByte(src[j:], '}')
				if k < 0 {
					return nil, fmt.Errorf("unterminated ${ at %d", i)
				}
				j += k + 1
			} else {
				for j < len(src) && isIdentChar(src[j]) {
					j++
				}
			}
			if j == i+1 {
				return nil, fmt.Errorf("bare $ at %d", i)
			}
			out = append(out, token{tVar, src[i:j], i})
			i = j
		case c == '[' && strings.HasPrefix(src[i:], "[["):
			k := strings.Index(src[i:], "]]")
			if k < 0 {
				return nil, fmt.Errorf("unterminated [[ at %d", i)
			}
			out = append(out, token{tVar, src[i : i+k+2], i})
			i += k + 2
		case c >= '0' && c <= '9' || c == '.' && i+1 < len(src) && src[i+1] >= '0' && src[i+1] <= '9':
			// Numbers and durations (1m, 5m30s, 1.5e3, 0x1f).
			j := i
			for j < len(src) && (isIdentChar(src[j]) || src[j] == '.' ||
				(src[j] == '+' || src[j] == '-') && (src[j-1] == 'e' || src[j-1] == 'E')) {
				j++
			}
			out = append(out, token{tNumber, src[i:j], i})
			i = j
		case isIdentStart(c):
			j := i
			for j < len(src) && isIdentChar(src[j]) {
				j++
			}
			out = append(out, token{tIdent, src[i:j], i})
			i = j
		default:
			for _, op := range []string{"==", "!=", "<=", ">=", "=~", "!~"} {
				if strings.HasPrefix(src[i:], op) {
					out = append(out, token{tPunct, op, i})
					i += 2
					goto next
				}
			}
			if !strings.ContainsRune("(){}[],+-*/%^<>=@", rune(c)) {
				return nil, fmt.Errorf("unexpected %q at %d", c, i)
			}
			out = append(out, token{tPunct, string(c), i})
			i++
		next:
		}
	}
	return out, nil
}

// Functions and aggregations a query may call (PromQL's, as of 2.x).
var promFuncs = map[string]bool{}

func init() {
	for _, f := range strings.Fields(`sum avg min max count group stddev stdvar topk bottomk quantile count_values
		rate irate increase delta idelta deriv predict_linear resets changes
		histogram_quantile histogram_count histogram_sum histogram_fraction
		abs ceil floor round exp ln log2 log10 sqrt sgn clamp clamp_min clamp_max
		vector scalar time timestamp absent absent_over_time present_over_time label_replace label_join
		sort sort_desc avg_over_time min_over_time max_over_time sum_over_time count_over_time
		last_over_time quantile_over_time stddev_over_time stdvar_over_time
		day_of_month day_of_week day_of_year days_in_month hour minute month year`) {
		promFuncs[f] = true
	}
}

var promAggs = map[string]bool{}

func init() {
	for _, f := range strings.Fields(`sum avg min max count group stddev stdvar topk bottomk quantile count_values`) {
		promAggs[f] = true
	}
}

var promKeywords = map[string]bool{
	"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	"bool": true, "and": true, "or": true, "unless": true, "offset": true,
	"inf": true, "nan": true, "Inf": true, "NaN": true,
}

// Matcher is one label matcher of a selector.
type Matcher struct{ Label, Op, Value string }

// Selector is one metric name used in an expression, with the function
// call it sits in directly (rate, histogram_quantile, ...; "" if none).
type Selector struct {
	Name     string
	Matchers []Matcher
	Func     string
}

// Query is what an expression uses.
type Query struct {
	Selectors []Selector
	// Grouping lists labels named in by/without/on/ignoring/group_x.
	Grouping []string
}

// parseQuery checks expr's structure and extracts what it uses.
func parseQuery(expr string) (Query, error) {
	toks, err := lex(expr)
	if err != nil {
		return Query{}, err
	}
	if len(toks) == 0 {
		return Query{}, fmt.Errorf("empty expression")
	}
	var q Query
	type frame struct {
		open byte
		fn   string // function of a "(" frame
	}
	var stack []frame
	innerFunc := func() string {
		for i := len(stack) - 1; i >= 0; i-- {
			if stack[i].open == '(' {
				return stack[i].fn
			}
		}
		return ""
	}
	peek := func(i int) token {
		if i < len(toks) {
			return toks[i]
		}
		return token{kind: tPunct, val: "", pos: len(expr)}
	}
	// labelList reads "( a, b, ... )" starting at toks[i] == "(".
	labelList := func(i int) (int, []string, error) {
		if peek(i).val != "(" {
			return i, nil, fmt.Errorf("want ( after grouping keyword at %d", peek(i).pos)
		}
		i++
		var labels []string
		for {
			t := peek(i)
			switch {
			case t.val == ")":
				return i + 1, labels, nil
			case t.kind == tIdent:
				labels = append(labels, t.val)
				i++
				if n := peek(i); n.val == "," {
					i++
				} else if n.val != ")" {
					return i, nil, fmt.Errorf("want , or ) in label list at %d", n.pos)
				}
			default:
				return i, nil, fmt.Errorf("want label name in list at %d, got %q", t.pos, t.val)
			}
		}
	}
	// matchers reads "{ l op "v", ... }" starting at toks[i] == "{".
	matchers := func(i int) (int, []Matcher, error) {
		i++
		var ms []Matcher
		for {
			t := peek(i)
			if t.val == "}" {
				return i + 1, ms, nil
			}
			if t.kind != tIdent {
				return i, nil, fmt.Errorf("want label name in matcher at %d, got %q", t.pos, t.val)
			}
			op, v := peek(i+1), peek(i+2)
			if !slices.Contains([]string{"=", "!=", "=~", "!~"}, op.val) || op.kind != tPunct {
				return i, nil, fmt.Errorf("want matcher operator after %s at %d", t.val, op.pos)
			}
			if v.kind != tString {
				return i, nil, fmt.Errorf("want quoted value for %s at %d", t.val, v.pos)
			}
			ms = append(ms, Matcher{t.val, op.val, v.val})
			i += 3
			if n := peek(i); n.val == "," {
				i++
			} else if n.val != "}" {
				return i, nil, fmt.Errorf("want , or } after matcher at %d", n.pos)
			}
		}
	}
	for i := 0; i < len(toks); {
		t := toks[i]
		switch {
		case t.kind == tIdent && promKeywords[t.val]:
			switch t.val {
			case "by", "without", "on", "ignoring", "group_left", "group_right":
				if t.val != "group_left" && t.val != "group_right" || peek(i+1).val == "(" {
					j, ls, err := labelList(i + 1)
					if err != nil {
						return q, err
					}
					q.Grouping = append(q.Grouping, ls...)
					i = j
					continue
				}
			}
			i++
		case t.kind == tIdent && promAggs[t.val] && (peek(i+1).val == "by" || peek(i+1).val == "without"):
			// sum by (l) (expr)
			j, ls, err := labelList(i + 2)
			if err != nil {
				return q, err
			}
			q.Grouping = append(q.Grouping, ls...)
			if peek(j).val != "(" {
				return q, fmt.Errorf("want ( after %s %s (...) at %d", t.val, peek(i+1).val, peek(j).pos)
			}
			stack = append(stack, frame{'(', t.val})
			i = j + 1
		case t.kind == tIdent && peek(i+1).val == "(":
			if !promFuncs[t.val] {
				return q, fmt.Errorf("unknown function %q at %d", t.val, t.pos)
			}
			stack = append(stack, frame{'(', t.val})
			i += 2
		case t.kind == tIdent:
			s := Selector{Name: t.val, Func: innerFunc()}
			i++
			if peek(i).val == "{" {
				j, ms, err := matchers(i)
				if err != nil {
					return q, err
				}
				s.Matchers, i = ms, j
			}
			q.Selectors = append(q.Selectors, s)
		case t.val == "{":
			// A selector without a metric name: {__name__="x"}.
			j, ms, err := matchers(i)
			if err != nil {
				return q, err
			}
			s := Selector{Func: innerFunc(), Matchers: ms}
			for _, m := range ms {
				if m.Label == "__name__" && m.Op == "=" {
					s.Name = m.Value
				}
			}
			if s.Name == "" {
				return q, fmt.Errorf("selector without a metric name at %d", t.pos)
			}
			q.Selectors = append(q.Selectors, s)
			i = j
		case t.val == "(" || t.val == "[":
			stack = append(stack, frame{t.val[0], ""})
			if t.val == "[" {
				// A range or subquery: durations, variables and one ':'.
				j := i + 1
				for ; j < len(toks) && toks[j].val != "]"; j++ {
					if k := toks[j]; k.kind != tNumber && k.kind != tVar && k.val != ":" {
						return q, fmt.Errorf("bad range at %d: %q", k.pos, k.val)
					}
				}
				if j == i+1 {
					return q, fmt.Errorf("empty range at %d", t.pos)
				}
				i = j
				continue
			}
			i++
		case t.val == ")" || t.val == "]" || t.val == "}":
			want := map[string]byte{")": '(', "]": '[', "}": '{'}[t.val]
			if len(stack) == 0 || stack[len(stack)-1].open != want {
				return q, fmt.Errorf("unbalanced %q at %d", t.val, t.pos)
			}
			stack = stack[:len(stack)-1]
			i++
		default:
			i++
		}
	}
	if len(stack) != 0 {
		return q, fmt.Errorf("unclosed %q", stack[len(stack)-1].open)
	}
	return q, nil
}

func TestParseQuery(t *testing.T) {
	q, err := parseQuery(`histogram_quantile(0.99, sum by (le, stage) (rate(kvflow_stage_duration_seconds_bucket{job=~"$job",instance=~"${instance}"}[$__rate_interval])))`)
	if err != nil {
		t.Fatal(err)
	}
	if len(q.Selectors) != 1 || q.Selectors[0].Name != "kvflow_stage_duration_seconds_bucket" || q.Selectors[0].Func != "rate" ||
		len(q.Selectors[0].Matchers) != 2 || q.Selectors[0].Matchers[1] != (Matcher{"instance", "=~", "${instance}"}) {
		t.Errorf("selectors: %+v", q.Selectors)
	}
	if !slices.Equal(q.Grouping, []string{"le", "stage"}) {
		t.Errorf("grouping: %v", q.Grouping)
	}
	q, err = parseQuery(`(a >= b) and on (job, stage) (sum without (x) (rate(c_total[5m:1m] offset 1h)) == 0) or {__name__="d"} * 1e-3`)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, s := range q.Selectors {
		names = append(names, s.Name)
	}
	if !slices.Equal(names, []string{"a", "b", "c_total", "d"}) || !slices.Equal(q.Grouping, []string{"job", "stage", "x"}) {
		t.Errorf("names %v grouping %v", names, q.Grouping)
	}
	for _, bad := range []string{
		``, `rate(x[1m]`, `sum(x))`, `x{a="b"`, `x{a=b}`, `x{a~"b"}`, `rat(x[1m])`, `x[]`, `x[foo]`,
		`sum by stage (x)`, `x{a="b}`, `x ; y`, `{a="b"}`,
	} {
		if _, err := parseQuery(bad); err == nil {
			t.Errorf("%q: no error", bad)
		}
	}
}
