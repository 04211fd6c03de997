package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"strconv"
	"syscall"

	"github.com/kvflow/kvflow/hw/mooncake"
	"github.com/kvflow/kvflow/hw/npu"
	"github.com/kvflow/kvflow/internal/config"
	"github.com/kvflow/kvflow/internal/sidechannel"
	"github.com/kvflow/kvflow/stages/handshake"
	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/notify"
	"github.com/kvflow/kvflow/stages/plan"
)

// The side-channel client is the notify stage's Sender, with batched DONEs.
var _ notify.BatchSender = (*sidechannel.Client)(nil)

// The node's fetcher reaches a peer's port alongside each fetch.
var _ handshake.Reacher = fetcher{}

// fetcher turns GET_META replies into job.Meta; with creds, it also hands
// the transfer engine the data-plane credential each reply carries (or
// clears it when a reply carries none), so the engine authenticates to
// exactly the peers that asked for it.
type fetcher struct {
	c      *sidechannel.Client
	creds  credentialSetter
	owners *credOwners // with creds: the endpoint that first named each session
	sh     *sameHost   // node.te_backend shm: takes each reply's same-host claim
}

// Reach is handshake.Reacher: it connects to endpoint's side-channel port
// and closes the connection before sending a byte (a kvflow prefill's
// front drops it without a word). A refused connection is job.ErrRefused:
// the handshake fails at once instead of after every attempt's timeout.
func (f fetcher) Reach(ctx context.Context, endpoint string) error {
	var d net.Dialer
	c, err := d.DialContext(ctx, "tcp", endpoint)
	if err != nil {
		if errors.Is(err, syscall.ECONNREFUSED) {
			return fmt.Errorf("side channel %s: %w: %w", endpoint, job.ErrRefused, err)
		}
		return err
	}
	return c.Close()
}

// credentialSetter is the TCP engine's side of data-plane authentication.
type credentialSetter interface {
	SetPeerCredential(session string, cred *mooncake.Credential) error
}

func (f fetcher) GetMeta(ctx context.Context, endpoint string) (job.Meta, error) {
	m, err := f.c.GetMeta(ctx, endpoint)
	if err != nil {
		if errors.Is(err, sidechannel.ErrTimeout) {
			err = job.Mark(err, job.ErrNoReply) // the notify stage sends its DONE once
		}
		return job.Meta{}, err
	}
	// A lease shorter than any kvflow prefill may advertise would have this
	// worker renew in a busy loop (every TTL/3) for as long as the peer's
	// requests last: an absurd value from the peer, refused like a bad
	// fingerprint (the request fails naming it; the metadata is not used).
	if l := m.Ext.LeaseTTL; l > 0 && l < config.MinLeaseTTL {
		f.owners.refused("lease_ttl")
		return job.Meta{}, fmt.Errorf("sidechannel get_meta %s: kvflow.lease_ttl_ms is %d, below the %d a kvflow prefill may advertise (tracker.lease_ttl)",
			endpoint, l.Milliseconds(), config.MinLeaseTTL.Milliseconds())
	}
	if f.creds != nil {
		if err := f.setCredential(endpoint, m); err != nil {
			return job.Meta{}, err
		}
	}
	if f.sh != nil {
		f.sh.offer(endpoint, m)
	}
	return job.Meta{EngineID: m.EngineID, TERPCPort: m.TERPCPort, BaseAddrs: m.KVCachesBaseAddr,
		NumBlocks: m.NumBlocks, BootEpoch: m.Ext.BootEpoch, LeaseTTL: m.Ext.LeaseTTL, BatchDone: m.Ext.BatchDone, Cache: m.Ext.Cache}, nil
}

// setCredential records the credential of m's transfer engine, the
// session "host:te_rpc_port" with endpoint's host (job.Session's rule).
// A reply with a token for a client without a CURVE key cannot happen (a
// server sends one only over CURVE); a malformed port is the handshake
// stage's to refuse. A session another side-channel endpoint named first
// keeps its credential, and the reply is refused (the error names both).
func (f fetcher) setCredential(endpoint string, m sidechannel.Metadata) error {
	host, _, err := net.SplitHostPort(endpoint)
	if err != nil {
		return nil
	}
	session := net.JoinHostPort(host, strconv.Itoa(m.TERPCPort))
	if f.owners != nil {
		forget, err := f.owners.claim(endpoint, session, m.Ext.TEAuth != nil)
		if err != nil {
			return err
		}
		for _, s := range forget {
			_ = f.creds.SetPeerCredential(s, nil)
		}
	}
	var cred *mooncake.Credential
	if m.Ext.TEAuth != nil {
		key, err := sidechannel.KeyBytes(f.c.PublicKey())
		if err != nil {
			return nil
		}
		cred = &mooncake.Credential{Token: *m.Ext.TEAuth}
		copy(cred.Key[:], key)
	}
	_ = f.creds.SetPeerCredential(session, cred)
	return nil
}

// PeerBuffers adapts an engine that lists its peers' registered buffers
// (mooncake.SegmentReader) to handshake.SegmentLister; nil for one that
// cannot (its peers without a cache fingerprint go unchecked).
func PeerBuffers(e mooncake.Engine) handshake.SegmentLister {
	sr, ok := e.(mooncake.SegmentReader)
	if !ok {
		return nil
	}
	return handshake.SegmentListerFunc(func(ctx context.Context, session string) ([]handshake.Buffer, error) {
		bufs, err := sr.PeerBuffers(ctx, session)
		if err != nil {
			return nil, err
		}
		out := make([]handshake.Buffer, len(bufs))
		for i, b := range bufs {
			out[i] = handshake.Buffer{Addr: b.Addr, Len: b.Length}
		}
		return out, nil
	})
}

// Fingerprint is a worker's cache fingerprint: its layout's, with the
// instance sizes and the worker's rank as cfg states them.
func Fingerprint(cfg config.Config, layout npu.Layout) npu.Fingerprint {
	f := layout.Fingerprint()
	tp := cfg.Topology()
	f.Prefill = npu.Sizes{TP: tp.Prefill.TP, PP: max(1, tp.Prefill.PP), PCP: max(1, tp.Prefill.PCP), DCP: max(1, tp.Prefill.DCP)}
	f.Decode = npu.Sizes{TP: tp.Decode.TP, PP: max(1, tp.Decode.PP), PCP: max(1, tp.Decode.PCP), DCP: max(1, tp.Decode.DCP)}
	f.Rank = npu.RankPos{TP: cfg.Rank.TP, PP: cfg.Rank.PP, PCP: cfg.Rank.PCP}
	return f
}

// CacheLayout is the planner's view of a device layout.
func CacheLayout(l npu.Layout) plan.CacheLayout {
	lens := l.BlockLens()
	out := plan.CacheLayout{BlockLen: make([]uint64, len(lens)), CachesPerLayer: l.NumParts()}
	for i, n := range lens {
		out.BlockLen[i] = uint64(n)
	}
	return out
}
