package netem

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Netfilter queue (nfnetlink_queue) protocol numbers, from
// linux/netfilter/nfnetlink.h and nfnetlink_queue.h.
const (
	nfnlSubsysQueue = 3

	nfqnlMsgPacket       = 0
	nfqnlMsgConfig       = 2
	nfqnlMsgVerdictBatch = 3

	nfqaPacketHdr  = 1 // in a packet message
	nfqaVerdictHdr = 2 // in a verdict message

	nfqaCfgCmd      = 1
	nfqaCfgParams   = 2
	nfqaCfgQueueLen = 3
	nfqaCfgMask     = 4
	nfqaCfgFlags    = 5

	nfqnlCfgCmdBind = 1
	nfqnlCopyMeta   = 1
	nfqaCfgFGSO     = 1 << 2 // hand over GSO packets whole

	nfAccept = 1

	// queueNum is the netfilter queue each namespace's output rule uses
	// (queues are per network namespace).
	queueNum = 0
	// queueMaxLen bounds the packets held per namespace: with GSO
	// packets of up to 64 KiB, far more than the delay times the link's
	// rate.
	queueMaxLen = 1 << 16
	// queueRcvBuf is the netlink socket's receive buffer: a packet is
	// dropped by the kernel if its queue message finds it full.
	queueRcvBuf = 32 << 20
)

// queueDelayer holds the packets one namespace receives on its veth for
// the delay: an iptables rule (INPUT, -i the veth, -j NFQUEUE) queues them
// to netfilter queue queueNum, and this process gives each its ACCEPT
// verdict no earlier than delay (plus jitter) after it was queued, in
// order, several at once (a batch verdict accepts every packet up to an
// id). The packets never leave the kernel; only their ids do (copy mode
// meta), so the emulated link costs a message per packet, not the bytes.
type queueDelayer struct {
	f        *os.File // the netlink socket, non-blocking, in the namespace
	rc       syscall.RawConn
	sched    schedule // release times
	ch       chan held
	wg       sync.WaitGroup
	mu       sync.Mutex
	err      error // first failure
	stopping bool  // stop closed the socket: errors after it are expected
}

type held struct {
	id uint32
	at time.Time
}

// startQueueDelayer binds netfilter queue queueNum in namespace ns and
// starts holding its packets for spec's delay. The nftables rule that
// feeds it is the caller's.
func startQueueDelayer(ns string, spec Spec) (*queueDelayer, error) {
	var fd int
	err := inNetns(ns, func() error {
		var err error
		fd, err = unix.Socket(unix.AF_NETLINK, unix.SOCK_RAW|unix.SOCK_NONBLOCK|unix.SOCK_CLOEXEC, unix.NETLINK_NETFILTER)
		return err
	})
	if err != nil {
		return nil, fmt.Errorf("netem: nfqueue socket in %s: %w", ns, err)
	}
	// As root, past rmem_max; otherwise as much as allowed.
	if unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, queueRcvBuf) != nil {
		unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUF, queueRcvBuf)
	}
	// ENOBUFS would report lost messages; their packets are dropped and
	// TCP sends them again, so the error itself is noise.
	unix.SetsockoptInt(fd, unix.SOL_NETLINK, unix.NETLINK_NO_ENOBUFS, 1)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("netem: nfqueue bind in %s: %w", ns, err)
	}
	f := os.NewFile(uintptr(fd), "nfqueue-"+ns)
	rc, err := f.SyscallConn()
	if err != nil {
		f.Close()
		return nil, err
	}
	q := &queueDelayer{f: f, rc: rc, sched: schedule{spec: spec}, ch: make(chan held, queueMaxLen)}
	// Bind the queue, then its parameters, each acknowledged.
	cmd := []byte{nfqnlCfgCmdBind, 0, 0, 0} // command, pad, pf (unused by bind)
	params := make([]byte, 5)               // copy_range (be32), copy_mode
	params[4] = nfqnlCopyMeta
	qlen := binary.BigEndian.AppendUint32(nil, queueMaxLen)
	flags := binary.BigEndian.AppendUint32(nil, nfqaCfgFGSO)
	for i, attrs := range [][]nlattr{
		{{nfqaCfgCmd, cmd}},
		{{nfqaCfgParams, params}, {nfqaCfgQueueLen, qlen}, {nfqaCfgFlags, flags}, {nfqaCfgMask, flags}},
	} {
		if err := q.request(uint32(i+1), nfqnlMsgConfig, attrs); err != nil {
			f.Close()
			return nil, fmt.Errorf("netem: nfqueue %d config in %s: %w", queueNum, ns, err)
		}
	}
	q.wg.Add(2)
	go q.receive()
	go q.release()
	return q, nil
}

