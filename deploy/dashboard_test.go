package deploy

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/http/httptest"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/promhttp"
	dto "github.com/prometheus/client_model/go"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/decode"
	"github.com/kvflow/kvflow/internal/node"
	"github.com/kvflow/kvflow/internal/prefill"
	"github.com/kvflow/kvflow/internal/tooling/testkit/loopback"
)

const (
	dashboardFile  = "grafana/kvflow.json"
	promConfigFile = "prometheus/prometheus.yml"
	alertsFile     = "prometheus/alerts.yml"
	alertTestsFile = "prometheus/alerts_test.yml"
)

// expr is one PromQL expression and where it came from.
type expr struct {
	where, src string
}

// --- the dashboard ---------------------------------------------------------

var labelValuesRE = regexp.MustCompile(`^\s*label_values\((.+),\s*([a-zA-Z_][a-zA-Z0-9_]*)\s*\)\s*$`)

func loadDashboard(t *testing.T) map[string]any {
	t.Helper()
	b, err := os.ReadFile(dashboardFile)
	if err != nil {
		t.Fatal(err)
	}
	var d map[string]any
	if err := json.Unmarshal(b, &d); err != nil {
		t.Fatalf("%s: %v", dashboardFile, err)
	}
	return d
}

// dashboardExprs returns every target expression and every templating
// query (label_values(selector, label) reduced to its selector).
func dashboardExprs(t *testing.T, d map[string]any) []expr {
	t.Helper()
	var out []expr
	var walk func(v any, where string)
	walk = func(v any, where string) {
		switch v := v.(type) {
		case map[string]any:
			w := where
			if title, ok := v["title"].(string); ok {
				w = title
			}
			if e, ok := v["expr"].(string); ok {
				out = append(out, expr{fmt.Sprintf("panel %q target %v", w, v["refId"]), e})
			}
			for k, c := range v {
				if k != "templating" {
					walk(c, w)
				}
			}
		case []any:
			for _, c := range v {
				walk(c, where)
			}
		}
	}
	walk(d["panels"], "")
	tmpl, _ := d["templating"].(map[string]any)
	list, _ := tmpl["list"].([]any)
	for _, v := range list {
		v, _ := v.(map[string]any)
		if v["type"] != "query" {
			continue
		}
		q, ok := v["query"].(string)
		if m, isMap := v["query"].(map[string]any); isMap {
			q, ok = m["query"].(string)
		}
		if !ok {
			t.Errorf("variable %v: no query", v["name"])
			continue
		}
		m := labelValuesRE.FindStringSubmatch(q)
		if m == nil {
			t.Errorf("variable %v: want label_values(selector, label), got %q", v["name"], q)
			continue
		}
		out = append(out, expr{fmt.Sprintf("variable %v", v["name"]), m[1]})
	}
	return out
}

func TestDashboardStructure(t *testing.T) {
	d := loadDashboard(t)
	if v, _ := d["schemaVersion"].(float64); v < 36 {
		t.Errorf("schemaVersion %v: want >= 36", d["schemaVersion"])
	}
	if d["uid"] == "" || d["title"] == "" {
		t.Error("dashboard needs a uid and a title")
	}
	vars := map[string]map[string]any{}
	tmpl, _ := d["templating"].(map[string]any)
	list, _ := tmpl["list"].([]any)
	for _, v := range list {
		v, _ := v.(map[string]any)
		name, _ := v["name"].(string)
		vars[name] = v
	}
	if ds := vars["DS_PROMETHEUS"]; ds == nil || ds["type"] != "datasource" || ds["query"] != "prometheus" {
		t.Errorf("want a prometheus datasource variable DS_PROMETHEUS, got %v", ds)
	}
	for _, name := range []string{"job", "instance"} {
		if v := vars[name]; v == nil || v["type"] != "query" {
			t.Errorf("want a query variable %q", name)
		}
	}
	ids := map[float64]string{}
	panels, _ := d["panels"].([]any)
	if len(panels) == 0 {
		t.Fatal("no panels")
	}
	for _, p := range panels {
		p, _ := p.(map[string]any)
		title, _ := p["title"].(string)
		id, _ := p["id"].(float64)
		if prev, dup := ids[id]; dup {
			t.Errorf("panels %q and %q share id %v", prev, title, id)
		}
		ids[id] = title
		gp, _ := p["gridPos"].(map[string]any)
		if x, w := gp["x"].(float64), gp["w"].(float64); w <= 0 || x+w > 24 {
			t.Errorf("panel %q: gridPos %v outside 24 columns", title, gp)
		}
		if p["type"] == "row" {
			continue
		}
		dsOK := func(v any) bool {
			m, _ := v.(map[string]any)
			return m["uid"] == "${DS_PROMETHEUS}"
		}
		if !dsOK(p["datasource"]) {
			t.Errorf("panel %q: datasource %v, want uid ${DS_PROMETHEUS}", title, p["datasource"])
		}
		targets, _ := p["targets"].([]any)
		if len(targets) == 0 {
			t.Errorf("panel %q: no targets", title)
		}
		for _, tg := range targets {
			tg, _ := tg.(map[string]any)
			if !dsOK(tg["datasource"]) {
				t.Errorf("panel %q target %v: datasource %v", title, tg["refId"], tg["datasource"])
			}
			e, _ := tg["expr"].(string)
			if !strings.Contains(e, `job=~"$job"`) || !strings.Contains(e, `instance=~"$instance"`) {
				t.Errorf("panel %q target %v: selectors should filter on $job and $instance: %s", title, tg["refId"], e)
			}
		}
	}
}

