package mooncake

import (
	"bytes"
	"context"
	"encoding/binary"
	"io"
	"net"
	"strconv"
	"sync"
	"testing"
	"time"
)

// rawPair is the ceiling: one Go TCP connection on loopback; per batch the
// client sends an 8-byte request and the server streams count blocks of
// size bytes straight from src, read straight into dst.
type rawPair struct {
	ln     net.Listener
	client net.Conn
	done   chan struct{}
}

func newRawPair(tb testing.TB, src []byte, size int) *rawPair {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		tb.Fatal(err)
	}
	p := &rawPair{ln: ln, done: make(chan struct{})}
	go func() {
		defer close(p.done)
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		var req [8]byte
		for {
			if _, err := io.ReadFull(c, req[:]); err != nil {
				return
			}
			n := int(binary.LittleEndian.Uint64(req[:]))
			for i := range n {
				if _, err := c.Write(src[i*size : (i+1)*size]); err != nil {
					return
				}
			}
		}
	}()
	if p.client, err = net.Dial("tcp", ln.Addr().String()); err != nil {
		tb.Fatal(err)
	}
	tb.Cleanup(func() { p.client.Close(); ln.Close(); <-p.done })
	return p
}

func (p *rawPair) batch(tb testing.TB, dst []byte, count, size int) {
	var req [8]byte
	binary.LittleEndian.PutUint64(req[:], uint64(count))
	if _, err := p.client.Write(req[:]); err != nil {
		tb.Fatal(err)
	}
	for i := range count {
		if _, err := io.ReadFull(p.client, dst[i*size:(i+1)*size]); err != nil {
			tb.Fatal(err)
		}
	}
}

// BenchmarkBatchRead measures BatchRead of 128 blocks on loopback against
// the raw copy loop between two endpoints, interleaved batch by batch in
// the same run. The ns/op and MB/s are the engine's; engine_GB/s, raw_GB/s
// and ratio (engine/raw on one connection, target >= 0.9) are reported as
// metrics, with raw4_GB/s and ratio_raw4 for the same loop over Lanes
// connections in parallel.
//
//	go test -run '^$' -bench BatchRead -benchtime 40x ./hw/mooncake/
func BenchmarkBatchRead(b *testing.B) {
	for _, size := range []int{16 << 10, 256 << 10, 1 << 20} {
		b.Run(sizeName(size), func(b *testing.B) {
			const count = 128
			srv, _ := newEngine(b, DefaultTCPConfig())
			cli, _ := newEngine(b, DefaultTCPConfig())
			src := register(b, srv, count*size, 1)
			dst := register(b, cli, count*size, 2)
			ops := make([]Op, count)
			for i := range ops {
				// Reversed remote order: blocks are not one contiguous stream.
				ops[i] = Op{Local: AddrOf(dst[i*size:]), Remote: AddrOf(src[(count-1-i)*size:]), Length: uint64(size)}
			}
			raw := newRawPair(b, src, size)
			// The same copy loop over as many connections as the engine has
			// lanes: the ceiling for a multi-connection transport.
			lanes := DefaultTCPConfig().Lanes
			var raws []*rawPair
			for range lanes {
				raws = append(raws, newRawPair(b, src, size))
			}
			rawN := func() {
				var wg sync.WaitGroup
				per := count / lanes
				for k, r := range raws {
					wg.Go(func() { r.batch(b, dst[k*per*size:], per, size) })
				}
				wg.Wait()
			}
			ctx := context.Background()

			// Warm up (connections, page faults) and verify once.
			if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
				b.Fatal(err)
			}
			for i := range count {
				if !bytes.Equal(dst[i*size:(i+1)*size], src[(count-1-i)*size:(count-i)*size]) {
					b.Fatalf("block %d differs", i)
				}
			}
			raw.batch(b, dst, count, size)

			b.SetBytes(int64(count * size))
			var engine, rawT, rawNT time.Duration
			n := 0
			for b.Loop() {
				t0 := time.Now()
				if err := cli.BatchRead(ctx, srv.SessionID(), ops); err != nil {
					b.Fatal(err)
				}
				engine += time.Since(t0)
				b.StopTimer()
				t0 = time.Now()
				raw.batch(b, dst, count, size)
				rawT += time.Since(t0)
				t0 = time.Now()
				rawN()
				rawNT += time.Since(t0)
				n++
				b.StartTimer()
			}
			total := float64(n * count * size)
			eg, rg := total/engine.Seconds()/1e9, total/rawT.Seconds()/1e9
			b.ReportMetric(eg, "engine_GB/s")
			b.ReportMetric(rg, "raw_GB/s")
			rn := total / rawNT.Seconds() / 1e9
			b.ReportMetric(eg/rg, "ratio")
			b.ReportMetric(rn, "raw4_GB/s")
			b.ReportMetric(eg/rn, "ratio_raw4")
		})
	}
}

func sizeName(n int) string {
	if n >= 1<<20 {
		return "128x" + strconv.Itoa(n>>20) + "MiB"
	}
	return "128x" + strconv.Itoa(n>>10) + "KiB"
}
