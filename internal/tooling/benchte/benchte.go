package benchte

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"net"
	"os"
	"strconv"
	"sync/atomic"
	"time"

	"github.com/lmittmann/tint"
	"golang.org/x/sync/errgroup"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/internal/cli/clierr"
)

// bufferName is the name the target registers its buffer under, as
// transfer_engine_bench names its first DRAM buffer.
const bufferName = "cpu:0"

// Run is `kvflow bench te`, transfer_engine_bench over kvflow's TCP engine.
// Bad flags are a *clierr.UsageError, -h returns flag.ErrHelp (after
// printing the flags to stderr); a failed transfer or verification is a
// plain error. Target mode serves until ctx is done and then returns nil; an
// initiator interrupted through ctx prints what it measured and returns an
// error wrapping ctx.Err().
func Run(ctx context.Context, args []string, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("kvflow bench te", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	var o options
	o.register(fs)
	if err := clierr.ParseFlags(fs, args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			printUsage(fs, stdout)
		}
		return err
	}
	note, err := o.validate()
	if err != nil {
		return &clierr.UsageError{Err: err}
	}
	if note != "" {
		fmt.Fprintln(stderr, "warning:", note)
	}
	log := newLogger(stderr)
	switch o.mode {
	case ModeTarget:
		return runTarget(ctx, &o, stdout, log)
	case ModeInitiator:
		return runInitiator(ctx, &o, o.segmentID, stdout, log, nil)
	default:
		return runLoopback(ctx, &o, stdout, log)
	}
}

func printUsage(fs *flag.FlagSet, w io.Writer) {
	fmt.Fprint(w, "usage: kvflow bench te --mode target|initiator|loopback [flags]\n\n"+
		"Mooncake's transfer_engine_bench over kvflow's TCP engine (Mooncake TCP transport, P2P handshake):\n"+
		"  target:    kvflow bench te --mode target --local_server_name 10.0.0.2:17000\n"+
		"  initiator: kvflow bench te --mode initiator --segment_id 10.0.0.2:17000 --operation read\n"+
		"  loopback:  kvflow bench te --mode loopback --duration 1\n\nflags:\n")
	fs.SetOutput(w)
	fs.PrintDefaults()
	fs.SetOutput(io.Discard)
}

// newLogger reports the engine's warnings on stderr.
func newLogger(w io.Writer) *slog.Logger {
	tty := false
	if f, ok := w.(*os.File); ok {
		if st, err := f.Stat(); err == nil {
			tty = st.Mode()&os.ModeCharDevice != 0
		}
	}
	return slog.New(tint.NewTextHandler(w, &tint.Options{Level: slog.LevelWarn, TimeFormat: time.TimeOnly, NoColor: !tty})).With("component", "bench/te")
}

// engineConfig is the TCP engine's configuration for --local_server_name:
// an IP literal is bound and advertised; a host name is advertised and all
// interfaces bound; empty means the hostname on all interfaces for a target
// (peers must reach it) and 127.0.0.1 otherwise.
func engineConfig(o *options, target bool) mooncake.TCPConfig {
	c := mooncake.DefaultTCPConfig()
	host, port, _ := splitServerName(o.localServerName) // validated
	switch {
	case host == "" && target:
		c.Host, c.AdvertiseHost = "", ""
	case host == "":
		c.Host = "127.0.0.1"
	case net.ParseIP(host) != nil:
		c.Host = host
	default:
		c.Host, c.AdvertiseHost = "", host
	}
	c.RPCPort, c.Lanes, c.ChunkSize, c.NoEventLoop = port, o.lanes, o.chunkSize, o.noEventLoop
	// The target serves a scratch buffer, not a cache, to initiators that
	// may run --operation write (as Mooncake's transfer_engine_bench).
	c.AcceptWrites = true
	return c
}

// target is a running target: an engine serving one patterned buffer.
type target struct {
	eng  *mooncake.TCPEngine
	mem  []byte
	free func() error
}