// --- the alert rules -------------------------------------------------------

var exprLineRE = regexp.MustCompile(`^(\s*)(?:-\s+)?expr:\s*(.*)$`)

// ruleExprs pulls the expr: fields out of a rule file. It reads the subset
// of YAML the rule files use (plain, quoted or block-scalar values), which
// keeps the module free of a YAML dependency; promtool check rules reads
// the file properly when installed.
func ruleExprs(t *testing.T, path string) []expr {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	lines := strings.Split(string(b), "\n")
	alert := ""
	var out []expr
	for i := 0; i < len(lines); i++ {
		l := lines[i]
		if m := regexp.MustCompile(`^\s*-?\s*(alert|record):\s*(\S+)`).FindStringSubmatch(l); m != nil {
			alert = m[2]
		}
		m := exprLineRE.FindStringSubmatch(l)
		if m == nil {
			continue
		}
		indent, v := len(m[1]), strings.TrimSpace(m[2])
		switch {
		case v == "|" || v == ">" || v == "|-" || v == ">-":
			var body []string
			for i+1 < len(lines) {
				n := lines[i+1]
				if strings.TrimSpace(n) != "" && len(n)-len(strings.TrimLeft(n, " ")) <= indent {
					break
				}
				body = append(body, n)
				i++
			}
			v = strings.Join(body, "\n")
		case strings.HasPrefix(v, `"`):
			if err := json.Unmarshal([]byte(v), &v); err != nil {
				t.Fatalf("%s:%d: %v", path, i+1, err)
			}
		case strings.HasPrefix(v, `'`):
			v = strings.ReplaceAll(strings.Trim(v, `'`), `''`, `'`)
		}
		out = append(out, expr{fmt.Sprintf("%s:%d (%s)", path, i+1, alert), v})
	}
	if len(out) == 0 {
		t.Fatalf("%s: no expr found", path)
	}
	return out
}

// --- the workers -----------------------------------------------------------

// recorder registers on a real registry and remembers what each collector
// describes: the metric names and variable labels the code registers.
type recorder struct {
	*prometheus.Registry
	mu    sync.Mutex
	descs map[string][]string
}

var (
	fqNameRE = regexp.MustCompile(`fqName: "([^"]+)"`)
	varLblRE = regexp.MustCompile(`variableLabels: \{([^}]*)\}`)
)

func newRecorder() *recorder {
	return &recorder{Registry: prometheus.NewRegistry(), descs: map[string][]string{}}
}

func (r *recorder) Register(c prometheus.Collector) error {
	if err := r.Registry.Register(c); err != nil {
		return err
	}
	ch := make(chan *prometheus.Desc)
	go func() { c.Describe(ch); close(ch) }()
	r.mu.Lock()
	defer r.mu.Unlock()
	for d := range ch {
		s := d.String()
		m := fqNameRE.FindStringSubmatch(s)
		if m == nil {
			continue
		}
		var labels []string
		if v := varLblRE.FindStringSubmatch(s); v != nil && v[1] != "" {
			for _, l := range strings.Split(v[1], ",") {
				labels = append(labels, strings.TrimSuffix(strings.TrimPrefix(l, "c("), ")"))
			}
		}
		r.descs[m[1]] = labels
	}
	return nil
}