// stop closes the socket (the kernel drops what is still held) and waits
// for the goroutines; it returns the first failure they met.
func (q *queueDelayer) stop() error {
	q.mu.Lock()
	q.stopping = true
	q.mu.Unlock()
	q.f.Close()
	q.wg.Wait()
	q.mu.Lock()
	defer q.mu.Unlock()
	return q.err
}

func (q *queueDelayer) fail(err error) {
	q.mu.Lock()
	if q.err == nil && !q.stopping {
		q.err = err
	}
	q.mu.Unlock()
}

type nlattr struct {
	typ  uint16
	data []byte
}

// message is one nfnetlink message to the queue subsystem.
func message(seq uint32, msg uint16, flags uint16, attrs []nlattr) []byte {
	b := make([]byte, unix.NLMSG_HDRLEN+4, 64)
	binary.NativeEndian.PutUint16(b[4:], nfnlSubsysQueue<<8|msg)
	binary.NativeEndian.PutUint16(b[6:], unix.NLM_F_REQUEST|flags)
	binary.NativeEndian.PutUint32(b[8:], seq)
	b[16] = unix.AF_UNSPEC                       // nfgen_family
	b[17] = 0                                    // NFNETLINK_V0
	binary.BigEndian.PutUint16(b[18:], queueNum) // res_id
	for _, a := range attrs {
		n := 4 + len(a.data)
		b = binary.NativeEndian.AppendUint16(b, uint16(n))
		b = binary.NativeEndian.AppendUint16(b, a.typ)
		b = append(b, a.data...)
		for len(b)%4 != 0 {
			b = append(b, 0)
		}
	}
	binary.NativeEndian.PutUint32(b[0:], uint32(len(b)))
	return b
}

// request sends one acknowledged message and waits for its ack (before
// receive runs: nothing else reads the socket).
func (q *queueDelayer) request(seq uint32, msg uint16, attrs []nlattr) error {
	if err := q.write(message(seq, msg, unix.NLM_F_ACK, attrs)); err != nil {
		return err
	}
	buf := make([]byte, 8192)
	q.f.SetReadDeadline(time.Now().Add(5 * time.Second))
	defer q.f.SetReadDeadline(time.Time{})
	for {
		n, err := q.read(buf)
		if errors.Is(err, os.ErrDeadlineExceeded) {
			return errors.New("no ack within 5s")
		}
		if err != nil {
			return err
		}
		for b := buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.NLMSG_HDRLEN || l > len(b) {
				return fmt.Errorf("bad netlink message length %d", l)
			}
			typ := binary.NativeEndian.Uint16(b[4:])
			mseq := binary.NativeEndian.Uint32(b[8:])
			if typ == unix.NLMSG_ERROR && mseq == seq && l >= unix.NLMSG_HDRLEN+4 {
				if e := int32(binary.NativeEndian.Uint32(b[16:])); e != 0 {
					return syscall.Errno(-e)
				}
				return nil
			}
			b = b[min((l+3)&^3, len(b)):]
		}
	}
}

func (q *queueDelayer) write(b []byte) error {
	var werr error
	err := q.rc.Write(func(fd uintptr) bool {
		werr = unix.Sendto(int(fd), b, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK})
		return !errors.Is(werr, syscall.EAGAIN)
	})
	if err != nil {
		return err
	}
	return werr
}

func (q *queueDelayer) read(buf []byte) (int, error) {
	var n int
	var rerr error
	err := q.rc.Read(func(fd uintptr) bool {
		n, _, rerr = unix.Recvfrom(int(fd), buf, 0)
		return !errors.Is(rerr, syscall.EAGAIN)
	})
	if err != nil {
		return 0, err
	}
	if errors.Is(rerr, syscall.ENOBUFS) { // messages lost: their packets were dropped
		return 0, nil
	}
	return n, rerr
}

