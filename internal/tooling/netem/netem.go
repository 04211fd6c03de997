package netem

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Namespace name prefixes: kvP-<id> holds prefill, kvD-<id> decode.
const (
	PrefillPrefix = "kvP-"
	DecodePrefix  = "kvD-"
)

// Veth names and addresses in kernel mode. The pair exists only inside
// the two namespaces, so the fixed names and subnet never meet the
// caller's interfaces nor those of another run.
const (
	prefillVeth   = "veth-p"
	decodeVeth    = "veth-d"
	prefillVethIP = "10.199.0.1"
	decodeVethIP  = "10.199.0.2"
	vethPrefixLen = "/30"
	loopbackIP    = "127.0.0.1"
)

// Mode is how the delay is made.
type Mode int

const (
	// ModeAuto uses kernel netem when the kernel accepts the qdisc, else
	// the netfilter queue delay (ModeQueue), else the userspace relay.
	ModeAuto Mode = iota
	// ModeKernel requires kernel netem; Setup fails with
	// ErrNetemUnavailable without it.
	ModeKernel
	// ModeUserspace uses the userspace delay relay even when kernel netem
	// would work.
	ModeUserspace
	// ModeQueue joins the namespaces with the veth pair of ModeKernel and
	// delays the packets arriving on each veth in the kernel's netfilter
	// queue (an iptables NFQUEUE rule queues them, this process accepts
	// each no earlier than its delay): for kernels without sch_netem.
	// Auto mode uses it before the relay when iptables(8) and
	// nfnetlink_queue are there.
	ModeQueue
)

func (m Mode) String() string {
	switch m {
	case ModeAuto:
		return "auto"
	case ModeKernel:
		return "kernel netem"
	case ModeUserspace:
		return "userspace delay relay"
	case ModeQueue:
		return "netfilter queue delay"
	}
	return "Mode(" + strconv.Itoa(int(m)) + ")"
}

var (
	// ErrUnavailable: network namespaces cannot be used here (not root,
	// no ip(8), or `ip netns add` fails). Callers skip with its message.
	ErrUnavailable = errors.New("netem: network namespaces unavailable")
	// ErrNetemUnavailable: the kernel has no sch_netem ("Specified qdisc
	// kind is unknown") and kernel mode was required.
	ErrNetemUnavailable = errors.New("netem: kernel netem qdisc unavailable (no sch_netem)")
	// ErrClosed: the Net was closed.
	ErrClosed = errors.New("netem: closed")
)

// DefaultRelayBuffer is the most bytes the relay holds per direction of
// one connection when Options.RelayBuffer is 0.
const DefaultRelayBuffer = 4 << 20

// Options configure Setup.
type Options struct {
	// Spec is a netem spec, e.g. "delay 1ms" or "delay 1ms 100us".
	Spec string
	// ID names the namespaces kvP-<ID> and kvD-<ID>: 1 to 32 letters,
	// digits, '_' or '-'. Empty means the process id. Namespaces of the
	// same ID left by an earlier run are deleted first.
	ID string
	// Mode forces kernel netem or the userspace relay; the zero value is
	// ModeAuto.
	Mode Mode
	// RelayBuffer bounds the bytes in flight per direction of one relayed
	// connection (reading stops while it is full); 0 means
	// DefaultRelayBuffer. Throughput per connection is at most about
	// RelayBuffer/delay.
	RelayBuffer int
}

// Net is a pair of namespaces joined by an emulated link.
type Net struct {
	id        string
	prefillNS string
	decodeNS  string
	mode      Mode
	why       string
	spec      Spec // zero unless parsed (always in userspace mode)
	specOK    bool
	raw       []string
	relayBuf  int

	mu     sync.Mutex
	closed bool
	relays map[int]*relay
	queues []*queueDelayer // ModeQueue: one per namespace
	made   []string        // namespaces created, for Close
}

var idRE = regexp.MustCompile(`^[A-Za-z0-9_-]{1,32}$`)

func checkID(id string) error {
	if !idRE.MatchString(id) {
		return fmt.Errorf("netem: bad ID %q: want 1 to 32 of [A-Za-z0-9_-]", id)
	}
	return nil
}

func checkName(ns string) error {
	for _, p := range []string{PrefillPrefix, DecodePrefix} {
		if strings.HasPrefix(ns, p) && checkID(ns[len(p):]) == nil {
			return nil
		}
	}
	return fmt.Errorf("netem: %q is not a namespace of this package (%s<id> or %s<id>)", ns, PrefillPrefix, DecodePrefix)
}

