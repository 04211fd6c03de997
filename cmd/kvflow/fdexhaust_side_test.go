package main

import (
	"fmt"
	"net"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"

	zmq "github.com/pebbe/zmq4"
	"github.com/vmihailenco/msgpack/v5"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// TestServeSideChannelFDExhaustion: the same flood as
// TestServeDataPortFDExhaustion, aimed at the prefill's side-channel port
// (ZMQ). libzmq accepts there without bound and keeps a connection that
// sent part of a greeting for 30 s, so ~1 400 such connections exhausted a
// 1024-descriptor worker and its next ipc:// control accept aborted it
// ("Too many open files (src/ipc_listener.cpp:325)"); the same at 20 000
// descriptors took ~20 000 connections from 8 addresses in 25 s. With the
// side channel's front (sidechannel.Limits) the excess is refused, counted
// (fd_reserve), and the worker keeps serving its control socket, HTTP and,
// once the flood ends, new side-channel clients.
func TestServeSideChannelFDExhaustion(t *testing.T) {
	var rl syscall.Rlimit
	if err := syscall.Getrlimit(syscall.RLIMIT_NOFILE, &rl); err != nil || rl.Cur < 2*exhaustLimit {
		t.Skipf("this test opens ~%d connections: RLIMIT_NOFILE %d too low (%v)", exhaustLimit+200, rl.Cur, err)
	}
	dir := t.TempDir()
	cfg := config.Example(config.Prefill)
	cfg.Model.NumBlocks, cfg.Model.NumLayers, cfg.Model.BlockSize = 8, 2, 16
	kvPort, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	cfg.KVTransfer.KVPort = config.Port(kvPort)
	cfg.Node.SideChannelHost, cfg.Node.TEHost, cfg.Node.TEPort = "127.0.0.1", "127.0.0.1", 0
	cfg.Node.Control = "ipc://" + filepath.Join(dir, "p.sock")
	cfg.Node.MetricsAddr = "127.0.0.1:0"
	cfg.Cache.NoHugePages = true
	w := startLimitedWorker(t, cfg, dir)
	cmd, line, exited, stderr := w.cmd, w.line, w.exited, w.stderr
	metricsAddr := regexp.MustCompile(`metrics=(\S+)`).FindStringSubmatch(line)[1]
	sideChannel := fmt.Sprintf("127.0.0.1:%d", kvPort)
	getMeta(t, sideChannel)

	// The flood: connections that send one byte of a greeting, from
	// 127.0.0.2.., fewer per address than the per-peer cap.
	var held []net.Conn
	defer func() {
		for _, c := range held {
			c.Close()
		}
	}()
	for i := range exhaustLimit + 400 {
		src := fmt.Sprintf("127.0.0.%d", 2+i/200)
		d := net.Dialer{Timeout: 5 * time.Second, LocalAddr: &net.TCPAddr{IP: net.ParseIP(src)}}
		c, err := d.Dial("tcp", sideChannel)
		if err != nil {
			continue // refused or reset under pressure: as intended
		}
		c.Write([]byte{0xff})
		held = append(held, c)
	}
	pid := cmd.Process.Pid
	for deadline := time.Now().Add(20 * time.Second); ; time.Sleep(20 * time.Millisecond) {
		q, fds := acceptQueue(t, kvPort), openFDs(pid)
		if q == 0 || fds >= exhaustLimit {
			t.Logf("%d connections dialed; worker: %d descriptors open, %d in the accept queue", len(held), fds, q)
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("worker neither drained its accept queue (%d) nor filled its descriptors (%d)", q, fds)
		}
	}

	// A new control client is served (before the front: SIGABRT here).
	zctx, _ := zmq.NewContext()
	defer zctx.Term()
	sock, _ := zctx.NewSocket(zmq.REQ)
	defer func() { sock.SetLinger(0); sock.Close() }()
	sock.SetRcvtimeo(10 * time.Second)
	sock.Connect(cfg.Node.Control)
	req, _ := msgpack.Marshal(map[string]any{"op": "status"})
	sock.SendBytes(req, 0)
	if _, err := sock.RecvBytes(0); err != nil {
		select {
		case werr := <-exited:
			t.Fatalf("worker died under a side-channel flood: %v\n%s", werr, tail(stderr.String(), 2000))
		case <-time.After(5 * time.Second):
		}
		t.Fatalf("control socket did not answer status: %v", err)
	}
	if body := httpGet(t, "http://"+metricsAddr+"/healthz"); !strings.Contains(body, "ok") {
		t.Errorf("/healthz: %q", body)
	}
	metrics := httpGet(t, "http://"+metricsAddr+"/metrics")
	m := regexp.MustCompile(`kvflow_sidechannel_connections_refused_total\{reason="fd_reserve"\} (\d+)`).FindStringSubmatch(metrics)
	if m == nil || m[1] == "0" {
		t.Errorf("no fd_reserve refusal counted on the side channel: %v", m)
	}

	// The flood ends: new side-channel clients are served again.
	for _, c := range held {
		c.Close()
	}
	held = nil
	deadline := time.Now().Add(20 * time.Second)
	for {
		code, _, errOut := runCmd("probe", "--remote", sideChannel, "--json", "--timeout", "3s")
		if code == exitOK {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("GET_META after the flood: exit %d: %s", code, errOut)
		}
		time.Sleep(200 * time.Millisecond)
	}
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
