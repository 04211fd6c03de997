package benchte

import (
	"bytes"
	"context"
	"errors"
	"flag"
	"net"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/cli/clierr"
)

// tiny keeps every run small: 4 KiB blocks, 8 per batch, 2 threads, a
// 1 MiB target buffer.
var tiny = []string{"--block_size", "4096", "--batch_size", "8", "--threads", "2", "--buffer_size", "1048576"}

func args(more ...string) []string { return append(append([]string{}, tiny...), more...) }

var completed = regexp.MustCompile(`(?m)^Test completed: duration (\d+\.\d\d), batch count (\d+), throughput (\d+\.\d\d) GB/s$`)

func checkCompleted(t *testing.T, out string) (batches int) {
	t.Helper()
	m := completed.FindStringSubmatch(out)
	if m == nil {
		t.Fatalf("no transfer_engine_bench result line in:\n%s", out)
	}
	n, _ := strconv.Atoi(m[2])
	if n < 1 {
		t.Fatalf("batch count %d:\n%s", n, out)
	}
	return n
}

func TestLoopback(t *testing.T) {
	tests := []struct {
		name     string
		args     []string
		verified bool
	}{
		{"read 1s", args("--mode", "loopback", "--duration", "1"), true},
		{"write", args("--mode", "loopback", "--operation", "write", "--duration", "0.2"), true},
		{"unaligned blocks", []string{"--mode", "loopback", "--block_size", "1001", "--batch_size", "3", "--threads", "3", "--buffer_size", "4096", "--duration", "0.2"}, true},
		{"unaligned write", []string{"--mode", "loopback", "--operation", "write", "--block_size", "1001", "--batch_size", "3", "--threads", "3", "--buffer_size", "4096", "--duration", "0.2"}, true},
		{"no verify", args("--mode", "loopback", "--duration", "0.2", "--no-verify"), false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout, stderr bytes.Buffer
			if err := Run(context.Background(), tt.args, &stdout, &stderr); err != nil {
				t.Fatalf("Run: %v\nstdout:\n%s\nstderr:\n%s", err, stdout.String(), stderr.String())
			}
			out := stdout.String()
			checkCompleted(t, out)
			for _, w := range []string{"Target started: segment_id 127.0.0.1:", "Initiator started: segment_id 127.0.0.1:"} {
				if !strings.Contains(out, w) {
					t.Errorf("output lacks %q:\n%s", w, out)
				}
			}
			if got := strings.Contains(out, "Verified "); got != tt.verified {
				t.Errorf("verified line present = %v, want %v:\n%s", got, tt.verified, out)
			}
		})
	}
}

// syncBuffer is a bytes.Buffer safe for a writer goroutine and a reader.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

var banner = regexp.MustCompile(`segment_id (\S+), buffer_addr (0x[0-9a-f]+), buffer_size (\d+)`)

// startTargetRun runs Run in target mode until the test ends and returns
// its session id and buffer address.
func startTargetRun(t *testing.T, more ...string) (session string, addr uint64) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	out := &syncBuffer{}
	done := make(chan error, 1)
	go func() {
		done <- Run(ctx, append([]string{"--mode", "target", "--local_server_name", "127.0.0.1", "--buffer_size", "1048576"}, more...), out, &syncBuffer{})
	}()
	t.Cleanup(func() {
		cancel()
		if err := <-done; err != nil {
			t.Errorf("target Run: %v", err)
		}
		if !strings.Contains(out.String(), "Target stopped") {
			t.Errorf("target did not report stopping:\n%s", out.String())
		}
	})
	deadline := time.Now().Add(10 * time.Second)
	for {
		if m := banner.FindStringSubmatch(out.String()); m != nil {
			a, err := strconv.ParseUint(m[2], 0, 64)
			if err != nil {
				t.Fatal(err)
			}
			return m[1], a
		}
		select {
		case err := <-done:
			t.Fatalf("target exited: %v\n%s", err, out.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("no target banner:\n%s", out.String())
		}
		time.Sleep(10 * time.Millisecond)
	}
}

func TestTargetInitiator(t *testing.T) {
	// Small transfer flags keep the target buffer at 1 MiB (not raised to
	// the default 12 threads x 128 x 64 KiB).
	session, addr := startTargetRun(t, "--threads", "1", "--batch_size", "1", "--block_size", "4096")
	run := func(t *testing.T, more ...string) (string, error) {
		var stdout, stderr bytes.Buffer
		err := Run(context.Background(), args(append([]string{"--mode", "initiator", "--segment_id", session, "--duration", "0.2"}, more...)...), &stdout, &stderr)
		return stdout.String(), err
	}
	t.Run("read", func(t *testing.T) {
		out, err := run(t)
		if err != nil {
			t.Fatal(err)
		}
		checkCompleted(t, out)
		if !strings.Contains(out, "remote buffer cpu:0 ") || !strings.Contains(out, "Verified ") {
			t.Errorf("output:\n%s", out)
		}
	})
	t.Run("write keeps the target readable", func(t *testing.T) {
		out, err := run(t, "--operation", "write")
		if err != nil {
			t.Fatal(err)
		}
		checkCompleted(t, out)
		if out, err = run(t); err != nil {
			t.Fatalf("read after write: %v\n%s", err, out)
		}
	})
	t.Run("remote_addr", func(t *testing.T) {
		out, err := run(t, "--remote_addr", strconv.FormatUint(addr, 10))
		if err != nil {
			t.Fatal(err)
		}
		if !strings.Contains(out, "(--remote_addr)") {
			t.Errorf("output:\n%s", out)
		}
	})
	t.Run("shifted remote_addr fails verification", func(t *testing.T) {
		_, err := run(t, "--remote_addr", strconv.FormatUint(addr+8, 10))
		if err == nil || clierr.IsUsage(err) || !strings.Contains(err.Error(), "verify") {
			t.Fatalf("Run = %v, want a verification error", err)
		}
		// Unverified, the same run succeeds.
		if _, err := run(t, "--remote_addr", strconv.FormatUint(addr+8, 10), "--no-verify", "--threads", "1"); err != nil {
			t.Fatal(err)
		}
	})
	t.Run("target buffer too small", func(t *testing.T) {
		_, err := run(t, "--block_size", "1048576")
		if err == nil || clierr.IsUsage(err) || !strings.Contains(err.Error(), "raise the target's --buffer_size") {
			t.Fatalf("Run = %v", err)
		}
	})
	t.Run("interrupted", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
		defer cancel()
		var stdout bytes.Buffer
		err := Run(ctx, args("--mode", "initiator", "--segment_id", session, "--duration", "60"), &stdout, &bytes.Buffer{})
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("Run = %v, want an interruption", err)
		}
		checkCompleted(t, stdout.String())
	})
}