// Available reports why network namespaces cannot be used here, or nil:
// it checks for root and ip(8) and creates and deletes a probe
// namespace. Errors wrap ErrUnavailable.
func Available() error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("%w: need root (euid %d)", ErrUnavailable, os.Geteuid())
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	probe := PrefillPrefix + "probe" + strconv.Itoa(os.Getpid())
	if err := ipRun(context.Background(), "netns", "add", probe); err != nil {
		return fmt.Errorf("%w: %v", ErrUnavailable, err)
	}
	if err := ipRun(context.Background(), "netns", "delete", probe); err != nil {
		return fmt.Errorf("netem: delete probe namespace %s: %w", probe, err)
	}
	return nil
}

// Setup creates the namespaces and the emulated link. On error nothing
// it made is left behind.
func Setup(ctx context.Context, o Options) (n *Net, err error) {
	if o.ID == "" {
		o.ID = strconv.Itoa(os.Getpid())
	}
	if err := checkID(o.ID); err != nil {
		return nil, err
	}
	if o.RelayBuffer < 0 {
		return nil, fmt.Errorf("netem: negative RelayBuffer %d", o.RelayBuffer)
	}
	if o.RelayBuffer == 0 {
		o.RelayBuffer = DefaultRelayBuffer
	}
	if o.Mode < ModeAuto || o.Mode > ModeQueue {
		return nil, fmt.Errorf("netem: unknown mode %d", int(o.Mode))
	}
	raw, err := Tokens(o.Spec)
	if err != nil {
		return nil, err
	}
	n = &Net{
		id:        o.ID,
		prefillNS: PrefillPrefix + o.ID,
		decodeNS:  DecodePrefix + o.ID,
		raw:       raw,
		relayBuf:  o.RelayBuffer,
		relays:    map[int]*relay{},
	}
	n.spec, err = ParseSpec(o.Spec)
	n.specOK = err == nil
	if (o.Mode == ModeUserspace || o.Mode == ModeQueue) && !n.specOK {
		return nil, err
	}
	if err := Available(); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			n.Close()
			n = nil
		}
	}()
	if err := Cleanup(o.ID); err != nil {
		return n, err
	}
	for _, ns := range []string{n.prefillNS, n.decodeNS} {
		if err := ipRun(ctx, "netns", "add", ns); err != nil {
			return n, err
		}
		n.mu.Lock()
		n.made = append(n.made, ns)
		n.mu.Unlock()
		if err := ipRun(ctx, "-n", ns, "link", "set", "lo", "up"); err != nil {
			return n, err
		}
	}
	if o.Mode == ModeUserspace {
		n.mode, n.why = ModeUserspace, "userspace delay relay (forced)"
		return n, nil
	}
	var kerr error
	if o.Mode == ModeQueue {
		kerr = n.veth(ctx)
	} else if kerr = n.kernel(ctx); kerr == nil {
		n.mode, n.why = ModeKernel, "kernel netem (tc qdisc netem "+strings.Join(raw, " ")+" on both veth ends)"
		return n, nil
	}
	if o.Mode == ModeKernel || (kerr != nil && !errors.Is(kerr, ErrNetemUnavailable)) {
		return n, kerr
	}
	// No sch_netem: the netfilter queue, else the relay.
	if n.specOK {
		qerr := n.queue(ctx)
		if qerr == nil {
			n.mode, n.why = ModeQueue, "netfilter queue delay on both veth ends (kernel has no sch_netem)"
			if o.Mode == ModeQueue {
				n.why = "netfilter queue delay on both veth ends (forced)"
			}
			return n, nil
		}
		if o.Mode == ModeQueue {
			return n, qerr
		}
		n.why = "; no netfilter queue: " + qerr.Error()
	}
	// Auto, no sch_netem: no link between the namespaces at all, so
	// nothing bypasses the relay.
	if err := ipRun(ctx, "-n", n.prefillNS, "link", "delete", prefillVeth); err != nil {
		return n, err
	}
	if !n.specOK {
		_, perr := ParseSpec(o.Spec)
		return n, fmt.Errorf("netem: the kernel has no sch_netem and %w", perr)
	}
	n.mode, n.why = ModeUserspace, "userspace delay relay (kernel has no sch_netem"+n.why+")"
	return n, nil
}