func (r *recorder) MustRegister(cs ...prometheus.Collector) {
	for _, c := range cs {
		if err := r.Register(c); err != nil {
			panic(err)
		}
	}
}

// cluster is one prefill and one decode worker (TP 1 → 1) on loopback.
type cluster struct {
	prefill, decode *node.Node
	regP, regD      *recorder
	results         chan decode.Result
	kvPort          int
	seq             int
}

func workerConfig(role config.Role, kvPort int) config.Config {
	engine := map[config.Role]string{config.Prefill: "P", config.Decode: "D"}[role]
	return loopback.Config(loopback.Worker{Role: role, EngineID: engine, KVPort: kvPort,
		Prefill: loopback.TP(1), Decode: loopback.TP(1),
		Model:            config.Model{NumLayers: 2, NumKVHeads: 4, HeadDim: 16, BlockSize: 16, DType: "bf16", NumBlocks: 32},
		HandshakeTimeout: 500 * time.Millisecond})
}

// startCluster starts one prefill worker (kv_port) and one decode worker
// (kv_port+1000), TP 1 each.
func startCluster(t *testing.T) *cluster {
	t.Helper()
	c := &cluster{results: make(chan decode.Result, 64)}
	ns, kvPort := loopback.Start(t, func(kvPort int) []config.Config {
		return []config.Config{workerConfig(config.Prefill, kvPort), workerConfig(config.Decode, kvPort+1000)}
	}, func(i int) node.Deps { // fresh registries for every attempt
		if i == 0 {
			c.regP = newRecorder()
			return node.Deps{Registerer: c.regP}
		}
		c.regD = newRecorder()
		return node.Deps{Registerer: c.regD, OnFinish: func(r decode.Result) { c.results <- r }}
	})
	c.prefill, c.decode, c.kvPort = ns[0], ns[1], kvPort
	return c
}

// request drives one request through prefill Send → decode Load → the
// decode result → the prefill free (after the DONE message).
func (c *cluster) request(ctx context.Context, blocks []int) error {
	c.seq++
	id := fmt.Sprintf("deploy-req-%d", c.seq)
	if errs := c.prefill.Prefill.Send([]prefill.SendRequest{{RequestID: id, BlockIDs: blocks}}); errs[0] != nil {
		return fmt.Errorf("send %s: %w", id, errs[0])
	}
	local := make([]int, len(blocks))
	for i, b := range blocks {
		local[i] = (b + 7) % c.decode.Shape.NumBlocks
	}
	if errs := c.decode.Decode.Load(ctx, []decode.LoadRequest{{RequestID: id, LocalBlockIDs: local,
		Params: decode.KVTransferParams{RemoteBlockIDs: blocks, RemoteEngineID: "P",
			RemoteHost: "127.0.0.1", RemotePort: c.kvPort, RemotePCPSize: 1, RemoteDCPSize: 1}}}); errs[0] != nil {
		return fmt.Errorf("load %s: %w", id, errs[0])
	}
	select {
	case r := <-c.results:
		if r.Err != nil {
			return fmt.Errorf("request %s failed: %w", r.RequestID, r.Err)
		}
	case <-ctx.Done():
		return fmt.Errorf("request %s: %w", id, ctx.Err())
	}
	c.decode.Decode.Finished()
	for {
		if slices.Contains(c.prefill.Prefill.Finished(), id) {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("request %s never freed on prefill: %w", id, ctx.Err())
		case <-time.After(2 * time.Millisecond):
		}
	}
}

// family is one exposed metric family, merged over the workers.
type family struct {
	typ    dto.MetricType
	labels map[string]map[string]bool // label -> values seen
}

func gatherAll(t *testing.T, regs ...*recorder) (map[string]*family, map[string][]string) {
	t.Helper()
	fams, descs := map[string]*family{}, map[string][]string{}
	for _, r := range regs {
		mfs, err := r.Gather()
		if err != nil {
			t.Fatalf("gather: %v", err)
		}
		for _, mf := range mfs {
			f := fams[mf.GetName()]
			if f == nil {
				f = &family{typ: mf.GetType(), labels: map[string]map[string]bool{}}
				fams[mf.GetName()] = f
			} else if f.typ != mf.GetType() {
				t.Errorf("%s: type %v on one worker, %v on another", mf.GetName(), f.typ, mf.GetType())
			}
			for _, m := range mf.GetMetric() {
				for _, lp := range m.GetLabel() {
					if f.labels[lp.GetName()] == nil {
						f.labels[lp.GetName()] = map[string]bool{}
					}
					f.labels[lp.GetName()][lp.GetValue()] = true
				}
			}
		}
		r.mu.Lock()
		for k, v := range r.descs {
			descs[k] = v
		}
		r.mu.Unlock()
	}
	return fams, descs
}