func TestInitiatorNoTarget(t *testing.T) {
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	addr := l.Addr().String()
	l.Close() // nothing listens there now
	err = Run(context.Background(), args("--segment_id", addr, "--duration", "0.1"), &bytes.Buffer{}, &bytes.Buffer{})
	if err == nil || clierr.IsUsage(err) || !strings.Contains(err.Error(), addr) {
		t.Fatalf("Run = %v, want a runtime error naming %s", err, addr)
	}
}

func TestBadFlags(t *testing.T) {
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"no segment", nil, []string{"--segment_id: required"}},
		{"bad mode", []string{"--mode", "server"}, []string{"--mode: \"server\""}},
		{"bad operation", []string{"--mode", "loopback", "--operation", "copy"}, []string{"--operation"}},
		{"zero block", []string{"--mode", "loopback", "--block_size", "0"}, []string{"--block_size"}},
		{"threads", []string{"--mode", "loopback", "--threads", "0"}, []string{"--threads: 0"}},
		{"too many threads", []string{"--mode", "loopback", "--threads", "5000"}, []string{"--threads: 5000"}},
		{"batch", []string{"--mode", "loopback", "--batch_size", "-1"}, []string{"--batch_size"}},
		{"duration", []string{"--mode", "loopback", "--duration", "0"}, []string{"duration"}},
		{"duration text", []string{"--mode", "loopback", "--duration", "forever"}, []string{"duration"}},
		{"segment", []string{"--segment_id", "nohostport"}, []string{"--segment_id", "host:port"}},
		{"segment port", []string{"--segment_id", "h:99999"}, []string{"--segment_id"}},
		{"segment in target", []string{"--mode", "target", "--segment_id", "h:1"}, []string{"only for --mode initiator"}},
		{"metadata server", []string{"--mode", "loopback", "--metadata_server", "10.0.0.1:2379"}, []string{"P2PHANDSHAKE"}},
		{"protocol", []string{"--mode", "loopback", "--protocol", "rdma"}, []string{"only tcp"}},
		{"unit", []string{"--mode", "loopback", "--report_unit", "TB"}, []string{"--report_unit"}},
		{"local name", []string{"--mode", "loopback", "--local_server_name", "h:x"}, []string{"--local_server_name"}},
		{"overflow", []string{"--mode", "loopback", "--block_size", "18446744073709551615", "--batch_size", "2"}, []string{"overflows"}},
		{"unknown flag", []string{"--device_name", "mlx5_2"}, []string{"device_name"}},
		{"positional", []string{"--mode", "loopback", "extra"}, []string{"unexpected arguments"}},
		{"every problem", []string{"--mode", "loopback", "--threads", "0", "--operation", "x"}, []string{"--threads", "--operation"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var stdout bytes.Buffer
			err := Run(context.Background(), tt.args, &stdout, &bytes.Buffer{})
			if !clierr.IsUsage(err) {
				t.Fatalf("Run(%q) = %v, want a usage error", tt.args, err)
			}
			for _, w := range tt.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error lacks %q: %v", w, err)
				}
			}
			if stdout.Len() > 0 {
				t.Errorf("stdout on a usage error:\n%s", stdout.String())
			}
		})
	}
}

func TestHelp(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := Run(context.Background(), []string{"-h"}, &stdout, &stderr)
	if !errors.Is(err, flag.ErrHelp) || clierr.IsUsage(err) {
		t.Fatalf("Run(-h) = %v", err)
	}
	for _, w := range []string{"usage: kvflow bench te", "-segment_id", "-block_size", "-no-verify", "-remote_addr"} {
		if !strings.Contains(stdout.String(), w) || stderr.Len() > 0 {
			t.Errorf("help lacks %q", w)
		}
	}
}

func TestBufferAdjusted(t *testing.T) {
	var stdout, stderr bytes.Buffer
	err := Run(context.Background(), []string{"--mode", "loopback", "--block_size", "4096", "--batch_size", "4", "--threads", "2", "--buffer_size", "100", "--duration", "0.1"}, &stdout, &stderr)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(stderr.String(), "adjusted to 32768") || !strings.Contains(stdout.String(), "buffer_size 32768") {
		t.Errorf("stdout:\n%s\nstderr:\n%s", stdout.String(), stderr.String())
	}
}

func TestNoGoroutineLeft(t *testing.T) {
	before := runtime.NumGoroutine()
	if err := Run(context.Background(), args("--mode", "loopback", "--duration", "0.1"), &bytes.Buffer{}, &bytes.Buffer{}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for runtime.NumGoroutine() > before {
		if time.Now().After(deadline) {
			t.Fatalf("%d goroutines before Run, %d after", before, runtime.NumGoroutine())
		}
		time.Sleep(10 * time.Millisecond)
	}
}