// queue delays the packets arriving on both veth ends in netfilter queues. On
// error it leaves nothing running (the rules die with the namespaces).
func (n *Net) queue(ctx context.Context) error {
	if _, err := exec.LookPath("iptables"); err != nil {
		return err
	}
	for _, e := range [][2]string{{n.prefillNS, prefillVeth}, {n.decodeNS, decodeVeth}} {
		q, err := startQueueDelayer(e[0], n.spec)
		if err != nil {
			n.stopQueues()
			return err
		}
		n.mu.Lock()
		n.queues = append(n.queues, q)
		n.mu.Unlock()
		if err := ipRun(ctx, append([]string{"netns", "exec", e[0], "iptables"}, queueRule(e[1])...)...); err != nil {
			n.stopQueues()
			return err
		}
	}
	return nil
}

func (n *Net) stopQueues() error {
	n.mu.Lock()
	qs := n.queues
	n.queues = nil
	n.mu.Unlock()
	var errs []error
	for _, q := range qs {
		errs = append(errs, q.stop())
	}
	return errors.Join(errs...)
}

// kernel makes the veth pair inside the namespaces and puts netem on
// both ends.
func (n *Net) kernel(ctx context.Context) error {
	if err := n.veth(ctx); err != nil {
		return err
	}
	for _, e := range [][2]string{{n.prefillNS, prefillVeth}, {n.decodeNS, decodeVeth}} {
		args := append([]string{"-n", e[0], "qdisc", "add", "dev", e[1], "root", "netem"}, n.raw...)
		if err := run(ctx, "tc", args...); err != nil {
			if strings.Contains(err.Error(), "qdisc kind is unknown") {
				return fmt.Errorf("%w: %v", ErrNetemUnavailable, err)
			}
			return err
		}
	}
	return nil
}

// veth makes the veth pair inside the namespaces, addressed and up.
func (n *Net) veth(ctx context.Context) error {
	steps := [][]string{
		{"-n", n.prefillNS, "link", "add", prefillVeth, "type", "veth", "peer", "name", decodeVeth, "netns", n.decodeNS},
		{"-n", n.prefillNS, "addr", "add", prefillVethIP + vethPrefixLen, "dev", prefillVeth},
		{"-n", n.decodeNS, "addr", "add", decodeVethIP + vethPrefixLen, "dev", decodeVeth},
		{"-n", n.prefillNS, "link", "set", prefillVeth, "up"},
		{"-n", n.decodeNS, "link", "set", decodeVeth, "up"},
	}
	for _, s := range steps {
		if err := ipRun(ctx, s...); err != nil {
			return err
		}
	}
	return nil
}

// Mode is the way the delay is made: ModeKernel or ModeUserspace.
func (n *Net) Mode() Mode { return n.mode }

// Describe says how the delay is made, for a report line, e.g.
// "userspace delay relay (kernel has no sch_netem)".
func (n *Net) Describe() string { return n.why }

// Spec is the parsed delay and whether the spec is one ParseSpec
// understands (always in userspace mode; in kernel mode a spec such as
// "delay 1ms loss 1%" is tc's alone).
func (n *Net) Spec() (Spec, bool) { return n.spec, n.specOK }

// ID is the namespaces' ID.
func (n *Net) ID() string { return n.id }

// PrefillNS and DecodeNS are the namespace names.
func (n *Net) PrefillNS() string { return n.prefillNS }
func (n *Net) DecodeNS() string  { return n.decodeNS }

// PrefillAddr is the host prefill workers bind to and advertise: the
// prefill veth address in kernel mode, 127.0.0.1 in userspace mode
// (where Relay makes the same address reach it from decode).
func (n *Net) PrefillAddr() string {
	if n.mode == ModeKernel || n.mode == ModeQueue {
		return prefillVethIP
	}
	return loopbackIP
}

// DecodeAddr is the host decode workers bind to.
func (n *Net) DecodeAddr() string {
	if n.mode == ModeKernel || n.mode == ModeQueue {
		return decodeVethIP
	}
	return loopbackIP
}

// Relay makes each TCP port of prefill's 127.0.0.1 reachable at the same
// 127.0.0.1 port inside the decode namespace, through the delay line. In
// kernel mode it does nothing: decode reaches PrefillAddr over the veth.
// A port already relayed is left as it is. The listen happens at once;
// the prefill side is dialled per accepted connection, so the prefill
// worker may start later.
func (n *Net) Relay(ports ...int) error {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.closed {
		return ErrClosed
	}
	if n.mode == ModeKernel || n.mode == ModeQueue {
		return nil
	}
	for _, p := range ports {
		if p <= 0 || p > 65535 {
			return fmt.Errorf("netem: relay: bad port %d", p)
		}
		if n.relays[p] != nil {
			continue
		}
		addr := net.JoinHostPort(loopbackIP, strconv.Itoa(p))
		ln, err := listenIn(n.decodeNS, "tcp", addr)
		if err != nil {
			return fmt.Errorf("netem: relay listen %s in %s: %w", addr, n.decodeNS, err)
		}
		n.relays[p] = startRelay(ln, n.prefillNS, addr, n.spec, n.relayBuf)
	}
	return nil
}

