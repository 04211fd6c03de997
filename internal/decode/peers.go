package decode

import (
	"net"
	"slices"
	"strconv"
	"strings"
	"time"

	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
)

// PeerLimits keys the read and notify stages by prefill peer (a keyed
// pipeline stage, see pipeline.StageConfig.Key): a request waits in its
// peer's queue, at most ReadWorkers (NotifyWorkers) of one peer's requests
// are in the stage at once, and workers serve the peers in turn, so a slow
// or wedged prefill rank holds at most its share of the workers and the
// queue while requests to other ranks go on. The stages' queue capacities
// still bound all peers together (a full stage blocks its sender, as
// before). Zero fields take the defaults named on each.
type PeerLimits struct {
	// ReadWorkers: one peer's requests reading at once. 0: three quarters
	// of the read workers, so a quarter is always free for other peers
	// (large batches are further bounded per session by PerSession; small
	// ones are not, and their round trips overlap on all the others).
	ReadWorkers int
	// ReadQueue: one peer's requests waiting for the read stage. 0: half
	// the stage's queue, so one peer never fills it.
	ReadQueue int
	// ReadStall: a peer none of whose reads succeeded for this long while
	// some ran is stalled: its requests beyond ReadQueue fail at once
	// (reason peer_stalled) instead of holding the stage before it. 0:
	// 10 s (a healthy task moves a few GiB at >= 1 GB/s in seconds, and a
	// wedged one waits read.timeout, 30 s). Negative: never.
	ReadStall time.Duration
	// NotifyWorkers, NotifyQueue, NotifyStall: the same for the DONEs.
	// 0: half the notify workers, half its queue, 5 s (a DONE round trip
	// is a millisecond; its retries end within notify's own bound).
	NotifyWorkers int
	NotifyQueue   int
	NotifyStall   time.Duration
	// MaxPeers bounds the distinct peers in each stage; a request naming
	// another fails (reason too_many_peers). 0: 1024.
	MaxPeers int
}

// Defaults of PeerLimits (see its fields).
const (
	DefaultReadStall   = 10 * time.Second
	DefaultNotifyStall = 5 * time.Second
	DefaultMaxPeers    = 1024
)

// keyed sets the peer keys of the read and notify stage configs.
func (l PeerLimits) keyed(read, notify *pipeline.StageConfig[*job.Job]) {
	stall := func(d, def time.Duration) time.Duration {
		switch {
		case d < 0:
			return 0
		case d == 0:
			return def
		}
		return d
	}
	half := func(n int) int { return max(1, n/2) }
	pick := func(v, def, limit int) int {
		if v <= 0 {
			v = def
		}
		return min(v, limit)
	}
	maxPeers := l.MaxPeers
	if maxPeers <= 0 {
		maxPeers = DefaultMaxPeers
	}
	read.Key, notify.Key = PeerKey, PeerKey
	read.KeyWorkers = pick(l.ReadWorkers, max(1, read.Workers-read.Workers/4), read.Workers)
	read.KeyQueue = pick(l.ReadQueue, half(read.Capacity), read.Capacity)
	read.KeyStall = stall(l.ReadStall, DefaultReadStall)
	read.MaxKeys = maxPeers
	notify.KeyWorkers = pick(l.NotifyWorkers, half(notify.Workers), notify.Workers)
	notify.KeyQueue = pick(l.NotifyQueue, half(notify.Capacity), notify.Capacity)
	notify.KeyStall = stall(l.NotifyStall, DefaultNotifyStall)
	notify.MaxKeys = maxPeers
}

// PeerKey is the prefill peer of a request: its remote engine id and the
// side-channel endpoints its tasks use (one for most requests; a request
// pulling several prefill ranks is keyed by all of them, sorted). Before
// planning it is the request's base endpoint.
func PeerKey(j *job.Job) string {
	var b strings.Builder
	b.WriteString(j.Req.RemoteEngineID)
	b.WriteByte('@')
	switch n := len(j.Plan.Tasks); {
	case n == 0:
		b.WriteString(net.JoinHostPort(j.Req.RemoteHost, strconv.Itoa(j.Req.RemotePort)))
	case n == 1:
		b.WriteString(j.HandshakeEndpoint(0))
	default:
		ports := make([]int, 0, n)
		for _, t := range j.Plan.Tasks {
			ports = append(ports, t.HandshakePort)
		}
		slices.Sort(ports)
		ports = slices.Compact(ports)
		b.WriteString(j.Plan.RemoteHost)
		for i, p := range ports {
			if i == 0 {
				b.WriteByte(':')
			} else {
				b.WriteByte(',')
			}
			b.WriteString(strconv.Itoa(p))
		}
	}
	return b.String()
}
