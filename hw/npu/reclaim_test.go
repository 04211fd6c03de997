//go:build linux

package npu

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// shmTestDir is a fresh directory on /dev/shm when there is one (tmpfs, as
// in production), else under t.TempDir.
func shmTestDir(t *testing.T) string {
	t.Helper()
	if d, err := os.MkdirTemp("/dev/shm", "kvflow-npu-test-"); err == nil {
		t.Cleanup(func() { os.RemoveAll(d) })
		return d
	}
	return t.TempDir()
}

func fill(h *Host, b byte) {
	d := h.Data()
	for i := range d {
		d[i] = b
	}
}

// die leaves h's file as a killed owner does: no owner lock (the kernel
// drops it with the process), the file and its contents still there.
func die(h *Host) {
	h.remove = false
	h.Close()
}

// TestShmReclaim: what CreateShm does with each kind of file already at
// its path.
func TestShmReclaim(t *testing.T) {
	l, _ := NewLayout(shmShape)
	other := shmShape
	other.NumBlocks = 7
	lo, _ := NewLayout(other)
	cases := []struct {
		name string
		// setup leaves something at path; the Host it returns (if any)
		// is a live owner, closed at the end.
		setup func(t *testing.T, path string) *Host
		// is: the error CreateShm must return (nil: success).
		is      error
		want    string // in the error, or in Reclaimed on success
		inPlace bool   // success: the same file, contents kept
	}{
		{"dead owner, same shape", func(t *testing.T, path string) *Host {
			h, err := CreateShm(path, l, HostOptions{RemoveOnClose: true})
			if err != nil {
				t.Fatal(err)
			}
			fill(h, 0x5A)
			die(h)
			return nil
		}, nil, "in place", true},
		{"dead owner, another shape", func(t *testing.T, path string) *Host {
			h, err := CreateShm(path, lo, HostOptions{})
			if err != nil {
				t.Fatal(err)
			}
			fill(h, 0x5A)
			die(h)
			return nil
		}, nil, "another shape", false},
		{"live owner", func(t *testing.T, path string) *Host {
			h, err := CreateShm(path, l, HostOptions{})
			if err != nil {
				t.Fatal(err)
			}
			return h
		}, ErrInUse, fmt.Sprintf("(pid %d): another kvflow worker", os.Getpid()), false},
		{"foreign file", func(t *testing.T, path string) *Host {
			os.WriteFile(path, []byte("not a cache\n"), 0o600)
			return nil
		}, ErrBadMagic, "not a kvflow cache file to reuse", false},
		{"corrupt header", func(t *testing.T, path string) *Host {
			h, _ := CreateShm(path, l, HostOptions{})
			h.Close()
			f, _ := os.OpenFile(path, os.O_RDWR, 0)
			f.WriteAt([]byte{0xFF}, 40)
			f.Close()
			return nil
		}, ErrBadChecksum, "remove it if it is stale", false},
		{"symlink", func(t *testing.T, path string) *Host {
			target := path + ".target"
			h, _ := CreateShm(target, l, HostOptions{})
			h.Close()
			os.Symlink(target, path)
			return nil
		}, ErrBadFile, "symbolic link", false},
		{"directory", func(t *testing.T, path string) *Host {
			os.Mkdir(path, 0o700)
			return nil
		}, ErrBadFile, "not a regular file", false},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			path := filepath.Join(shmTestDir(t), "kv")
			if owner := tc.setup(t, path); owner != nil {
				defer owner.Close()
			}
			// The serving engine, which mapped the file before its
			// owner died and still does.
			var engine *Host
			if tc.is == nil {
				var err error
				if engine, err = OpenShm(path, HostOptions{NoLock: true}); err != nil {
					t.Fatal(err)
				}
				defer engine.Close()
			}
			before, _ := os.Lstat(path)
			var sum [32]byte
			if before.Mode().IsRegular() {
				sum = fileSum(t, path)
			}
			h, err := CreateShm(path, l, HostOptions{RemoveOnClose: true})
			if tc.is != nil {
				if err == nil {
					h.Close()
					t.Fatal("CreateShm succeeded")
				}
				if !errors.Is(err, tc.is) || !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), tc.want) {
					t.Fatalf("error %q; want %v, the path and %q", err, tc.is, tc.want)
				}
				after, _ := os.Lstat(path)
				if !os.SameFile(before, after) || (before.Mode().IsRegular() && fileSum(t, path) != sum) {
					t.Error("the file was changed")
				}
				return
			}
			if err != nil {
				t.Fatalf("CreateShm over a dead owner's file: %v", err)
			}
			if !strings.Contains(h.Reclaimed(), tc.want) {
				t.Errorf("Reclaimed %q, want %q", h.Reclaimed(), tc.want)
			}
			if h.Layout().Shape() != shmShape {
				t.Errorf("shape %+v", h.Layout().Shape())
			}
			after, _ := os.Stat(path)
			if os.SameFile(before, after) != tc.inPlace {
				t.Errorf("same file %v, want %v", os.SameFile(before, after), tc.inPlace)
			}
			want := byte(0)
			if tc.inPlace {
				want = 0x5A
			}
			if !bytes.Equal(h.Data(), bytes.Repeat([]byte{want}, len(h.Data()))) {
				t.Errorf("contents: want every byte %#x", want)
			}
			h.Data()[7] = 0xC3
			if seen := engine.Data()[7] == 0xC3; seen != tc.inPlace {
				t.Errorf("the engine's old mapping sees the new owner's writes: %v, want %v", seen, tc.inPlace)
			}
			// The reclaimer owns it now: a third is refused.
			if h3, err := CreateShm(path, l, HostOptions{}); !errors.Is(err, ErrInUse) {
				if h3 != nil {
					h3.Close()
				}
				t.Errorf("CreateShm over the reclaimed file: %v", err)
			}
			if err := h.Close(); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Lstat(path); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("RemoveOnClose left the reclaimed file: %v", err)
			}
			if m, _ := filepath.Glob(path + ".tmp*"); len(m) != 0 {
				t.Errorf("temporary files left: %v", m)
			}
		})
	}
}

