//go:build linux

package shm

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/kvflow/kvflow/hw/npu"
)

// The cross-process tests run a prefill in a child process: this test
// binary started again with childEnv set.
const childEnv = "KVFLOW_SHM_TEST_PREFILL"

func TestMain(m *testing.M) {
	if dir := os.Getenv(childEnv); dir != "" {
		os.Exit(childPrefill(dir))
	}
	os.Exit(m.Run())
}

type childHello struct {
	Claim Claim
	Base  []uint64
}

var childBlocks = []int{0, 1, 2, 3}

// childPrefill owns a cache file and grant table in dir, filled with
// pattern(seed), blocks childBlocks granted to request "A". On stdin:
// "reuse FROM TO SEED" frees the blocks (revokes request FROM), rewrites
// the cache with pattern(SEED) and grants the blocks to request TO
// (another request in the same blocks), then answers "ok"; "exit" exits
// at once, without closing anything (as a crash would).
func childPrefill(dir string) int {
	seed, _ := strconv.Atoi(os.Getenv(childEnv + "_SEED"))
	fail := func(err error) int { fmt.Fprintln(os.Stderr, "child:", err); return 1 }
	l, err := npu.NewLayout(testShape)
	if err != nil {
		return fail(err)
	}
	path := filepath.Join(dir, "cache")
	h, err := npu.CreateShm(path, l, npu.HostOptions{NoLock: true, NoHugePages: true})
	if err != nil {
		return fail(err)
	}
	fill(h.Data(), seed)
	tb, err := CreateTable(path+".grants", testShape.NumBlocks, 0)
	if err != nil {
		return fail(err)
	}
	c, err := MakeClaim(path, tb)
	if err != nil {
		return fail(err)
	}
	if err := tb.GrantRequest("A", childBlocks); err != nil {
		return fail(err)
	}
	if err := json.NewEncoder(os.Stdout).Encode(childHello{c, h.BaseAddrs()}); err != nil {
		return fail(err)
	}
	in := bufio.NewScanner(os.Stdin)
	for in.Scan() {
		f := strings.Fields(in.Text())
		switch {
		case len(f) == 4 && f[0] == "reuse":
			if err := tb.RevokeRequest(f[1], childBlocks); err != nil {
				return fail(err)
			}
			s, _ := strconv.Atoi(f[3])
			fill(h.Data(), s)
			if err := tb.GrantRequest(f[2], childBlocks); err != nil {
				return fail(err)
			}
			fmt.Println("ok")
		case len(f) == 1 && f[0] == "exit":
			return 0
		}
	}
	return 0
}

type child struct {
	cmd   *exec.Cmd
	in    io.WriteCloser
	out   *bufio.Reader
	hello childHello
}