// --- the check -------------------------------------------------------------

// targetLabels are attached by Prometheus, not by the workers.
var targetLabels = map[string]bool{"job": true, "instance": true}

var histSuffixes = []string{"_bucket", "_sum", "_count"}

// checkExpr checks one expression against the exposed families and returns
// the kvflow families it uses.
func checkExpr(e expr, fams map[string]*family, descs map[string][]string) (used []string, errs []error) {
	fail := func(format string, a ...any) {
		errs = append(errs, fmt.Errorf("%s: "+format, append([]any{e.where}, a...)...))
	}
	q, err := parseQuery(e.src)
	if err != nil {
		fail("parse %q: %v", e.src, err)
		return nil, errs
	}
	allowed := map[string]bool{}
	for l := range targetLabels {
		allowed[l] = true
	}
	hasBucket := false
	for _, s := range q.Selectors {
		if !strings.HasPrefix(s.Name, "kvflow_") {
			if s.Name != "up" {
				fail("metric %q is neither kvflow_* nor up", s.Name)
			}
			continue
		}
		name, part := s.Name, ""
		if fams[name] == nil {
			for _, suf := range histSuffixes {
				if base, ok := strings.CutSuffix(s.Name, suf); ok && fams[base] != nil &&
					(fams[base].typ == dto.MetricType_HISTOGRAM || fams[base].typ == dto.MetricType_SUMMARY) {
					name, part = base, suf
				}
			}
		}
		f := fams[name]
		if f == nil {
			if _, ok := descs[name]; ok {
				fail("%s is registered but exposed no series after a request", s.Name)
			} else {
				fail("%s is not registered by a prefill or decode worker", s.Name)
			}
			continue
		}
		used = append(used, name)
		if part == "_bucket" {
			hasBucket = true
			allowed["le"] = true
		}
		if f.typ == dto.MetricType_HISTOGRAM && part == "" {
			fail("%s is a histogram: query %s_bucket, _sum or _count", name, name)
		}
		switch s.Func {
		case "rate", "irate", "increase", "resets":
			if f.typ != dto.MetricType_COUNTER && part == "" {
				fail("%s(%s): %s is a %v, not a counter", s.Func, s.Name, name, f.typ)
			}
		case "delta", "idelta", "deriv":
			if f.typ == dto.MetricType_COUNTER || part != "" {
				fail("%s(%s): use rate/increase on counters", s.Func, s.Name)
			}
		}
		for l := range f.labels {
			allowed[l] = true
		}
		for _, l := range descs[name] {
			allowed[l] = true
		}
		for _, m := range s.Matchers {
			if targetLabels[m.Label] {
				continue
			}
			vals, ok := f.labels[m.Label]
			if !ok {
				fail("%s has no label %q (labels: %v)", name, m.Label, keys(f.labels))
				continue
			}
			if (m.Op == "=" || m.Op == "!=") && !vals[m.Value] {
				fail("%s{%s%s%q}: the workers expose no such value (values: %v)", name, m.Label, m.Op, m.Value, keys(vals))
			}
		}
	}
	if hasBucket && (!strings.Contains(e.src, "histogram_quantile") || !slices.Contains(q.Grouping, "le")) {
		fail("_bucket series belong in histogram_quantile(φ, sum by (le, ...) (rate(...)))")
	}
	for _, l := range q.Grouping {
		if !allowed[l] {
			fail("groups by %q, which none of its metrics has", l)
		}
	}
	return used, errs
}

func keys[V any](m map[string]V) []string {
	out := make([]string, 0, len(m))
	for k := range m {
		out = append(out, k)
	}
	sort.Strings(out)
	return out
}

// The families the dashboard must show (issue 6, item 5).
var wantOnDashboard = []string{
	"kvflow_stage_queue_depth", "kvflow_stage_queue_capacity", "kvflow_stage_blocked_seconds_total",
	"kvflow_stage_duration_seconds", "kvflow_stage_busy_workers", "kvflow_stage_items_total",
	"kvflow_read_bytes_total", "kvflow_transfer_bytes_total", "kvflow_decode_requests_total",
	"kvflow_decode_request_duration_seconds", "kvflow_handshake_cache_lookups_total",
	"kvflow_notify_done_messages_total", "kvflow_prefill_delayed_requests", "kvflow_prefill_freed_total",
	"kvflow_sidechannel_requests_total", "kvflow_transfer_rejected_total",
	"kvflow_decode_leased_requests", "kvflow_decode_lease_renewals_total", "kvflow_prefill_lease_renewals_total",
	"kvflow_prefill_lease_expired_total", "kvflow_decode_stale_reads_refused_total",
}