// receive notes each queued packet's id and release time, in order.
func (q *queueDelayer) receive() {
	defer q.wg.Done()
	defer close(q.ch)
	buf := make([]byte, 1<<20)
	for {
		n, err := q.read(buf)
		if err != nil {
			// The queue is still bound and its rule still queues: close
			// the socket so the kernel stops holding packets for nobody
			// (they are dropped and connections fail, instead of the
			// link going silently dead), and keep the reason for Close.
			q.fail(err)
			q.f.Close()
			return
		}
		now := time.Now()
		for b := buf[:n]; len(b) >= unix.NLMSG_HDRLEN; {
			l := int(binary.NativeEndian.Uint32(b))
			if l < unix.NLMSG_HDRLEN || l > len(b) {
				q.fail(fmt.Errorf("netem: nfqueue: bad message length %d", l))
				return
			}
			typ := binary.NativeEndian.Uint16(b[4:])
			if typ == nfnlSubsysQueue<<8|nfqnlMsgPacket && l >= unix.NLMSG_HDRLEN+4 {
				if id, ok := packetID(b[unix.NLMSG_HDRLEN+4 : l]); ok {
					q.ch <- held{id: id, at: q.sched.release(now)}
				}
			}
			b = b[min((l+3)&^3, len(b)):]
		}
	}
}

// packetID finds NFQA_PACKET_HDR's packet id among a message's attributes.
func packetID(attrs []byte) (uint32, bool) {
	for len(attrs) >= 4 {
		l := int(binary.NativeEndian.Uint16(attrs))
		typ := binary.NativeEndian.Uint16(attrs[2:]) & 0x3fff // drop the nested/byte-order bits
		if l < 4 || l > len(attrs) {
			return 0, false
		}
		if typ == nfqaPacketHdr && l >= 8 {
			return binary.BigEndian.Uint32(attrs[4:]), true
		}
		attrs = attrs[min((l+3)&^3, len(attrs)):]
	}
	return 0, false
}

// release accepts the held packets as their times come: every packet due
// by now in one batch verdict (ids rise in queue order, and release times
// never go backwards, so "up to the last due id" is exactly the due ones).
func (q *queueDelayer) release() {
	defer q.wg.Done()
	timer := time.NewTimer(time.Hour)
	timer.Stop()
	defer timer.Stop()
	var seq uint32 = 100
	for h := range q.ch {
		if wait := time.Until(h.at); wait > 0 {
			timer.Reset(wait)
			<-timer.C
		}
		last := h.id
	more:
		for {
			select {
			case n, ok := <-q.ch:
				if !ok {
					break more
				}
				if time.Until(n.at) > 0 {
					// Not due: verdict what is, then wait for it.
					q.verdict(&seq, last)
					if wait := time.Until(n.at); wait > 0 {
						timer.Reset(wait)
						<-timer.C
					}
				}
				last = n.id
			default:
				break more
			}
		}
		q.verdict(&seq, last)
	}
}

func (q *queueDelayer) verdict(seq *uint32, id uint32) {
	*seq++
	hdr := binary.BigEndian.AppendUint32(nil, nfAccept)
	hdr = binary.BigEndian.AppendUint32(hdr, id)
	if err := q.write(message(*seq, nfqnlMsgVerdictBatch, 0, []nlattr{{nfqaVerdictHdr, hdr}})); err != nil {
		q.fail(fmt.Errorf("netem: nfqueue verdict: %w", err))
	}
}

// queueRule is the iptables(8) arguments that send the packets ns
// receives on dev to the queue (iptables-nft: this kernel has the xtables
// NFQUEUE target, not nft's own queue expression). The rule lives in the
// namespace and goes with it. Packets are held on arrival, not on their
// way out: crossing the veth detached them from the sending socket, so
// holding them does not count against the sender's TCP small-queue limit
// (held at OUTPUT, a flow would be capped near that limit per delay:
// ~0.14 GB/s at 1 ms).
func queueRule(dev string) []string {
	return []string{"-A", "INPUT", "-i", dev, "-j", "NFQUEUE", "--queue-num", "0"}
}
