package netem

import (
	"context"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"runtime"

	"golang.org/x/sys/unix"
)

// netnsDir is where `ip netns add` bind-mounts named namespaces.
const netnsDir = "/var/run/netns"

// inNetns runs fn on a locked OS thread that has entered the named
// network namespace. Sockets fn creates belong to that namespace for
// their whole life. The thread goes back to its own namespace before it
// is unlocked; if going back fails the goroutine exits still locked, so
// the Go runtime throws the thread away instead of reusing it.
func inNetns(name string, fn func() error) error {
	if err := checkName(name); err != nil {
		return err
	}
	target, err := os.Open(filepath.Join(netnsDir, name))
	if err != nil {
		return fmt.Errorf("netem: open namespace %s: %w", name, err)
	}
	defer target.Close()

	done := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		// Deliberately no UnlockOSThread unless the thread is back home.
		orig, err := os.Open("/proc/thread-self/ns/net")
		if err != nil {
			done <- fmt.Errorf("netem: open own namespace: %w", err)
			return // exits locked: thread discarded
		}
		defer orig.Close()
		if err := unix.Setns(int(target.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- fmt.Errorf("netem: setns %s: %w", name, err)
			return
		}
		ferr := fn()
		if err := unix.Setns(int(orig.Fd()), unix.CLONE_NEWNET); err != nil {
			done <- ferr // exits locked: thread discarded
			return
		}
		runtime.UnlockOSThread()
		done <- ferr
	}()
	return <-done
}

// listenIn is net.Listen inside namespace ns.
func listenIn(ns, network, addr string) (net.Listener, error) {
	var ln net.Listener
	err := inNetns(ns, func() error {
		var err error
		ln, err = net.Listen(network, addr)
		return err
	})
	return ln, err
}

// dialIn is a dial inside namespace ns. The socket is made (and the
// connect started) on the namespace thread; waiting for the connect is
// the netpoller's, on any thread, which is fine.
func dialIn(ctx context.Context, ns, network, addr string) (net.Conn, error) {
	var c net.Conn
	err := inNetns(ns, func() error {
		var d net.Dialer
		var err error
		c, err = d.DialContext(ctx, network, addr)
		return err
	})
	return c, err
}
