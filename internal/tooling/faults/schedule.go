package faults

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"time"

	"github.com/kvflow/kvflow/stages/job"
)

// Op is an operation faults can be injected into.
type Op uint8

// Operations.
const (
	Read     Op = iota // read.Transfer.BatchRead
	GetMeta            // handshake.Fetcher.GetMeta
	SendDone           // notify.Sender.SendDone
	numOps
)

// Ops lists every Op.
var Ops = []Op{Read, GetMeta, SendDone}

var opNames = [...]string{"read", "get_meta", "send_done"}

func (o Op) String() string {
	if o < numOps {
		return opNames[o]
	}
	return fmt.Sprintf("op(%d)", uint8(o))
}

// Kind is a fault.
type Kind uint8

// Fault kinds. None is "no fault".
const (
	None      Kind = iota
	Fail           // Read, GetMeta: not run, ErrInjected
	Drop           // SendDone: not sent, ErrInjected
	Delay          // any: run after a delay in (0, MaxDelay]
	Truncate       // Read: the first Keep of n ops run, then ErrInjected
	ShortRead      // Read: the first Keep of n ops run, then nil (silent)
	Duplicate      // Read, SendDone: run twice
	Corrupt        // GetMeta: the metadata is altered (Decision.Corruption)
	numKinds
)

// Kinds lists every fault kind (None excluded).
var Kinds = []Kind{Fail, Drop, Delay, Truncate, ShortRead, Duplicate, Corrupt}

var kindNames = [...]string{"none", "fail", "drop", "delay", "truncate", "short_read", "duplicate", "corrupt"}

func (k Kind) String() string {
	if k < numKinds {
		return kindNames[k]
	}
	return fmt.Sprintf("kind(%d)", uint8(k))
}

// applies says which kinds an operation accepts.
var applies = [numOps][numKinds]bool{
	Read:     {Fail: true, Delay: true, Truncate: true, ShortRead: true, Duplicate: true},
	GetMeta:  {Fail: true, Delay: true, Corrupt: true},
	SendDone: {Drop: true, Delay: true, Duplicate: true},
}

// Applies reports whether kind k can be injected into op.
func Applies(op Op, k Kind) bool { return op < numOps && k < numKinds && applies[op][k] }

// Rates are the probabilities of each fault for one call of an operation.
// At most one fault is injected per call, so the rates of an operation sum
// to at most 1. Kinds that do not apply to the operation must be 0.
type Rates struct {
	Fail, Drop, Delay, Truncate, ShortRead, Duplicate, Corrupt float64
}

func (r Rates) of(k Kind) float64 {
	switch k {
	case Fail:
		return r.Fail
	case Drop:
		return r.Drop
	case Delay:
		return r.Delay
	case Truncate:
		return r.Truncate
	case ShortRead:
		return r.ShortRead
	case Duplicate:
		return r.Duplicate
	case Corrupt:
		return r.Corrupt
	}
	return 0
}

// Corruption is how a Corrupt fault alters metadata.
type Corruption uint8

// Corruptions. The first two are caught by the pipeline (the handshake's
// engine-id check; the peer's registered-region check); CorruptBaseNear
// and CorruptNumBlocks are not caught as such (see their comments), so the
// default list leaves them out.
const (
	// CorruptEngineID replaces the engine id: the handshake stage must
	// reject the metadata (handshake.ErrEngineMismatch).
	CorruptEngineID Corruption = iota + 1
	// CorruptBaseFar shifts every base address by 1 TiB, outside anything
	// the peer registered: the read must fail.
	CorruptBaseFar
	// CorruptBaseNear shifts every base address by one block of part 0
	// (Schedule.NearShift bytes), inside the peer's registered memory: the
	// read succeeds with the wrong bytes. Nothing short of a checksum or a
	// byte check catches it.
	CorruptBaseNear
	// CorruptNumBlocks halves num_blocks (at least 1): requests naming
	// blocks past it fail at planning time.
	CorruptNumBlocks
	numCorruptions
)

var corruptionNames = [...]string{"none", "engine_id", "base_far", "base_near", "num_blocks"}

func (c Corruption) String() string {
	if c < numCorruptions {
		return corruptionNames[c]
	}
	return fmt.Sprintf("corruption(%d)", uint8(c))
}

// DefaultCorruptions are the corruptions a Corrupt fault picks from when
// Schedule.Corruptions is empty: the ones the pipeline must detect.
var DefaultCorruptions = []Corruption{CorruptEngineID, CorruptBaseFar}

// farShift moves an address out of any registered region: 1 TiB.
const farShift = 1 << 40