const ownerEnv = "KVFLOW_NPU_SHM_OWNER"

// TestShmOwnerHelper is the owner process of TestShmOwnerKilled: it creates
// the file, fills it, says so and holds it until killed (or its stdin
// closes).
func TestShmOwnerHelper(t *testing.T) {
	path := os.Getenv(ownerEnv)
	if path == "" {
		t.Skip("helper for TestShmOwnerKilled")
	}
	l, _ := NewLayout(shmShape)
	h, err := CreateShm(path, l, HostOptions{RemoveOnClose: true, NoLock: true})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close()
	fill(h, 0x77)
	fmt.Println("owner ready")
	bufio.NewReader(os.Stdin).ReadString('\n')
}

// TestShmOwnerKilled, over real processes: a live owner's file is refused
// by name and pid; once the owner is SIGKILLed (its file left behind, as
// under a crash), the next CreateShm reclaims it in place, and an engine
// that mapped it before the crash sees the new owner's writes.
func TestShmOwnerKilled(t *testing.T) {
	path := filepath.Join(shmTestDir(t), "kv")
	cmd := exec.Command(os.Args[0], "-test.run=^TestShmOwnerHelper$", "-test.count=1")
	cmd.Env = append(os.Environ(), ownerEnv+"="+path)
	stdin, _ := cmd.StdinPipe()
	defer stdin.Close()
	out, _ := cmd.StdoutPipe()
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { cmd.Process.Kill(); cmd.Wait() }()
	if line, err := bufio.NewReader(out).ReadString('\n'); !strings.HasPrefix(line, "owner ready") {
		t.Fatalf("owner process: %q, %v", line, err)
	}
	engine, err := OpenShm(path, HostOptions{Expect: &shmShape, NoLock: true})
	if err != nil {
		t.Fatal(err)
	}
	defer engine.Close()

	l, _ := NewLayout(shmShape)
	_, err = CreateShm(path, l, HostOptions{})
	if !errors.Is(err, ErrInUse) || !strings.Contains(err.Error(), path) ||
		!strings.Contains(err.Error(), fmt.Sprintf("pid %d", cmd.Process.Pid)) {
		t.Fatalf("CreateShm over a live owner's file: %v; want ErrInUse naming %s and pid %d", err, path, cmd.Process.Pid)
	}

	cmd.Process.Kill()
	cmd.Wait()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the killed owner's file: %v", err)
	}
	h, err := CreateShm(path, l, HostOptions{RemoveOnClose: true, NoLock: true})
	if err != nil {
		t.Fatalf("CreateShm after the owner was killed: %v", err)
	}
	t.Logf("reclaimed: %s", h.Reclaimed())
	if h.Block(2, 1, 4)[0] != 0x77 {
		t.Error("the dead owner's contents were not kept")
	}
	h.Block(2, 1, 4)[0] = 0x11
	if engine.Block(2, 1, 4)[0] != 0x11 {
		t.Error("the engine's mapping does not see the new owner's memory")
	}
	if err := h.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("RemoveOnClose left the file: %v", err)
	}
}