// Listen is net.Listen inside ns (PrefillNS or DecodeNS).
func (n *Net) Listen(ns, network, addr string) (net.Listener, error) {
	if err := n.own(ns); err != nil {
		return nil, err
	}
	return listenIn(ns, network, addr)
}

// DialContext dials inside ns (PrefillNS or DecodeNS), e.g. a worker's
// metrics endpoint at 127.0.0.1:<port>. Use an IP address: names are
// not resolved inside the namespace.
func (n *Net) DialContext(ctx context.Context, ns, network, addr string) (net.Conn, error) {
	if err := n.own(ns); err != nil {
		return nil, err
	}
	return dialIn(ctx, ns, network, addr)
}

// Command is exec.Command(name, args...) run inside ns through `ip
// netns exec` (which execs name, so the Cmd's process is name itself).
// For a namespace not of this Net, Start returns an error.
func (n *Net) Command(ns, name string, args ...string) *exec.Cmd {
	return n.CommandContext(context.Background(), ns, name, args...)
}

// CommandContext is Command with exec.CommandContext.
func (n *Net) CommandContext(ctx context.Context, ns, name string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "ip", append([]string{"netns", "exec", ns, name}, args...)...)
	if err := n.own(ns); err != nil {
		cmd.Err = err
	}
	return cmd
}

func (n *Net) own(ns string) error {
	n.mu.Lock()
	closed := n.closed
	n.mu.Unlock()
	if closed {
		return ErrClosed
	}
	if ns != n.prefillNS && ns != n.decodeNS {
		return fmt.Errorf("netem: %q is neither %s nor %s", ns, n.prefillNS, n.decodeNS)
	}
	return nil
}

// Close stops the relays (closing their connections and waiting for
// their goroutines) and deletes the namespaces, which removes the veth
// pair. Processes still running inside a namespace keep it alive
// (unnamed) until they exit: stop workers before Close. Close is
// idempotent and safe after a failed Setup.
func (n *Net) Close() error {
	if n == nil {
		return nil
	}
	n.mu.Lock()
	n.closed = true
	relays := n.relays
	n.relays = map[int]*relay{}
	made := n.made
	n.made = nil
	n.mu.Unlock()
	for _, r := range relays {
		r.stop()
	}
	var errs []error
	if err := n.stopQueues(); err != nil {
		errs = append(errs, err)
	}
	for _, ns := range made {
		if err := deleteNS(ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// Cleanup deletes the namespaces kvP-<id> and kvD-<id> if they exist,
// as a crashed run may leave them. With id "" it deletes every
// namespace named with this package's prefixes, including those of
// other runs still going: use it only when none is.
func Cleanup(id string) error {
	if id != "" {
		if err := checkID(id); err != nil {
			return err
		}
	}
	names, err := listNS()
	if err != nil {
		return err
	}
	var errs []error
	for _, ns := range names {
		if checkName(ns) != nil {
			continue
		}
		if id != "" && ns != PrefillPrefix+id && ns != DecodePrefix+id {
			continue
		}
		if err := deleteNS(ns); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

// listNS lists the named network namespaces (the files `ip netns add`
// makes).
func listNS() ([]string, error) {
	ents, err := os.ReadDir(netnsDir)
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("netem: list namespaces: %w", err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return names, nil
}

func deleteNS(ns string) error {
	if _, err := os.Stat(netnsDir + "/" + ns); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	return ipRun(context.Background(), "netns", "delete", ns)
}

func ipRun(ctx context.Context, args ...string) error { return run(ctx, "ip", args...) }

// commandTimeout bounds one ip or tc run.
const commandTimeout = 30 * time.Second

// run execs name with args (never a shell) and returns its stderr in
// the error.
func run(ctx context.Context, name string, args ...string) error {
	ctx, cancel := context.WithTimeout(ctx, commandTimeout)
	defer cancel()
	cmd := exec.CommandContext(ctx, name, args...)
	var out bytes.Buffer
	cmd.Stdout = &out
	cmd.Stderr = &out
	if err := cmd.Run(); err != nil {
		msg := strings.TrimSpace(out.String())
		if msg == "" {
			msg = err.Error()
		}
		return fmt.Errorf("netem: %s %s: %s", name, strings.Join(args, " "), msg)
	}
	return nil
}
