package bench

import (
	"context"
	"testing"
	"time"

	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/internal/sidechannel/wire"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
)

// llamaMeta is a prefill rank's metadata for a 32-layer GQA cache (64
// tensors): what GET_META returns.
func llamaMeta() sidechannel.Metadata {
	addrs := make([]uint64, 64)
	for i := range addrs {
		addrs[i] = 0x7f00_0000_0000 + uint64(i)<<28
	}
	return sidechannel.Metadata{EngineID: "P", TERPCPort: 15000, KVCachesBaseAddr: addrs, NumBlocks: 4096,
		Ext: sidechannel.Ext{BootEpoch: uint64(time.Now().UnixNano())}}
}

// sideChannel is a real side-channel server (ROUTER) and client (pooled
// REQ) on loopback.
func sideChannel(b *testing.B, md sidechannel.Metadata) (*sidechannel.Client, string) {
	zctx, err := sidechannel.NewContext(sidechannel.ContextOptions{})
	if err != nil {
		b.Fatal(err)
	}
	srv, err := sidechannel.NewServer(zctx, sidechannel.ServerOptions{Addr: "127.0.0.1:0"}, sidechannel.HandlerFuncs{
		MetadataFunc: func() sidechannel.Metadata { return md },
		DoneFunc:     func(string) error { return nil },
	})
	if err != nil {
		b.Fatal(err)
	}
	c, err := sidechannel.NewClient(zctx, sidechannel.ClientOptions{})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		c.Close()
		srv.Close()
		zctx.Close()
	})
	return c, srv.Addr()
}

type metaFetcher struct{ c *sidechannel.Client }

func (f metaFetcher) GetMeta(ctx context.Context, ep string) (job.Meta, error) {
	m, err := f.c.GetMeta(ctx, ep)
	return job.Meta{EngineID: m.EngineID, TERPCPort: m.TERPCPort, BaseAddrs: m.KVCachesBaseAddr, NumBlocks: m.NumBlocks, BootEpoch: m.Ext.BootEpoch}, err
}

// BenchmarkHandshake is the handshake stage's cache (stages/handshake) over
// the real side channel: "hit" is a cached lookup, "miss" invalidates first
// so every Get is a GET_META round trip over ZMQ (ROUTER server, pooled REQ
// client, msgpack metadata of 64 tensors). Each is timed against a bare
// zmq4 REQ/REP round trip of the same request and reply bytes, interleaved
// in the same iterations: bare_ns/op, and ratio = kvflow / bare (for hit,
// how much cheaper a cached handshake is than any network round trip).
//
//	go test -run '^$' -bench Handshake -benchtime 2000x ./bench/
func BenchmarkHandshake(b *testing.B) {
	md := llamaMeta()
	reqBytes, replyBytes := wire.EncodeGetMeta(), wire.EncodeMetadata(md)
	for _, miss := range []bool{false, true} {
		name := "hit"
		if miss {
			name = "miss"
		}
		b.Run(name, func(b *testing.B) {
			c, addr := sideChannel(b, md)
			bare := newBareREQREP(b, replyBytes)
			cache, err := handshake.NewCache(metaFetcher{c}, handshake.Options{})
			if err != nil {
				b.Fatal(err)
			}
			k := handshake.Key{EngineID: "P", Endpoint: addr}
			ctx := context.Background()
			if _, err := cache.Get(ctx, k); err != nil {
				b.Fatal(err)
			}
			bare.roundTrip(b, reqBytes)
			var kv, base time.Duration
			for b.Loop() {
				t0 := time.Now()
				if miss {
					cache.Invalidate(k)
				}
				if _, err := cache.Get(ctx, k); err != nil {
					b.Fatal(err)
				}
				kv += time.Since(t0)
				t0 = time.Now()
				bare.roundTrip(b, reqBytes)
				base += time.Since(t0)
			}
			n := float64(b.N)
			b.ReportMetric(float64(kv.Nanoseconds())/n, "kvflow_ns/op")
			b.ReportMetric(float64(base.Nanoseconds())/n, "bare_ns/op")
			b.ReportMetric(float64(kv)/float64(base), "ratio")
		})
	}
}

// BenchmarkNotify is DONE_RECVING/ACK round trips (the notify stage's
// Sender, sidechannel.Client.SendDone) against a bare zmq4 REQ/REP round
// trip of the same bytes, interleaved; "serial" is one DONE at a time,
// "parallel8" eight goroutines sharing the client (a request's tasks and
// several requests' DONEs in flight together; the bare baseline stays
// serial, so its ratio shows what concurrency buys over the seed's one at
// a time).
//
//	go test -run '^$' -bench Notify -benchtime 2000x ./bench/
func BenchmarkNotify(b *testing.B) {
	const reqID = "cmpl-5d73b0af444ad0bf081de695914b7c9e-0"
	reqBytes := wire.EncodeDoneRecving(reqID)
	b.Run("serial", func(b *testing.B) {
		c, addr := sideChannel(b, llamaMeta())
		bare := newBareREQREP(b, []byte(wire.AckReply))
		ctx := context.Background()
		var kv, base time.Duration
		for b.Loop() {
			t0 := time.Now()
			if err := c.SendDone(ctx, addr, reqID); err != nil {
				b.Fatal(err)
			}
			kv += time.Since(t0)
			t0 = time.Now()
			bare.roundTrip(b, reqBytes)
			base += time.Since(t0)
		}
		n := float64(b.N)
		b.ReportMetric(float64(kv.Nanoseconds())/n, "kvflow_ns/op")
		b.ReportMetric(float64(base.Nanoseconds())/n, "bare_ns/op")
		b.ReportMetric(float64(kv)/float64(base), "ratio")
	})
	b.Run("parallel8", func(b *testing.B) {
		c, addr := sideChannel(b, llamaMeta())
		bare := newBareREQREP(b, []byte(wire.AckReply))
		ctx := context.Background()
		// Baseline first, same count, serial.
		t0 := time.Now()
		for range b.N {
			bare.roundTrip(b, reqBytes)
		}
		base := time.Since(t0)
		b.ResetTimer()
		b.SetParallelism(4) // 4 × GOMAXPROCS(2) = 8 goroutines here
		b.RunParallel(func(pb *testing.PB) {
			for pb.Next() {
				if err := c.SendDone(ctx, addr, reqID); err != nil {
					b.Error(err)
					return
				}
			}
		})
		kv := b.Elapsed()
		n := float64(b.N)
		b.ReportMetric(float64(kv.Nanoseconds())/n, "kvflow_ns/op")
		b.ReportMetric(float64(base.Nanoseconds())/n, "bare_ns/op")
		b.ReportMetric(float64(kv)/float64(base), "ratio")
	})
}
