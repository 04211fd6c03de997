//go:build linux

package control

import (
	"context"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/internal/sidechannel"
)

// The socket lock over a real bound control socket: a second locker is
// refused by name and pid, the first keeps serving, Release removes both
// files, and files a dead worker left are taken over.
func TestLockSocket(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "ctl.sock")
	endpoint := "ipc://" + sock

	first, err := LockSocket(endpoint)
	if err != nil {
		t.Fatal(err)
	}
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		t.Fatal(err)
	}
	srv, err := Serve(context.Background(), zctx, endpoint, Backend{Role: "decode"}, nil)
	if err != nil {
		t.Fatal(err)
	}

	_, err = LockSocket(endpoint)
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), endpoint) ||
		!strings.Contains(err.Error(), fmt.Sprintf("pid %d", os.Getpid())) {
		t.Fatalf("second LockSocket: %v; want ErrInUse naming %s and pid %d", err, endpoint, os.Getpid())
	}
	c := newReqClient(t, endpoint)
	if r := c.callMap(m{"op": "status"}); r["ok"] != true || r["role"] != "decode" {
		t.Errorf("first worker after a refused second: %v", r)
	}

	srv.Close()
	if err := zctx.Close(); err != nil {
		t.Fatal(err)
	}
	if err := first.Release(); err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{sock, sock + ".lock"} {
		if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
			t.Errorf("%s after Release: %v", p, err)
		}
	}
	if err := first.Release(); err != nil {
		t.Errorf("second Release: %v", err)
	}

	// A dead worker's leftovers: a stale socket (bound, never closed) and
	// an unlocked lock file naming a pid long gone.
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: sock, Net: "unix"})
	if err != nil {
		t.Fatal(err)
	}
	ln.SetUnlinkOnClose(false)
	ln.Close()
	os.WriteFile(sock+".lock", []byte("999999\n"), 0o600)
	l, err := LockSocket(endpoint)
	if err != nil {
		t.Fatalf("LockSocket over a dead worker's files: %v", err)
	}
	if b, _ := os.ReadFile(sock + ".lock"); strings.TrimSpace(string(b)) != fmt.Sprint(os.Getpid()) {
		t.Errorf("lock file says %q, want this pid", b)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Lstat(sock); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("stale socket after Release: %v", err)
	}

	// Release never removes what is not a socket.
	l, _ = LockSocket(endpoint)
	os.WriteFile(sock, []byte("keep"), 0o600)
	l.Release()
	if b, _ := os.ReadFile(sock); string(b) != "keep" {
		t.Errorf("Release removed a regular file at the socket path")
	}
}

func TestLockSocketNoFile(t *testing.T) {
	for _, ep := range []string{"tcp://127.0.0.1:5555", "ipc://@kvflow-abstract", "ipc://"} {
		l, err := LockSocket(ep)
		if err != nil {
			t.Errorf("%s: %v", ep, err)
			continue
		}
		if err := l.Release(); err != nil {
			t.Errorf("%s: Release: %v", ep, err)
		}
	}
}