// startTarget maps and registers the buffer, filled with the pattern unless
// zero (loopback writes start from zeroed memory, so that verification
// proves they landed).
func startTarget(o *options, cfg mooncake.TCPConfig, zero bool, log *slog.Logger) (*target, error) {
	mem, free, err := allocBuffer(o.bufferSize)
	if err != nil {
		return nil, err
	}
	if !zero {
		fillPatternParallel(mem)
	}
	eng, err := mooncake.NewTCPEngine(cfg, nil, log.With("role", "target"))
	if err != nil {
		free()
		return nil, fmt.Errorf("target engine: %w", err)
	}
	if err := eng.Register(mooncake.AddrOf(mem), uint64(len(mem)), bufferName); err != nil {
		eng.Close()
		free()
		return nil, fmt.Errorf("register target buffer: %w", err)
	}
	return &target{eng, mem, free}, nil
}

func (t *target) close() error {
	return errors.Join(t.eng.Close(), t.free()) // the engine first: it may still touch mem
}

func (t *target) banner(w io.Writer, zero bool) {
	pattern := PatternName
	if zero {
		pattern = "zero"
	}
	fmt.Fprintf(w, "Target started: segment_id %s, buffer_addr %#x, buffer_size %d, data_port %d, pattern %s\n",
		t.eng.SessionID(), mooncake.AddrOf(t.mem), len(t.mem), t.eng.DataPort(), pattern)
}

func runTarget(ctx context.Context, o *options, stdout io.Writer, log *slog.Logger) error {
	t, err := startTarget(o, engineConfig(o, true), o.zeroTarget, log)
	if err != nil {
		return err
	}
	defer t.close()
	t.banner(stdout, false)
	fmt.Fprintln(stdout, "Target serving until interrupted (SIGINT or SIGTERM)")
	<-ctx.Done()
	fmt.Fprintln(stdout, "Target stopped")
	return nil
}

func runLoopback(ctx context.Context, o *options, stdout io.Writer, log *slog.Logger) error {
	cfg := engineConfig(o, false) // loopback: 127.0.0.1 unless told otherwise
	zero := o.operation == "write" && !o.noVerify
	t, err := startTarget(o, cfg, zero, log)
	if err != nil {
		return err
	}
	defer t.close()
	t.banner(stdout, zero)
	o.localServerName = "" // the initiator takes any free port on 127.0.0.1
	return runInitiator(ctx, o, t.eng.SessionID(), stdout, log, t.mem)
}

// runInitiator is transfer_engine_bench's initiator. targetMem, in
// loopback mode, is the target's buffer, checked directly after writes.
func runInitiator(ctx context.Context, o *options, session string, stdout io.Writer, log *slog.Logger, targetMem []byte) error {
	req, _ := o.required() // validated
	cfg := engineConfig(o, false)
	eng, err := mooncake.NewTCPEngine(cfg, nil, log.With("role", "initiator"))
	if err != nil {
		return fmt.Errorf("initiator engine: %w", err)
	}
	mem, free, err := allocBuffer(req)
	if err != nil {
		eng.Close()
		return err
	}
	defer func() { eng.Close(); free() }() // the engine first: it may still touch mem
	if err := eng.Register(mooncake.AddrOf(mem), req, bufferName); err != nil {
		return fmt.Errorf("register local buffer: %w", err)
	}

	bases, where, err := remoteBases(ctx, o, session, eng, cfg.HandshakeTimeout, req)
	if err != nil {
		return err
	}
	write := o.operation == "write"
	if write {
		fillPatternParallel(mem) // offsets equal the target's: the target keeps a valid pattern
	}
	verify := "on"
	if o.noVerify {
		verify = "off"
	}
	fmt.Fprintf(stdout, "Initiator started: segment_id %s, %s, operation %s, block_size %d, batch_size %d, threads %d, duration %ss, verify %s\n",
		session, where, o.operation, o.blockSize, o.batchSize, o.threads, o.duration.String(), verify)

	w := &workers{o: o, eng: eng, session: session, mem: mem, bases: bases}
	start := time.Now()
	runErr := w.run(ctx)
	elapsed := time.Since(start).Seconds()
	batches := w.batches.Load()
	if runErr != nil && ctx.Err() == nil {
		return runErr
	}
	fmt.Fprintf(stdout, "Test completed: duration %.2f, batch count %d, throughput %s\n",
		elapsed, batches, rate(batches*uint64(o.batchSize)*o.blockSize, elapsed, o.reportUnit, o.reportPrecision))
	if ctx.Err() != nil {
		return fmt.Errorf("interrupted: %w", ctx.Err())
	}
	if o.noVerify {
		return nil
	}
	if write {
		if err := w.readBack(ctx); err != nil {
			return err
		}
		if targetMem != nil {
			if i := checkPattern(targetMem[:req], 0); i >= 0 {
				return fmt.Errorf("verify: target memory after the writes: %s", mismatch(targetMem, 0, i))
			}
		}
	}
	fmt.Fprintf(stdout, "Verified %d bytes: ok\n", w.verified.Load())
	return nil
}