func startChild(t *testing.T, dir string, seed int) *child {
	t.Helper()
	exe, err := os.Executable()
	must(t, err)
	cmd := exec.Command(exe, "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+dir, childEnv+"_SEED="+strconv.Itoa(seed))
	cmd.Stderr = os.Stderr
	in, err := cmd.StdinPipe()
	must(t, err)
	outp, err := cmd.StdoutPipe()
	must(t, err)
	must(t, cmd.Start())
	c := &child{cmd: cmd, in: in, out: bufio.NewReader(outp)}
	t.Cleanup(func() { in.Close(); cmd.Process.Kill(); cmd.Wait() })
	line, err := c.out.ReadBytes('\n')
	if err != nil {
		t.Fatalf("child prefill: %v", err)
	}
	must(t, json.Unmarshal(line, &c.hello))
	return c
}

func (c *child) say(t testing.TB, cmd string) {
	t.Helper()
	if _, err := fmt.Fprintln(c.in, cmd); err != nil {
		t.Fatal(err)
	}
}

// remoteOps reads childBlocks of every cache into the same blocks of d.
func remoteOps(base []uint64, d *npu.Host) []Op {
	l := d.Layout()
	var ops []Op
	for k, rb := range base {
		_, part := l.CacheOf(k)
		bl := uint64(l.BlockLen(part))
		n := uint64(len(childBlocks))
		ops = append(ops, Op{Local: d.BaseAddrs()[k] + uint64(childBlocks[0])*bl, Remote: rb + uint64(childBlocks[0])*bl, Len: n * bl})
	}
	return ops
}

// checkSeed verifies every byte of d's childBlocks against pattern(seed)
// at the offsets they have in the prefill's data, and every other byte is
// zero.
func checkSeed(t *testing.T, d *npu.Host, seed int) {
	t.Helper()
	l := d.Layout()
	for k := range l.NumCaches() {
		layer, part := l.CacheOf(k)
		bl := l.BlockLen(part)
		for b := range l.Shape().NumBlocks {
			got := d.Block(layer, part, b)
			for j, v := range got {
				want := byte(0)
				if b < len(childBlocks) {
					want = pattern(seed, int(l.Offset(layer, part))+b*bl+j)
				}
				if v != want {
					t.Fatalf("cache %d block %d byte %d: %#x, want %#x (seed %d)", k, b, j, v, want, seed)
				}
			}
		}
	}
}

// TestCrossProcessGrants: a prefill in another process frees its blocks
// and reuses them while the decode copies; the decode's read fails. A
// prefill that exits, and one restarted on the same files, are never read
// through the old claim.
func TestCrossProcessGrants(t *testing.T) {
	dir := t.TempDir()
	c1 := startChild(t, dir, 1)
	d := decodeMem(t, testShape)
	r, err := Open(c1.hello.Claim, Options{BaseAddrs: c1.hello.Base, Local: caches(d)})
	must(t, err)
	defer r.Close()
	ops := remoteOps(c1.hello.Base, d)
	read := func(req string) error { return r.Read(t.Context(), req, ops, Stride{}) }
	reuse := func(cmd string) {
		c1.say(t, cmd)
		if line, err := c1.out.ReadString('\n'); err != nil || line != "ok\n" {
			t.Errorf("child: %q %v", line, err)
		}
	}
	must(t, read("A"))
	checkSeed(t, d, 1)
	if err := read("B"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read as a request never sent: %v", err)
	}

	// "A" freed and its blocks reused for "B" by the other process while
	// the copy runs: refused.
	n := 0
	r.testAfterCopy = func() {
		if n++; n == 1 {
			reuse("reuse A B 101")
		}
	}
	if err := read("A"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read of A across its reuse: %v", err)
	}
	r.testAfterCopy = nil
	// Freed before the read starts, the blocks already granted to "B":
	// never read as A's.
	if err := read("A"); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("read of a freed request's reused blocks: %v", err)
	}
	// Read as "B": B's data.
	must(t, read("B"))
	checkSeed(t, d, 101)

	// Without a request id, the blocks' generations alone catch a reuse
	// during the copy.
	n = 0
	r.testAfterCopy = func() {
		if n++; n == 1 {
			reuse("reuse B C 102")
		}
	}
	if err := read(""); !errors.Is(err, ErrNotGranted) {
		t.Fatalf("block-only read across a reuse: %v", err)
	}
	r.testAfterCopy = nil
	must(t, read("C"))
	checkSeed(t, d, 102)

	// The owner exits (no Close: its table still says granted).
	c1.say(t, "exit")
	must(t, c1.cmd.Wait())
	if err := r.Read(t.Context(), "", ops, Stride{}); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("read after the owner exited: %v", err)
	}
	if _, err := Open(c1.hello.Claim, Options{BaseAddrs: c1.hello.Base, Local: caches(d)}); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("open after the owner exited: %v", err)
	}

	// Restarted on the same files (taken over in place: same inodes).
	c2 := startChild(t, dir, 2)
	if c2.hello.Claim.Ino != c1.hello.Claim.Ino || c2.hello.Claim.GrantsIno != c1.hello.Claim.GrantsIno {
		t.Fatalf("restart did not reuse the files in place: %+v vs %+v", c2.hello.Claim, c1.hello.Claim)
	}
	if err := r.Read(t.Context(), "", ops, Stride{}); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("old claim after a restart: %v", err)
	}
	if _, err := Open(c1.hello.Claim, Options{BaseAddrs: c1.hello.Base, Local: caches(d)}); !errors.Is(err, ErrOwnerGone) {
		t.Fatalf("open of the old claim after a restart: %v", err)
	}
	r2, err := Open(c2.hello.Claim, Options{BaseAddrs: c2.hello.Base, Local: caches(d)})
	must(t, err)
	defer r2.Close()
	must(t, r2.Read(t.Context(), "", remoteOps(c2.hello.Base, d), Stride{}))
	checkSeed(t, d, 2)
	c2.say(t, "exit")
}
