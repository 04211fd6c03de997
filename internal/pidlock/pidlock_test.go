//go:build linux

package pidlock

import (
	"bufio"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// A child process that holds a lock until killed: the test binary re-run
// with PIDLOCK_HOLD=path.
func TestMain(m *testing.M) {
	if path := os.Getenv("PIDLOCK_HOLD"); path != "" {
		l, err := Acquire(path)
		if err != nil {
			fmt.Println("error:", err)
			os.Exit(1)
		}
		fmt.Println("locked", l.Path())
		select {} // until killed
	}
	os.Exit(m.Run())
}

// holdInChild starts a process that holds the lock file at path, and waits
// until it does.
func holdInChild(t *testing.T, path string) *exec.Cmd {
	t.Helper()
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	cmd := exec.Command(exe)
	cmd.Env = append(os.Environ(), "PIDLOCK_HOLD="+path)
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	line, err := bufio.NewReader(out).ReadString('\n')
	if !strings.HasPrefix(line, "locked") {
		t.Fatalf("child: %q, %v", line, err)
	}
	return cmd
}

func TestHolderParse(t *testing.T) {
	locks := []byte(`1: POSIX  ADVISORY  WRITE 10 00:1a:77 0 EOF
2: FLOCK  ADVISORY  WRITE 4711 fe:00:9978929 0 EOF
2: -> FLOCK  ADVISORY  WRITE 4712 fe:00:9978929 0 EOF
3: OFDLCK ADVISORY  READ  -1 00:1a:5 0 0
4: FLOCK  ADVISORY  WRITE 99 103:02:5 0 EOF
5: FLOCK  ADVISORY  WRITE x 00:1a:6 0 EOF
garbage
`)
	cases := []struct {
		name              string
		major, minor, ino uint64
		want              int
	}{
		{"flock", 0xfe, 0, 9978929, 4711},
		{"posix lock is not a flock", 0x00, 0x1a, 77, 0},
		{"ofd lock is not a flock", 0x00, 0x1a, 5, 0},
		{"three hex digits of major", 0x103, 2, 5, 99},
		{"other inode", 0xfe, 0, 1, 0},
		{"bad pid", 0, 0x1a, 6, 0},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if got := holder(locks, tc.major, tc.minor, tc.ino); got != tc.want {
				t.Errorf("holder = %d, want %d", got, tc.want)
			}
		})
	}
}

// Two opens in one process are two owners: the second is refused, and the
// error names this process.
func TestTryLockSameProcess(t *testing.T) {
	path := filepath.Join(t.TempDir(), "f")
	if err := os.WriteFile(path, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	a, _ := os.Open(path)
	defer a.Close()
	b, _ := os.Open(path)
	defer b.Close()
	if err := TryLock(a); err != nil {
		t.Fatal(err)
	}
	err := TryLock(b)
	var he *HeldError
	if !errors.As(err, &he) || !errors.Is(err, ErrHeld) || he.PID != os.Getpid() {
		t.Fatalf("second lock: %v (want HeldError with pid %d)", err, os.Getpid())
	}
	if !strings.Contains(err.Error(), path) || !strings.Contains(err.Error(), fmt.Sprint(os.Getpid())) {
		t.Errorf("message %q names neither the file nor the pid", err)
	}
	a.Close()
	if err := TryLock(b); err != nil {
		t.Errorf("after the owner closed: %v", err)
	}
}

// A live holder in another process is refused by pid; once it is killed
// (SIGKILL: no cleanup ran) its lock file, still there, is taken over.
func TestAcquireLiveThenDead(t *testing.T) {
	path := filepath.Join(t.TempDir(), "w.lock")
	child := holdInChild(t, path)
	_, err := Acquire(path)
	var he *HeldError
	if !errors.As(err, &he) || he.PID != child.Process.Pid {
		t.Fatalf("Acquire with a live holder: %v (want held by %d)", err, child.Process.Pid)
	}
	if b, _ := os.ReadFile(path); strings.TrimSpace(string(b)) != fmt.Sprint(child.Process.Pid) {
		t.Errorf("lock file holds %q, want the holder's pid", b)
	}
	child.Process.Kill()
	child.Wait()
	if _, err := os.Stat(path); err != nil {
		t.Fatalf("the killed holder's lock file: %v", err)
	}
	l, err := Acquire(path)
	if err != nil {
		t.Fatalf("Acquire after the holder died: %v", err)
	}
	if b, _ := os.ReadFile(path); strings.TrimSpace(string(b)) != fmt.Sprint(os.Getpid()) {
		t.Errorf("lock file holds %q, want this pid", b)
	}
	if _, err := Acquire(path); !errors.Is(err, ErrHeld) {
		t.Errorf("second Acquire in this process: %v, want ErrHeld", err)
	}
	if err := l.Release(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(path); !errors.Is(err, fs.ErrNotExist) {
		t.Errorf("lock file after Release: %v", err)
	}
	if err := l.Release(); err != nil {
		t.Errorf("second Release: %v", err)
	}
	l2, err := Acquire(path)
	if err != nil {
		t.Fatalf("Acquire after Release: %v", err)
	}
	l2.Release()
}

func TestAcquireRefusesSymlink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "target")
	os.WriteFile(target, []byte("keep"), 0o600)
	link := filepath.Join(dir, "w.lock")
	os.Symlink(target, link)
	if _, err := Acquire(link); err == nil {
		t.Fatal("Acquire followed a symlink")
	}
	if b, _ := os.ReadFile(target); string(b) != "keep" {
		t.Errorf("symlink target changed: %q", b)
	}
}