// remoteBases is, per thread, the remote address its requests are offset
// from: --remote_addr, or buffer thread%n of the target's segment
// descriptor (transfer_engine_bench's choice), each checked to hold req
// bytes. where describes them for the banner.
func remoteBases(ctx context.Context, o *options, session string, eng *mooncake.TCPEngine, timeout time.Duration, req uint64) (bases []uint64, where string, err error) {
	bases = make([]uint64, o.threads)
	if o.remoteAddr != 0 {
		for i := range bases {
			bases[i] = o.remoteAddr
		}
		return bases, fmt.Sprintf("remote buffer %#x (--remote_addr)", o.remoteAddr), nil
	}
	desc, err := fetchSegment(ctx, session, eng.Segment(), timeout)
	if err != nil {
		return nil, "", fmt.Errorf("segment %s: %w", session, err)
	}
	if !desc.HasProtocol("tcp") {
		return nil, "", fmt.Errorf("segment %s: protocol %q, not tcp", session, desc.Protocol)
	}
	if len(desc.Buffers) == 0 {
		return nil, "", fmt.Errorf("segment %s: no registered buffer", session)
	}
	for i := range bases {
		b := desc.Buffers[i%len(desc.Buffers)]
		if b.Length < req {
			return nil, "", fmt.Errorf("segment %s: buffer %s (%#x) holds %d bytes, the threads need block_size*batch_size*threads = %d; raise the target's --buffer_size", session, b.Name, b.Addr, b.Length, req)
		}
		bases[i] = b.Addr
	}
	b := desc.Buffers[0]
	where = fmt.Sprintf("remote buffer %s %#x+%d", b.Name, b.Addr, b.Length)
	if n := len(desc.Buffers); n > 1 {
		where += fmt.Sprintf(" (+%d more)", n-1)
	}
	return bases, where, nil
}

// fetchSegment asks the target for its segment descriptor as Mooncake's
// P2P handshake does: a Metadata frame with ours, a Metadata frame back.
func fetchSegment(ctx context.Context, session string, ours *mooncake.SegmentDesc, timeout time.Duration) (*mooncake.SegmentDesc, error) {
	host, port, err := splitSession(session)
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(ctx, timeout)
	defer cancel()
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", net.JoinHostPort(host, strconv.Itoa(port)))
	if err != nil {
		return nil, err
	}
	defer c.Close()
	deadline, _ := ctx.Deadline()
	c.SetDeadline(deadline)
	defer context.AfterFunc(ctx, func() { c.SetDeadline(time.Unix(1, 0)) })()
	if _, err := c.Write(mooncake.AppendFrame(nil, mooncake.FrameMetadata, mooncake.EncodeSegment(ours))); err != nil {
		return nil, fmt.Errorf("send metadata: %w", err)
	}
	t, payload, err := mooncake.ReadFrame(c, mooncake.DefaultMaxFrame)
	if err != nil {
		return nil, fmt.Errorf("receive metadata: %w", err)
	}
	if t != mooncake.FrameMetadata {
		return nil, fmt.Errorf("reply of type %s to a metadata request", t)
	}
	return mooncake.DecodeSegment(payload)
}

