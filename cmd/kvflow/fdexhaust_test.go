package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// The worker's descriptor limit in TestServeDataPortFDExhaustion: the
// common default soft limit, which the issue reproduced the abort at.
const exhaustLimit = 1024

// TestServeDataPortFDExhaustion: a prefill `kvflow serve` whose
// RLIMIT_NOFILE is 1024 (soft and hard) is flooded with idle connections
// to its transfer engine's data port, from several addresses (more than
// its limit in all). It refuses the excess and stays up: a new client of
// its ipc:// control socket gets `status` answered (before the fix,
// libzmq aborted the process on that accept: "Too many open files
// (src/ipc_listener.cpp:325)"), a new side-channel client gets GET_META,
// /healthz answers, a peer whose lane was open before reads the right
// bytes, and the refusals are counted. It then exits 0 on SIGTERM.
func TestServeDataPortFDExhaustion(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur < 2*exhaustLimit {
		t.Skipf("this test opens ~%d connections: RLIMIT_NOFILE %d too low (%v)", exhaustLimit+200, rl.Cur, err)
	}
	dir := t.TempDir()
	cfg := config.Example(config.Prefill)
	cfg.Model.NumBlocks, cfg.Model.NumLayers, cfg.Model.BlockSize = 8, 2, 16
	// A port checked free now (a port derived from the pid collided with
	// ephemeral ports of other tests' connections: exit 2, "address in use").
	kvPort, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVTransfer.KVPort = config.Port(kvPort)
	cfg.Node.SideChannelHost, cfg.Node.TEHost, cfg.Node.TEPort = "127.0.0.1", "127.0.0.1", 0
	cfg.Node.Control = "ipc://" + filepath.Join(dir, "p.sock")
	cfg.Node.MetricsAddr = "127.0.0.1:0"
	cfg.Cache.NoHugePages = true
	// The peer reads raw cache memory without a send: grants off (this
	// test is about descriptors, not about which blocks are served).
	cfg.Read.Grants = config.GrantsOff
	w := startLimitedWorker(t, cfg, dir)
	cmd, line, exited, stderr := w.cmd, w.line, w.exited, w.stderr
	field := func(name string) string {
		m := regexp.MustCompile(name + `=(\S+)`).FindStringSubmatch(line)
		if m == nil {
			t.Fatalf("ready line %q lacks %s", line, name)
		}
		return m[1]
	}
	session, metricsAddr := field("te_session"), field("metrics")
	sideChannel := "127.0.0.1:" + field("handshake_port")
	// The worker logs before its ready line, but exec copies its stderr
	// through a pipe on another goroutine: wait for the start-up lines.
	for deadline := time.Now().Add(10 * time.Second); !(strings.Contains(stderr.String(), "read.grants=off") && strings.Contains(stderr.String(), `"soft":1024`)) && time.Now().Before(deadline); {
		time.Sleep(10 * time.Millisecond)
	}
	if !strings.Contains(stderr.String(), `"soft":1024,"hard":1024`) {
		t.Errorf("worker did not log its open files limit 1024/1024:\n%s", stderr.String())
	}
	// Grants off (set above) is warned at start, saying what it exposes (#19).
	if !regexp.MustCompile(`"level":"WARN","msg":"read.grants=off: any peer that reaches the transfer engine's data port can read every registered block`).MatchString(stderr.String()) {
		t.Errorf("worker with read.grants off did not warn at start:\n%s", stderr.String())
	}

	// A legitimate peer: one lane, opened by a read before the flood.
	meta := getMeta(t, sideChannel)
	pcfg := mooncake.DefaultTCPConfig()
	pcfg.Lanes = 1
	peer, err := mooncake.NewTCPEngine(pcfg, nil, slog.New(slog.DiscardHandler))
	if err != nil {
		t.Fatal(err)
	}
	defer peer.Close()
	local := make([]byte, 4096)
	if err := peer.Register(mooncake.AddrOf(local), uint64(len(local)), ""); err != nil {
		t.Fatal(err)
	}
	ops := []mooncake.Op{{Local: mooncake.AddrOf(local), Remote: meta.base, Length: uint64(len(local))}}
	if err := peer.BatchRead(t.Context(), session, ops); err != nil {
		t.Fatalf("read before the flood: %v", err)
	}
	before := append([]byte(nil), local...)

	// The flood: idle connections to the data port from 127.0.0.2..,
	// fewer per address than the per-peer cap, more than the worker's
	// descriptors in all.
	dport := dataPort(t, session)
	data := net.JoinHostPort("127.0.0.1", strconv.Itoa(dport))
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	resets := 0
	for i := range exhaustLimit + 100 {
		src := fmt.Sprintf("127.0.0.%d", 2+i/200)
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", data)
		if err != nil {
			if errors.Is(err, syscall.ECONNRESET) {
				resets++
				continue
			}
			t.Fatalf("dial %d from %s: %v", i, src, err)
		}
		held = append(held, c)
	}
	t.Logf("%d idle connections dialed, %d reset at connect", len(held), resets)
	// Wait until the worker has taken every connection off its accept
	// queue, or can take no more (all its descriptors in use).
	pid := cmd.Process.Pid
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		q, fds := acceptQueue(t, dport), openFDs(pid)
		if q == 0 || fds >= exhaustLimit {
			t.Logf("worker: %d descriptors open, %d connections in the data port's accept queue", fds, q)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker neither drained its accept queue (%d) nor filled its descriptors (%d)", q, fds)
		}
	}

	// The worker is alive and serves a new control client...
	zctx, _ := zmq.NewContext()
	defer zctx.Term()
	sock, _ := zctx.NewSocket(zmq.REQ)
	defer func() { sock.SetLinger(0); sock.Close() }()
	sock.SetRcvtimeo(10 * time.Second)
	sock.Connect(cfg.Node.Control)
	req, _ := msgpack.Marshal(map[string]any{"op": "status"})
	sock.SendBytes(req, 0)
	rep, err := sock.RecvBytes(0)
	if err != nil {
		select {
		case werr := <-exited:
			t.Fatalf("worker died under descriptor pressure: %v\n%s", werr, tail(stderr.String(), 2000))
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("control socket did not answer status: %v", err)
	}
	var st map[string]any
	if err := msgpack.Unmarshal(rep, &st); err != nil || st["ok"] != true {
		t.Fatalf("status: %v %v", st, err)
	}
	// ... a new side-channel client, HTTP ...
	getMeta(t, sideChannel)
	metrics := httpGet(t, "http://"+metricsAddr+"/metrics")
	if body := httpGet(t, "http://"+metricsAddr+"/healthz"); !strings.Contains(body, "ok") {
		t.Errorf("/healthz: %q", body)
	}
	// ... and the peer whose lane was open.
	clear(local)
	if err := peer.BatchRead(t.Context(), session, ops); err != nil {
		t.Fatalf("read on the open lane under descriptor pressure: %v", err)
	}
	if string(local) != string(before) {
		t.Fatal("read under descriptor pressure: bytes differ")
	}
	m := regexp.MustCompile(`kvflow_transfer_connections_refused_total\{port="data",reason="fd_reserve"\} (\d+)`).FindStringSubmatch(metrics)
	if m == nil || m[1] == "0" {
		t.Errorf("no fd_reserve refusal counted: %v", m)
	}
	t.Logf("refused for the descriptor reserve: %s", m[1])

	for _, c := range held {
		c.Close()
	}
	held = nil
	cmd.Process.Signal(syscall.SIGTERM)
	select {
	case err := <-exited:
		if err != nil {
			t.Fatalf("exit after SIGTERM: %v\n%s", err, tail(stderr.String(), 2000))
		}
	case <-time.After(30 * time.Second):
		t.Fatal("no exit after SIGTERM")
	}
	if s := stderr.String(); strings.Contains(s, "Too many open files") {
		t.Errorf("worker hit EMFILE:\n%s", tail(s, 2000))
	}
}

