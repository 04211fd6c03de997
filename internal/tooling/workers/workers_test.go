package workers

import (
	"context"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
)

func alive(pid int) bool {
	b, err := os.ReadFile(filepath.Join("/proc", strconv.Itoa(pid), "stat"))
	if err != nil {
		return false
	}
	// A zombie is dead, only not yet reaped by its parent.
	f := strings.Fields(string(b[strings.LastIndexByte(string(b), ')')+1:]))
	return len(f) > 0 && f[0] != "Z"
}

func fakeExe(t *testing.T, body string) string {
	t.Helper()
	p := filepath.Join(t.TempDir(), "kvflow")
	if err := os.WriteFile(p, []byte("#!/bin/sh\n"+body), 0o755); err != nil {
		t.Fatal(err)
	}
	return p
}

func testConfig(dir string) config.Config {
	c := config.Example(config.Decode)
	c.Node.Control = "ipc://" + filepath.Join(dir, "w.sock")
	return c
}

// A worker that ignores SIGTERM, and what it started, are killed with its
// process group once StopTimeout passes.
func TestCloseKillsGroup(t *testing.T) {
	dir := t.TempDir()
	child := filepath.Join(dir, "child.pid")
	exe := fakeExe(t, "trap '' TERM\nsleep 1000 &\necho $! > "+child+"\necho 'kvflow ready role=decode metrics=127.0.0.1:1'\nwait\n")
	s, err := NewSet(exe, dir)
	if err != nil {
		t.Fatal(err)
	}
	s.StopTimeout = 200 * time.Millisecond
	w, err := s.Launch(context.Background(), Spec{Name: "w", Config: testConfig(dir)})
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	if w.Metrics != "127.0.0.1:1" {
		t.Errorf("metrics %q", w.Metrics)
	}
	b, err := os.ReadFile(child)
	if err != nil {
		s.Close()
		t.Fatal(err)
	}
	cpid, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	s.Close()
	select {
	case <-w.Exited():
	default:
		t.Error("worker not reaped")
	}
	for range 100 { // the orphaned sleep is reaped by init, not us
		if !alive(cpid) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	if alive(cpid) {
		syscall.Kill(cpid, syscall.SIGKILL)
		t.Errorf("the worker's child %d survived Close", cpid)
	}
	s.Close() // twice is fine
}

// A worker that exits before it is ready: Launch says so, with its log.
func TestLaunchExitBeforeReady(t *testing.T) {
	dir := t.TempDir()
	s, err := NewSet(fakeExe(t, "echo 'bad config' >&2\nexit 2\n"), dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	_, err = s.Launch(context.Background(), Spec{Name: "w", Config: testConfig(dir)})
	if err == nil || !strings.Contains(err.Error(), "exited before it was ready") || !strings.Contains(err.Error(), "bad config") {
		t.Fatalf("err = %v", err)
	}
}

// A cancelled ctx ends the wait for ready; Close stops the worker.
func TestLaunchCancelled(t *testing.T) {
	dir := t.TempDir()
	s, err := NewSet(fakeExe(t, "exec sleep 1000\n"), dir)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(100 * time.Millisecond); cancel() }()
	_, err = s.Launch(ctx, Spec{Name: "w", Config: testConfig(dir)})
	if err == nil {
		t.Fatal("launch of a worker that never gets ready returned nil")
	}
	s.mu.Lock()
	w := s.all[0]
	s.mu.Unlock()
	s.Close()
	select {
	case <-w.Exited():
	default:
		t.Error("worker still running after Close")
	}
}

func TestBadConfigStartsNothing(t *testing.T) {
	dir := t.TempDir()
	s, err := NewSet("/nonexistent", dir)
	if err != nil {
		t.Fatal(err)
	}
	defer s.Close()
	c := testConfig(dir)
	c.Model.NumLayers = 0
	if _, err := s.Launch(context.Background(), Spec{Name: "w", Config: c}); err == nil || !strings.Contains(err.Error(), "config") {
		t.Fatalf("err = %v", err)
	}
	if len(s.all) != 0 {
		t.Error("started")
	}
}