// workers are the initiator's submission goroutines.
type workers struct {
	o        *options
	eng      *mooncake.TCPEngine
	session  string
	mem      []byte   // local buffer: thread t's request i at offset block_size*(i*threads+t)
	bases    []uint64 // remote base per thread
	batches  atomic.Uint64
	verified atomic.Uint64
}

// ops is thread t's batch: the same addresses every time, as in
// transfer_engine_bench.
func (w *workers) ops(t int) []mooncake.Op {
	ops := make([]mooncake.Op, w.o.batchSize)
	local := mooncake.AddrOf(w.mem)
	for i := range ops {
		off := w.o.blockSize * uint64(i*w.o.threads+t)
		ops[i] = mooncake.Op{Local: local + off, Remote: w.bases[t] + off, Length: w.o.blockSize}
	}
	return ops
}

// block is thread t's request i in the local buffer and its offset.
func (w *workers) block(t, i int) ([]byte, uint64) {
	off := w.o.blockSize * uint64(i*w.o.threads+t)
	return w.mem[off : off+w.o.blockSize], off
}

// run submits batches from every thread until the duration is over (each
// thread runs at least one batch), ctx is done or a batch fails. With
// verification on, a read batch's destination is cleared before and
// checked after every batch.
func (w *workers) run(ctx context.Context) error {
	stop := make(chan struct{})
	timer := time.AfterFunc(time.Duration(w.o.duration), func() { close(stop) })
	defer timer.Stop()
	g, gctx := errgroup.WithContext(ctx)
	read := w.o.operation == "read"
	for t := range w.o.threads {
		g.Go(func() error {
			ops := w.ops(t)
			for n := 0; ; n++ {
				check := read && !w.o.noVerify
				if check {
					for i := range ops {
						b, _ := w.block(t, i)
						clear(b)
					}
				}
				var err error
				if read {
					err = w.eng.BatchRead(gctx, w.session, ops)
				} else {
					err = w.eng.BatchWrite(gctx, w.session, ops)
				}
				if err != nil {
					if gctx.Err() != nil {
						return nil // interrupted, or another thread failed first
					}
					return fmt.Errorf("thread %d batch %d: %w", t, n, err)
				}
				if check {
					if err := w.check(t, n); err != nil {
						return err
					}
				}
				w.batches.Add(1)
				select {
				case <-stop:
					return nil
				case <-gctx.Done():
					return nil
				default:
				}
			}
		})
	}
	return g.Wait()
}

func (w *workers) check(t, n int) error {
	for i := range w.o.batchSize {
		b, off := w.block(t, i)
		if j := checkPattern(b, off); j >= 0 {
			return fmt.Errorf("verify: thread %d batch %d request %d: %s (a target that is not kvflow's holds no pattern: use --no-verify; a --remote_addr off the buffer start shifts it)", t, n, i, mismatch(b, off, j))
		}
	}
	w.verified.Add(uint64(w.o.batchSize) * w.o.blockSize)
	return nil
}

// readBack verifies a write run: it clears the local buffer, reads every
// written range back and checks it.
func (w *workers) readBack(ctx context.Context) error {
	clear(w.mem)
	g, gctx := errgroup.WithContext(ctx)
	for t := range w.o.threads {
		g.Go(func() error {
			if err := w.eng.BatchRead(gctx, w.session, w.ops(t)); err != nil {
				return fmt.Errorf("verify: read back thread %d: %w", t, err)
			}
			return w.check(t, -1)
		})
	}
	return g.Wait()
}

// rate is transfer_engine_bench's calculateRate: bytes per second in unit,
// fixed precision, "<value> <unit>/s".
func rate(bytes uint64, secs float64, unit string, precision int) string {
	if secs <= 0 {
		return "n/a"
	}
	return strconv.FormatFloat(float64(bytes)/secs/rateUnits[unit], 'f', precision, 64) + " " + unit + "/s"
}
