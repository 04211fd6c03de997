package netem

import (
	"context"
	"errors"
	"net"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// pipeSize is the capacity asked of each splice pipe: one chunk of a
// splice line.
const pipeSize = 256 << 10

// spliceLine is a delayLine that never copies a byte through user space:
// a chunk is spliced from the source socket into a pipe of its own, held
// there for its delay, and spliced from the pipe into the destination
// socket (splice(2) moves page references). A real netem qdisc costs the
// endpoints nothing; the copying line costs two copies of every byte on
// the benchmark's own cores, which the splice line removes. Order, the
// release times and the bound on bytes in flight are the copying line's.
type spliceLine struct {
	delay *delayLine // timing (release) and the byte bound (sem)
	ch    chan pchunk

	// free holds the empty pipes, at most maxPipes made per line: a line
	// of small chunks waits for a pipe to come back rather than holding
	// thousands of descriptors. Made counts the pipes made (reader only).
	free chan *pipe
	made int
}

// maxPipes bounds the pipes of one line (two descriptors each).
const maxPipes = 64

type pchunk struct {
	p   *pipe
	n   int
	at  time.Time
	eof bool
	err error
}

// pipe is one non-blocking pipe.
type pipe struct{ r, w int }

func newPipe() (*pipe, int, error) {
	var fds [2]int
	if err := unix.Pipe2(fds[:], unix.O_NONBLOCK|unix.O_CLOEXEC); err != nil {
		return nil, 0, err
	}
	p := &pipe{r: fds[0], w: fds[1]}
	size, err := unix.FcntlInt(uintptr(p.w), unix.F_SETPIPE_SZ, pipeSize)
	if err != nil { // e.g. above pipe-max-size: keep the default
		if size, err = unix.FcntlInt(uintptr(p.w), unix.F_GETPIPE_SZ, 0); err != nil {
			p.close()
			return nil, 0, err
		}
	}
	return p, size, nil
}

func (p *pipe) close() {
	unix.Close(p.r)
	unix.Close(p.w)
}

// newSpliceLine makes a splice line for src -> dst, or returns nil when
// either is not a TCP socket or the kernel has no pipes to splice with.
func newSpliceLine(spec Spec, buf int, src, dst net.Conn) *spliceLine {
	if _, ok := src.(*net.TCPConn); !ok {
		return nil
	}
	if _, ok := dst.(*net.TCPConn); !ok {
		return nil
	}
	p, size, err := newPipe()
	if err != nil {
		return nil
	}
	d := newDelayLine(spec, buf)
	d.want = min(d.want, int64(size))
	l := &spliceLine{delay: d, ch: make(chan pchunk, queueSlots), free: make(chan *pipe, maxPipes), made: 1}
	l.free <- p
	return l
}

// get returns an empty pipe: a free one, else a new one while fewer than
// maxPipes exist and the system gives one, else the next one the writer
// frees (an error only if ctx ends first, or no pipe exists at all).
func (l *spliceLine) get(ctx context.Context) (*pipe, error) {
	select {
	case p := <-l.free:
		return p, nil
	default:
	}
	if l.made < maxPipes {
		p, size, err := newPipe()
		switch {
		case err == nil && int64(size) >= l.delay.want:
			l.made++
			return p, nil
		case err == nil: // smaller than the first: unusable
			p.close()
		}
	}
	select {
	case p := <-l.free:
		return p, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// put returns an empty pipe (never blocks: at most maxPipes exist).
func (l *spliceLine) put(p *pipe) { l.free <- p }

// close releases every pipe; call it after read and write returned.
func (l *spliceLine) close() {
	for c := range l.ch { // chunks the writer never took
		if c.p != nil {
			c.p.close()
		}
	}
	for {
		select {
		case p := <-l.free:
			p.close()
		default:
			return
		}
	}
}

func (l *spliceLine) send(ctx context.Context, c pchunk) bool {
	select {
	case l.ch <- c:
		return true
	case <-ctx.Done():
		if c.p != nil {
			c.p.close()
		}
		return false
	}
}

func (l *spliceLine) read(ctx context.Context, src net.Conn) {
	defer close(l.ch)
	rc, err := src.(*net.TCPConn).SyscallConn()
	if err != nil {
		l.send(ctx, pchunk{at: l.delay.release(time.Now()), err: err})
		return
	}
	want := l.delay.want
	for {
		if err := l.delay.sem.Acquire(ctx, want); err != nil {
			return
		}
		p, err := l.get(ctx)
		var n int64
		if err == nil {
			var serr error
			err = rc.Read(func(fd uintptr) bool {
				n, serr = unix.Splice(int(fd), nil, p.w, nil, int(want), unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
				return !errors.Is(serr, syscall.EAGAIN)
			})
			if err == nil {
				err = serr
			}
		}
		now := time.Now()
		l.delay.sem.Release(want - max(n, 0))
		switch {
		case n > 0:
			if !l.send(ctx, pchunk{p: p, n: int(n), at: l.delay.release(now)}) {
				return
			}
		case p != nil:
			l.put(p)
		}
		if err != nil || n == 0 { // n == 0 without an error: EOF
			c := pchunk{at: l.delay.release(now), eof: err == nil, err: err}
			l.send(ctx, c)
			return
		}
	}
}

// write delivers chunks to dst at their time; it reports what
// delayLine.write reports.
func (l *spliceLine) write(ctx context.Context, dst net.Conn) bool {
	wc, err := dst.(*net.TCPConn).SyscallConn()
	if err != nil {
		return false
	}
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	for {
		c, ok := awaitDue(ctx, l.ch, func(c pchunk) time.Time { return c.at }, timer)
		if !ok {
			if c.p != nil {
				c.p.close()
			}
			return false
		}
		switch {
		case c.eof:
			return dst.(*net.TCPConn).CloseWrite() == nil
		case c.err != nil:
			return false
		}
		left := c.n
		var serr error
		err := wc.Write(func(fd uintptr) bool {
			for left > 0 {
				m, e := unix.Splice(c.p.r, nil, int(fd), nil, left, unix.SPLICE_F_MOVE|unix.SPLICE_F_NONBLOCK)
				if errors.Is(e, syscall.EAGAIN) {
					return false // the socket is full: wait until writable
				}
				if e != nil {
					serr = e
					return true
				}
				left -= int(m)
			}
			return true
		})
		l.delay.sem.Release(int64(c.n))
		if err == nil {
			err = serr
		}
		if err != nil {
			c.p.close() // may still hold bytes
			return false
		}
		l.put(c.p)
	}
}