var wantInAlerts = []string{
	"kvflow_decode_requests_total", "kvflow_prefill_freed_total",
	"kvflow_stage_queue_depth", "kvflow_stage_blocked_seconds_total", "kvflow_stage_items_total",
}

func TestMetricNamesRegistered(t *testing.T) {
	dash := dashboardExprs(t, loadDashboard(t))
	alerts := ruleExprs(t, alertsFile)
	t.Logf("%d dashboard expressions, %d alert expressions", len(dash), len(alerts))

	c := startCluster(t)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	// Two requests to the same peer: a handshake miss, then a hit.
	for _, blocks := range [][]int{{1, 2, 3}, {4, 5}} {
		if err := c.request(ctx, blocks); err != nil {
			t.Fatal(err)
		}
	}
	fams, descs := gatherAll(t, c.regP, c.regD)

	usedBy := func(es []expr) map[string]bool {
		used := map[string]bool{}
		for _, e := range es {
			u, errs := checkExpr(e, fams, descs)
			for _, err := range errs {
				t.Error(err)
			}
			for _, n := range u {
				used[n] = true
			}
		}
		return used
	}
	onDash, inAlerts := usedBy(dash), usedBy(alerts)
	for _, n := range wantOnDashboard {
		if !onDash[n] {
			t.Errorf("dashboard does not show %s", n)
		}
	}
	for _, n := range wantInAlerts {
		if !inAlerts[n] {
			t.Errorf("alerts do not use %s", n)
		}
	}
	var unused []string
	for n := range fams {
		if strings.HasPrefix(n, "kvflow_") && !onDash[n] {
			unused = append(unused, n)
		}
	}
	sort.Strings(unused)
	if len(unused) > 0 {
		t.Logf("registered families not on the dashboard: %v", unused)
	}
	t.Logf("dashboard uses %d families, alerts %d; workers expose %d", len(onDash), len(inAlerts), len(fams))

	if !t.Failed() {
		promtoolMetrics(t, c)
	}
}

// --- promtool, when installed ----------------------------------------------

func promtool(t *testing.T) string {
	t.Helper()
	p, err := exec.LookPath("promtool")
	if err != nil {
		t.Skip("promtool not on PATH (Debian package prometheus): skipping its checks")
	}
	return p
}

func runPromtool(t *testing.T, stdin io.Reader, args ...string) {
	t.Helper()
	cmd := exec.Command(promtool(t), args...)
	cmd.Stdin = stdin
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Errorf("promtool %s: %v\n%s", strings.Join(args, " "), err, out)
		return
	}
	t.Logf("promtool %s: ok", strings.Join(args, " "))
}

func TestPromtoolConfigAndRules(t *testing.T) {
	promtool(t)
	runPromtool(t, nil, "check", "config", promConfigFile)
	runPromtool(t, nil, "check", "rules", alertsFile)
	// alerts_test.yml names alerts.yml relative to itself.
	cmd := exec.Command(promtool(t), "test", "rules", filepath.Base(alertTestsFile))
	cmd.Dir = filepath.Dir(alertTestsFile)
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}

// promtoolMetrics lints each worker's /metrics as Prometheus would scrape it.
func promtoolMetrics(t *testing.T, c *cluster) {
	if _, err := exec.LookPath("promtool"); err != nil {
		t.Log("promtool not on PATH (Debian package prometheus): skipping promtool check metrics")
		return
	}
	for _, w := range []struct {
		role string
		reg  *recorder
	}{{"prefill", c.regP}, {"decode", c.regD}} {
		srv := httptest.NewServer(promhttp.HandlerFor(w.reg, promhttp.HandlerOpts{}))
		resp, err := http.Get(srv.URL)
		if err != nil {
			t.Fatal(err)
		}
		body, err := io.ReadAll(resp.Body)
		resp.Body.Close()
		srv.Close()
		if err != nil || resp.StatusCode != 200 || len(body) == 0 {
			t.Fatalf("%s /metrics: %v %v (%d bytes)", w.role, err, resp.Status, len(body))
		}
		t.Run("check-metrics-"+w.role, func(t *testing.T) { runPromtool(t, bytes.NewReader(body), "check", "metrics") })
	}
}