// acceptQueue is the number of connections waiting in the accept queue
// of the loopback listener on port (the rx_queue of its LISTEN line in
// /proc/net/tcp).
func acceptQueue(t *testing.T, port int) int {
	t.Helper()
	b, err := os.ReadFile("/proc/net/tcp")
	if err != nil {
		t.Skipf("no /proc/net/tcp: %v", err)
	}
	local := fmt.Sprintf("0100007F:%04X", port)
	for _, ln := range strings.Split(string(b), "\n") {
		f := strings.Fields(ln)
		if len(f) > 4 && f[1] == local && f[3] == "0A" { // LISTEN
			_, rx, _ := strings.Cut(f[4], ":")
			n, _ := strconv.ParseInt(rx, 16, 64)
			return int(n)
		}
	}
	t.Fatalf("no listener on 127.0.0.1:%d in /proc/net/tcp", port)
	return 0
}

// openFDs counts the descriptors process pid has open.
func openFDs(pid int) int {
	ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	return len(ents)
}

type metaInfo struct{ base uint64 }

// getMeta fetches a side channel's metadata with `kvflow probe` (a new
// ZMQ client each time).
func getMeta(t *testing.T, remote string) metaInfo {
	t.Helper()
	code, out, errOut := runCmd("probe", "--remote", remote, "--json", "--timeout", "10s")
	if code != exitOK {
		t.Fatalf("GET_META from %s: exit %d: %s", remote, code, errOut)
	}
	var m struct {
		Bases []uint64 `json:"kv_caches_base_addr"`
	}
	if err := json.Unmarshal([]byte(out), &m); err != nil || len(m.Bases) == 0 {
		t.Fatalf("GET_META reply %q: %v", out, err)
	}
	return metaInfo{base: m.Bases[0]}
}