// Apply returns m altered by c (m's slices are not modified). nearShift is
// CorruptBaseNear's shift in bytes.
func (c Corruption) Apply(m job.Meta, nearShift uint64) job.Meta {
	switch c {
	case CorruptEngineID:
		m.EngineID += "-corrupt"
	case CorruptBaseFar, CorruptBaseNear:
		d := uint64(farShift)
		if c == CorruptBaseNear {
			d = nearShift
		}
		base := make([]uint64, len(m.BaseAddrs))
		for i, a := range m.BaseAddrs {
			base[i] = a + d
		}
		m.BaseAddrs = base
	case CorruptNumBlocks:
		m.NumBlocks = max(1, m.NumBlocks/2)
	}
	return m
}

// Schedule is a seeded fault schedule.
type Schedule struct {
	// Seed seeds every decision (PCG). The same seed and the same calls
	// give the same faults.
	Seed uint64
	// Read, Meta and Done are the rates for BatchRead, GetMeta and
	// SendDone calls.
	Read, Meta, Done Rates
	// MaxDelay bounds a Delay fault (uniform in (0, MaxDelay]). 0 means
	// 20 ms: long enough to reorder requests and fill queues, short next
	// to the pipeline's second-scale timeouts.
	MaxDelay time.Duration
	// Corruptions are the corruptions a Corrupt fault picks from, uniformly;
	// empty means DefaultCorruptions.
	Corruptions []Corruption
	// NearShift is CorruptBaseNear's shift in bytes (a block length keeps
	// the address inside the peer's cache). 0 means 4096.
	NearShift uint64
}

// DefaultMaxDelay is MaxDelay's default.
const DefaultMaxDelay = 20 * time.Millisecond

func (s Schedule) rates(op Op) Rates {
	switch op {
	case Read:
		return s.Read
	case GetMeta:
		return s.Meta
	case SendDone:
		return s.Done
	}
	return Rates{}
}

// Validate reports every problem: rates outside [0, 1], rates of an
// operation summing past 1, rates of kinds the operation does not accept,
// a negative delay, unknown corruptions.
func (s Schedule) Validate() error {
	var errs []error
	for _, op := range Ops {
		r := s.rates(op)
		sum := 0.0
		for _, k := range Kinds {
			p := r.of(k)
			switch {
			case p < 0 || p > 1 || p != p:
				errs = append(errs, fmt.Errorf("faults: %s %s rate %v outside [0, 1]", op, k, p))
			case p > 0 && !Applies(op, k):
				errs = append(errs, fmt.Errorf("faults: %s does not accept %s faults (rate %v)", op, k, p))
			}
			sum += p
		}
		if sum > 1+1e-9 {
			errs = append(errs, fmt.Errorf("faults: %s rates sum to %v > 1", op, sum))
		}
	}
	if s.MaxDelay < 0 {
		errs = append(errs, fmt.Errorf("faults: MaxDelay %v < 0", s.MaxDelay))
	}
	for _, c := range s.Corruptions {
		if c == 0 || c >= numCorruptions {
			errs = append(errs, fmt.Errorf("faults: unknown corruption %d", c))
		}
	}
	return errors.Join(errs...)
}

// Decision is what to do with one call.
type Decision struct {
	Kind  Kind
	Delay time.Duration // Delay
	// Keep is the number of ops a Truncate or ShortRead lets run, in
	// [0, n) for a batch of n ops.
	Keep       int
	Corruption Corruption // Corrupt
}

// Decide is the decision for the nth call (from 0) of op with key whose
// batch has n ops (n is used by Read only). It is a pure function of its
// arguments and the schedule.
func (s Schedule) Decide(op Op, key uint64, nth uint64, n int) Decision {
	rng := rand.New(rand.NewPCG(s.Seed, mix(mix(uint64(op)<<56^key)^nth)))
	u := rng.Float64()
	r := s.rates(op)
	kind := None
	for _, k := range Kinds {
		if !Applies(op, k) {
			continue
		}
		p := r.of(k)
		if u < p {
			kind = k
			break
		}
		u -= p
	}
	d := Decision{Kind: kind}
	switch kind {
	case Delay:
		maxd := s.MaxDelay
		if maxd == 0 {
			maxd = DefaultMaxDelay
		}
		d.Delay = time.Duration(1 + rng.Int64N(int64(maxd)))
	case Truncate, ShortRead:
		if n > 0 {
			d.Keep = rng.IntN(n)
		}
	case Corrupt:
		cs := s.Corruptions
		if len(cs) == 0 {
			cs = DefaultCorruptions
		}
		d.Corruption = cs[rng.IntN(len(cs))]
	}
	return d
}

// mix is splitmix64's finaliser.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}

// hashString is FNV-1a.
func hashString(h uint64, s string) uint64 {
	if h == 0 {
		h = 14695981039346656037
	}
	for i := 0; i < len(s); i++ {
		h ^= uint64(s[i])
		h *= 1099511628211
	}
	return h
}