// --- the opt-in end-to-end script --------------------------------------------

// TestE2EPrometheusScript runs e2e-prometheus.sh (a real Prometheus) against
// the two workers' /metrics while requests flow. Opt-in:
// KVFLOW_E2E_PROMETHEUS=1 go test ./deploy -run E2E.
func TestE2EPrometheusScript(t *testing.T) {
	if os.Getenv("KVFLOW_E2E_PROMETHEUS") == "" {
		t.Skip("set KVFLOW_E2E_PROMETHEUS=1 to run Prometheus against in-process workers")
	}
	if _, err := exec.LookPath("prometheus"); err != nil {
		t.Skip("prometheus not on PATH (Debian package prometheus)")
	}
	c := startCluster(t)
	var addrs []string
	for _, reg := range []*recorder{c.regP, c.regD} {
		ln, err := net.Listen("tcp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		mux := http.NewServeMux()
		mux.Handle("/metrics", promhttp.HandlerFor(reg, promhttp.HandlerOpts{}))
		srv := &http.Server{Handler: mux}
		go srv.Serve(ln)
		t.Cleanup(func() { srv.Close() })
		addrs = append(addrs, ln.Addr().String())
	}
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() {
		defer close(done)
		for ctx.Err() == nil {
			rctx, rcancel := context.WithTimeout(ctx, 10*time.Second)
			err := c.request(rctx, []int{1, 2, 3})
			rcancel()
			if err != nil && ctx.Err() == nil {
				done <- err
				return
			}
			time.Sleep(20 * time.Millisecond)
		}
	}()
	cmd := exec.Command("bash", append([]string{"e2e-prometheus.sh"}, addrs...)...)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	err := cmd.Run()
	cancel()
	if derr := <-done; derr != nil {
		t.Errorf("traffic: %v", derr)
	}
	sc := bufio.NewScanner(&out)
	for sc.Scan() {
		t.Log(sc.Text())
	}
	if err != nil {
		t.Fatalf("e2e-prometheus.sh: %v", err)
	}
}

// The checker itself: each mistake it exists for is reported.
func TestCheckExprCatches(t *testing.T) {
	fams := map[string]*family{
		"kvflow_x_total":   {typ: dto.MetricType_COUNTER, labels: map[string]map[string]bool{"outcome": {"done": true, "failed": true}}},
		"kvflow_g":         {typ: dto.MetricType_GAUGE, labels: map[string]map[string]bool{"stage": {"read": true}}},
		"kvflow_h_seconds": {typ: dto.MetricType_HISTOGRAM, labels: map[string]map[string]bool{"stage": {"read": true}}},
	}
	descs := map[string][]string{"kvflow_registered_only": nil}
	for _, tc := range []struct{ src, want string }{
		{`rate(kvflow_y_total[1m])`, "not registered"},
		{`kvflow_registered_only`, "exposed no series"},
		{`rate(kvflow_g[1m])`, "not a counter"},
		{`kvflow_h_seconds`, "is a histogram"},
		{`sum(rate(kvflow_h_seconds_bucket[1m]))`, "histogram_quantile"},
		{`rate(kvflow_x_total{reason="x"}[1m])`, "no label"},
		{`rate(kvflow_x_total{outcome="fail"}[1m])`, "no such value"},
		{`sum by (stage) (rate(kvflow_x_total[1m]))`, "groups by"},
		{`rate(node_cpu_seconds_total[1m])`, "neither"},
		{`rate(kvflow_x_total[1m]`, "parse"},
	} {
		_, errs := checkExpr(expr{"test", tc.src}, fams, descs)
		if len(errs) == 0 || !strings.Contains(errors.Join(errs...).Error(), tc.want) {
			t.Errorf("%s: want an error containing %q, got %v", tc.src, tc.want, errs)
		}
	}
	good := `histogram_quantile(0.99, sum by (le, stage) (rate(kvflow_h_seconds_bucket{job=~"$job"}[1m]))) / on (stage) kvflow_g{stage="read"} + sum(increase(kvflow_x_total{outcome!="done"}[5m]))`
	if used, errs := checkExpr(expr{"test", good}, fams, descs); len(errs) != 0 || len(used) != 3 {
		t.Errorf("good expression: used %v, errors %v", used, errs)
	}
}