// dataPort asks the engine at session for its segment descriptor (the
// Mooncake handshake) and returns its tcp_data_port.
func dataPort(t *testing.T, session string) int {
	t.Helper()
	c, err := net.DialTimeout("tcp", session, 5*time.Second)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	c.SetDeadline(time.Now().Add(10 * time.Second))
	desc := mooncake.EncodeSegment(&mooncake.SegmentDesc{Name: "test", Protocol: "tcp", Timestamp: mooncake.FormatTimestamp(time.Now())})
	if _, err := c.Write(mooncake.AppendFrame(nil, mooncake.FrameMetadata, desc)); err != nil {
		t.Fatal(err)
	}
	_, payload, err := mooncake.ReadFrame(c, mooncake.DefaultMaxFrame)
	if err != nil {
		t.Fatalf("handshake with %s: %v", session, err)
	}
	seg, err := mooncake.DecodeSegment(payload)
	if err != nil {
		t.Fatalf("segment of %s: %v", session, err)
	}
	return seg.TCPDataPort
}

func httpGet(t *testing.T, url string) string {
	t.Helper()
	ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
	defer cancel()
	req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url, nil)
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		t.Fatalf("GET %s: %v", url, err)
	}
	defer resp.Body.Close()
	body, _ := io.ReadAll(resp.Body)
	if resp.StatusCode != http.StatusOK {
		t.Fatalf("GET %s: %s", url, resp.Status)
	}
	return string(body)
}

func tail(s string, n int) string { return s[max(0, len(s)-n):] }

// limitedWorker is a `kvflow serve` of cfg started under `ulimit -n
// exhaustLimit` (sh sets the soft and hard limits, then execs the worker,
// so the PID stays the worker's), once it printed its ready line.
type limitedWorker struct {
	cmd    *exec.Cmd
	line   string     // the ready line
	exited chan error // the worker's exit, once
	stderr *lockedBuffer
}

func startLimitedWorker(t *testing.T, cfg config.Config, dir string) *limitedWorker {
	t.Helper()
	cfgPath := filepath.Join(dir, "p.json")
	f, err := os.Create(cfgPath)
	if err != nil {
		t.Fatal(err)
	}
	cfg.Print(f)
	f.Close()
	exe, _ := os.Executable()
	w := &limitedWorker{exited: make(chan error, 1), stderr: &lockedBuffer{}}
	w.cmd = exec.Command("/bin/sh", "-c", fmt.Sprintf(`ulimit -n %d && exec "$0" "$@"`, exhaustLimit),
		exe, "serve", "--config", cfgPath, "--log-format", "json")
	w.cmd.Stderr = w.stderr
	out, _ := w.cmd.StdoutPipe()
	if err := w.cmd.Start(); err != nil {
		t.Fatal(err)
	}
	ready := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			select {
			case ready <- sc.Text():
			default:
			}
		}
		w.exited <- w.cmd.Wait()
	}()
	t.Cleanup(func() { w.cmd.Process.Kill() })
	select {
	case w.line = <-ready:
	case err := <-w.exited:
		t.Fatalf("worker exited before ready: %v\n%s", err, w.stderr.String())
	case <-time.After(20 * time.Second):
		t.Fatalf("worker not ready:\n%s", w.stderr.String())
	}
	return w
}
