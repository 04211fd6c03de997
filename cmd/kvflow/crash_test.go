package main

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/tooling/workers"
)

// crashWorkerConfig is a small worker of role with a shm cache removed at
// close and its control socket in dir, as the demo runs them.
func crashWorkerConfig(t *testing.T, role config.Role, dir, shm string) config.Config {
	t.Helper()
	port, err := workers.FreePorts(1)
	if err != nil {
		t.Fatal(err)
	}
	c := config.Example(role)
	c.KVTransfer.KVPort = config.Port(port)
	c.Rank = config.Rank{TP: 1}
	c.Model.NumLayers, c.Model.NumBlocks, c.Model.BlockSize = 2, 8, 16
	c.Cache = config.Cache{Mode: config.CacheShm, Path: filepath.Join(shm, role.String()+".kv"), RemoveOnClose: true, NoHugePages: true}
	c.Node.Control = "ipc://" + filepath.Join(dir, role.String()+".sock")
	c.Node.MetricsAddr = "127.0.0.1:0"
	c.Node.SideChannelHost, c.Node.TEHost = "127.0.0.1", "127.0.0.1"
	c.Log = config.Log{Level: "info", Format: "json"}
	c.Shutdown.DrainTimeout = config.Duration(time.Second)
	return c
}

func newWorkerSet(t *testing.T) (*workers.Set, string, string) {
	t.Helper()
	dir := t.TempDir()
	shm, err := workers.ShmDir("kvflow-crash-", dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(shm) })
	exe, _ := os.Executable()
	set, err := workers.NewSet(exe, dir)
	if err != nil {
		t.Fatal(err)
	}
	set.StopTimeout = 10 * time.Second
	t.Cleanup(set.Close)
	return set, dir, shm
}

func exists(path string) bool {
	_, err := os.Lstat(path)
	return err == nil
}

// stopClean SIGTERMs w and waits for exit 0.
func stopClean(t *testing.T, w *workers.Worker) {
	t.Helper()
	syscall.Kill(w.Pid(), syscall.SIGTERM)
	select {
	case <-w.Exited():
	case <-time.After(20 * time.Second):
		t.Fatalf("%s: no exit after SIGTERM; log:\n%s", w.Name, workers.Tail(w.LogPath))
	}
	if err := w.Err(); err != nil {
		t.Fatalf("%s: %v after SIGTERM; log:\n%s", w.Name, err, workers.Tail(w.LogPath))
	}
}

// A worker with a shm cache and cache.remove_on_close is SIGKILLed (so its
// cache file, control socket and lock files stay behind) and started again
// with the same configuration: it comes up ready without a person, on the
// same cache file (reclaimed in place: an engine that mapped it before the
// crash still shares the worker's memory), answers on its control socket,
// and a clean stop then removes the cache file and the socket files.
func TestServeCrashRestartShm(t *testing.T) {
	for _, role := range []config.Role{config.Decode, config.Prefill} {
		t.Run(role.String(), func(t *testing.T) {
			set, dir, shm := newWorkerSet(t)
			cfg := crashWorkerConfig(t, role, dir, shm)
			sock := strings.TrimPrefix(cfg.Node.Control, "ipc://")
			w1, err := set.Launch(t.Context(), workers.Spec{Name: "first", Config: cfg})
			if err != nil {
				t.Fatal(err)
			}
			engine := w1.Cache // the test's mapping outlives the worker, as an engine's does
			engine.Block(1, 1, 5)[0] = 0xA7
			before, _ := os.Stat(cfg.Cache.Path)

			syscall.Kill(w1.Pid(), syscall.SIGKILL)
			<-w1.Exited()
			for _, p := range []string{cfg.Cache.Path, sock} {
				if !exists(p) {
					t.Fatalf("%s is gone after SIGKILL: the test would not show a restart over leftovers", p)
				}
			}

			w2, err := set.Launch(t.Context(), workers.Spec{Name: "restarted", Config: cfg})
			if err != nil {
				t.Fatalf("restart after SIGKILL: %v", err)
			}
			if r, err := w2.Ctl.Call(map[string]any{"op": "status"}); err != nil || !r.OK {
				t.Fatalf("restarted worker's control socket: %+v, %v", r, err)
			}
			after, _ := os.Stat(cfg.Cache.Path)
			if !os.SameFile(before, after) {
				t.Error("the cache file was replaced, not reclaimed in place: the engine's mapping is cut off")
			}
			if w2.Cache.Block(1, 1, 5)[0] != 0xA7 {
				t.Error("the cache contents were not kept")
			}
			w2.Cache.Block(1, 1, 6)[0] = 0x3C
			if engine.Block(1, 1, 6)[0] != 0x3C {
				t.Error("the engine's mapping from before the crash does not see the restarted worker's cache")
			}
			if log := workers.Tail(w2.LogPath); !strings.Contains(log, "taken over") {
				t.Errorf("the restarted worker's log does not say it took over the cache file:\n%s", log)
			}

			stopClean(t, w2)
			for _, p := range []string{cfg.Cache.Path, sock, sock + ".lock"} {
				if exists(p) {
					t.Errorf("%s left after a clean stop", p)
				}
			}
		})
	}
}

// A second worker with the same engine id, role and ranks (so the same
// control socket) exits 2 with a message naming the socket and the live
// worker's pid, and takes nothing from the first, which still answers on
// its control socket; a clean stop of the first removes the socket files.
func TestServeSecondWorkerSameControl(t *testing.T) {
	set, dir, shm := newWorkerSet(t)
	cfg := crashWorkerConfig(t, config.Decode, dir, shm)
	cfg.Cache = config.Cache{Mode: config.CacheAnonymous, NoHugePages: true} // only the socket is shared
	sock := strings.TrimPrefix(cfg.Node.Control, "ipc://")
	w1, err := set.Launch(t.Context(), workers.Spec{Name: "first", Config: cfg})
	if err != nil {
		t.Fatal(err)
	}

	cmd := exec.Command(set.Exe, "serve", "--config", filepath.Join(dir, "first.json"))
	var stderr lockedBuffer
	cmd.Stderr = &stderr
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	readyLine := make(chan string, 1)
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			if strings.HasPrefix(sc.Text(), "kvflow ready") {
				readyLine <- sc.Text()
			}
		}
		close(readyLine)
	}()
	var exitErr *exec.ExitError
	select {
	case line, ok := <-readyLine:
		if ok {
			cmd.Process.Kill()
			cmd.Wait()
			t.Fatalf("a second worker on the same control socket came up: %s", line)
		}
		err := cmd.Wait()
		if !errors.As(err, &exitErr) || exitErr.ExitCode() != exitUsage {
			t.Fatalf("second worker: %v (want exit %d)\n%s", err, exitUsage, stderr.String())
		}
	case <-time.After(30 * time.Second):
		cmd.Process.Kill()
		cmd.Wait()
		t.Fatalf("second worker neither exited nor came up\n%s", stderr.String())
	}
	msg := stderr.String()
	for _, want := range []string{cfg.Node.Control, fmt.Sprintf("pid %d", w1.Pid()), "another kvflow worker with this engine id, role and ranks is running"} {
		if !strings.Contains(msg, want) {
			t.Errorf("second worker's message does not name %q:\n%s", want, msg)
		}
	}
	if r, err := w1.Ctl.Call(map[string]any{"op": "status"}); err != nil || !r.OK {
		t.Fatalf("first worker's control socket after the second tried: %+v, %v", r, err)
	}

	stopClean(t, w1)
	for _, p := range []string{sock, sock + ".lock"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after a clean stop: %v", p, err)
		}
	}
}
