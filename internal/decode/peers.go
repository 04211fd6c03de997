package decode

import (
	"net"
	"slices"
	"strconv"
	"strings"

	"github.com/kvflow/kvflow/internal/peers"
	"github.com/kvflow/kvflow/pipeline"
	"github.com/kvflow/kvflow/stages/job"
)

// Peer isolation (Options.Peers): the read and notify stages are keyed by
// prefill peer (a keyed pipeline stage, see pipeline.StageConfig.Key): a
// request waits in its peer's queue, at most peers.Config.ReadWorkers
// (NotifyWorkers) of one peer's requests are in the stage at once, and
// workers serve the peers in turn, so a slow or wedged prefill rank holds
// at most its share of the workers and the queue while requests to other
// ranks go on. A request beyond its peer's queue is parked (within
// peers.Config.ReadPark, NotifyPark for all peers together) so that the
// stage before goes on at once: a request to a healthy rank is not held
// behind a wedged rank's backlog, and no request fails for it. Beyond the
// park budget the sender blocks, or, when the peer is stalled (no read or
// DONE ended well for 8x its recent time, within [50 ms, ReadStall]), the
// request fails with peer_stalled. The stages' queue capacities still bound
// the unparked requests of all peers together (a full stage blocks its
// sender, as before).

// keyed sets sc's peer key and limits when sc is the read or notify stage.
func keyed(c peers.Config, sc *pipeline.StageConfig[*job.Job]) {
	half := func(n int) int { return max(1, n/2) }
	// allBut: every worker but a reserve (1 in 16, at least 1) that other
	// peers always find free. A single busy peer (the common case: one
	// prefill rank per decode rank) keeps almost all of the stage; a
	// share of 3/4 or 1/2 cost ~20% of small requests' throughput over a
	// 1 ms link (bench e2e --workload small --netem 'delay 1ms').
	allBut := func(n int) int { return max(1, n-max(1, n/16)) }
	park := func(v, queue int) int {
		if v == 0 {
			return 4 * queue
		}
		return v // -1: none
	}
	pick := func(v, def, limit int) int {
		if v <= 0 {
			v = def
		}
		return min(v, limit)
	}
	switch sc.Name {
	case "read":
		sc.KeyWorkers = pick(c.ReadWorkers, allBut(sc.Workers), sc.Workers)
		sc.KeyQueue = pick(c.ReadQueue, half(sc.Capacity), sc.Capacity)
		sc.KeyPark = park(c.ReadPark, sc.Capacity)
		sc.KeyStall = c.ReadStall.D()
	case "notify":
		sc.KeyWorkers = pick(c.NotifyWorkers, allBut(sc.Workers), sc.Workers)
		sc.KeyQueue = pick(c.NotifyQueue, half(sc.Capacity), sc.Capacity)
		sc.KeyPark = park(c.NotifyPark, sc.Capacity)
		sc.KeyStall = c.NotifyStall.D()
	default:
		return
	}
	sc.Key, sc.MaxKeys = PeerKey, c.MaxPeers
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
