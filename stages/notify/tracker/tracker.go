package tracker

import (
	"cmp"
	"container/list"
	"errors"
	"fmt"
	"slices"
	"sync"
	"time"
)

// DefaultAbortTimeout is vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
// (480 s), the seed's force-free delay.
const DefaultAbortTimeout = 480 * time.Second

// DefaultMaxRecords bounds the remembered early-DONE records and
// finished-request tombstones (by count; they do not age). 480 s at 100
// requests/s per prefill worker is 48 000 requests: 65 536 remembers every
// request finished within a full abort timeout at that rate (about 150
// bytes each with the index, so ~10 MiB), and evicts the oldest beyond it.
const DefaultMaxRecords = 1 << 16

// DefaultMaxEarly bounds the early DONEs kept under Options.HoldEarly. A
// legitimate early DONE waits for its request's send, which reaches the
// worker with the engine's next step (milliseconds; the decode had to read
// the blocks first): even 1000 requests/s with one-second steps keep ~1000.
// 4096 leaves four times that (about 600 KiB), while a flood of DONEs for
// ids no engine ever sent cannot grow the tracker further.
const DefaultMaxEarly = 1 << 12

// DefaultEarlyTTL is how long an early DONE is kept under
// Options.HoldEarly waiting for its send: far longer than any engine step
// between a request's end and its send, far shorter than the abort
// timeout that frees a request whose early DONE was dropped.
const DefaultEarlyTTL = 30 * time.Second

// ErrAlreadyFinished is returned by Done for a request the tracker has
// already freed (DONE after DONE, after a force-free, an abort or a
// not-transfer). Nothing is freed and nothing is reported.
var ErrAlreadyFinished = errors.New("tracker: request already finished")

// Options configure a Tracker. The zero value is usable.
type Options struct {
	// AbortTimeout is how long a delayed request may wait for its DONEs
	// before it is force-freed (strictly: now - start > AbortTimeout; see
	// LeaseTTL for renewed requests). 0 selects DefaultAbortTimeout; a
	// negative value selects a timeout of zero (vLLM's
	// VLLM_NIXL_ABORT_REQUEST_TIMEOUT=0).
	AbortTimeout time.Duration
	// LeaseTTL is how long one Renew keeps a held request from being
	// force-freed: a renewed request expires when now > lastRenew +
	// LeaseTTL, whatever its AbortTimeout (which applies to requests never
	// renewed). 0 (the default) turns leases off: Renew does nothing.
	// Negative values select 0.
	LeaseTTL time.Duration
	// MaxRecords bounds the remembered early-DONE records and finished
	// tombstones, by count (oldest evicted first; nothing ages by time).
	// 0 selects DefaultMaxRecords.
	MaxRecords int
	// EarlyDoneQuorum is how many DONEs a request the tracker does not yet
	// hold needs before it is reported freed. 0 selects 1, the seed's rule
	// (a DONE before the delayed-free record frees at once). A deployment
	// where every request expects N DONEs (§5b.5) sets N so that early
	// DONEs cannot free a request before all of them arrived.
	EarlyDoneQuorum int
	// EarlyQuorum, when set, gives the quorum per request instead (values
	// below 1 read as 1): a prefill worker that knows its topology passes
	// the most DONEs request id can expect, so an early DONE frees a
	// request only once every decode rank that reads it has sent its own,
	// whatever the request's size. Called with the tracker's lock held: it
	// must not call the Tracker.
	EarlyQuorum func(id string) int
	// HoldEarly keeps early DONEs (DONEs for a request not held yet) until
	// the request's AddDelayed or AddNotTransfer consumes them, instead of
	// reporting them by themselves (the seed's rule): Finished then only
	// ever reports requests the engine handed over, however many DONEs
	// name ids it never sent, and an early DONE counts toward the DONEs
	// AddDelayed expects (EarlyDoneQuorum and EarlyQuorum are unused).
	// Early DONEs are then bounded by MaxEarly (oldest dropped first) and
	// EarlyTTL (dropped older than that), counted in Stats.EarlyEvicted
	// and Stats.EarlyExpired; a request whose early DONE was dropped waits
	// for its abort timeout (or lease end) as if its DONE never came.
	HoldEarly bool
	// MaxEarly bounds the early DONEs kept under HoldEarly; 0 selects
	// DefaultMaxEarly.
	MaxEarly int
	// EarlyTTL is how long an early DONE is kept under HoldEarly; 0 selects
	// DefaultEarlyTTL.
	EarlyTTL time.Duration
}

// Validate reports every invalid field (errors.Join).
func (o Options) Validate() error {
	var errs []error
	if o.MaxRecords < 0 {
		errs = append(errs, fmt.Errorf("tracker: MaxRecords %d < 0", o.MaxRecords))
	}
	if o.EarlyDoneQuorum < 0 {
		errs = append(errs, fmt.Errorf("tracker: EarlyDoneQuorum %d < 0", o.EarlyDoneQuorum))
	}
	if o.LeaseTTL < 0 {
		errs = append(errs, fmt.Errorf("tracker: LeaseTTL %v < 0", o.LeaseTTL))
	}
	if o.MaxEarly < 0 {
		errs = append(errs, fmt.Errorf("tracker: MaxEarly %d < 0", o.MaxEarly))
	}
	if o.EarlyTTL < 0 {
		errs = append(errs, fmt.Errorf("tracker: EarlyTTL %v < 0", o.EarlyTTL))
	}
	return errors.Join(errs...)
}

func (o Options) normalized() Options {
	switch {
	case o.AbortTimeout == 0:
		o.AbortTimeout = DefaultAbortTimeout
	case o.AbortTimeout < 0:
		o.AbortTimeout = 0
	}
	if o.MaxRecords <= 0 {
		o.MaxRecords = DefaultMaxRecords
	}
	if o.LeaseTTL < 0 {
		o.LeaseTTL = 0
	}
	if o.EarlyDoneQuorum <= 0 {
		o.EarlyDoneQuorum = 1
	}
	if o.MaxEarly <= 0 {
		o.MaxEarly = DefaultMaxEarly
	}
	if o.EarlyTTL <= 0 {
		o.EarlyTTL = DefaultEarlyTTL
	}
	return o
}

// Reason says why a request was freed.
type Reason uint8

const (
	// ReasonDone: all expected DONEs arrived (or the early-DONE quorum).
	ReasonDone Reason = iota + 1
	// ReasonNotTransfer: this rank never waited for a DONE.
	ReasonNotTransfer
	// ReasonExpired: force-freed without its DONEs: after AbortTimeout,
	// or, if renewed, LeaseTTL after its last Renew (Freed.Lease).
	ReasonExpired
	// ReasonAborted: freed by Abort.
	ReasonAborted
)

var reasonNames = [...]string{"unknown", "done", "not_transfer", "expired", "aborted"}

// String returns the metric label value: done, not_transfer, expired,
// aborted.
func (r Reason) String() string {
	if int(r) < len(reasonNames) {
		return reasonNames[r]
	}
	return "unknown"
}

// Reasons lists every Reason, for initialising metric labels to zero.
var Reasons = []Reason{ReasonDone, ReasonNotTransfer, ReasonExpired, ReasonAborted}

// Freed is one request reported by Finished.
type Freed struct {
	ID     string
	Reason Reason
	// Lease: a ReasonExpired request that was renewed, force-freed at its
	// lease end (its decode stopped renewing), not at the abort timeout.
	Lease bool
}

// DoneStatus says what a DONE did.
type DoneStatus uint8

const (
	// DoneFreed: the last expected DONE of a held request; it is freed and
	// reported by the next Finished.
	DoneFreed DoneStatus = iota + 1
	// DoneWaiting: counted; DoneResult.Remaining more are expected.
	DoneWaiting
	// DoneEarly: the tracker does not hold the request (yet): the DONE is
	// kept as an early DONE. DoneResult.Reported says whether the request
	// reached the early quorum and is (or was) reported freed.
	DoneEarly
	// DoneDuplicate: the request is already finished; nothing changed
	// (returned with ErrAlreadyFinished).
	DoneDuplicate
)

var doneNames = [...]string{"unknown", "freed", "waiting", "early", "duplicate"}

func (s DoneStatus) String() string {
	if int(s) < len(doneNames) {
		return doneNames[s]
	}
	return "unknown"
}

// DoneResult is what Done did.
type DoneResult struct {
	Status DoneStatus
	// Remaining DONEs still expected (DoneWaiting only).
	Remaining int
	// Gen is the hold's generation (DoneFreed, DoneWaiting).
	Gen uint64
	// Early is the number of early DONEs recorded (DoneEarly only).
	Early int
	// Reported: the early DONEs reached the quorum, so the request is
	// reported freed (DoneEarly only).
	Reported bool
}

// Stats are the tracker's counters and sizes, for metrics.
type Stats struct {
	Held    int // requests awaiting DONE (Leased included)
	Leased  int // held requests renewed at least once
	Pending int // freed, not yet reported by Finished
	Records int // remembered early-DONE records and finished tombstones
	Early   int // early DONE records kept under HoldEarly (not in Records)

	Delayed        uint64 // AddDelayed calls that started a hold
	Refreshed      uint64 // AddDelayed on a held request (start refreshed, as the seed)
	Absorbed       uint64 // AddDelayed satisfied or shortened by early DONEs
	EarlyShort     uint64 // AddDelayed expecting more DONEs than the early ones that already freed it
	DupAdds        uint64 // AddDelayed / AddNotTransfer on a finished request, ignored (§5b.9)
	Dones          uint64 // DONEs counted toward a held request
	EarlyDones     uint64 // DONEs recorded before the delayed-free record
	DupDones       uint64 // DONEs for finished requests (ErrAlreadyFinished)
	Renewals       uint64 // Renew calls that extended a held request's lease
	LeaseExpired   uint64 // renewed requests force-freed at their lease end (of Freed[ReasonExpired])
	RenewMisses    uint64 // Renew calls for a request not held (or leases off)
	RecordsEvicted uint64 // records evicted by MaxRecords
	EarlyEvicted   uint64 // HoldEarly: early DONE records dropped by MaxEarly
	EarlyExpired   uint64 // HoldEarly: early DONE records dropped by EarlyTTL

	// Freed counts reported requests by reason (index by Reason).
	Freed [ReasonAborted + 1]uint64
}

// Forced is the number of force-freed (expired) requests.
func (s Stats) Forced() uint64 { return s.Freed[ReasonExpired] }

type state uint8

const (
	stHeld  state = iota + 1 // awaiting DONEs; in t.held
	stEarly                  // early DONEs, no delayed record yet; in t.mem
	stGone                   // freed; in t.mem once reported
)

type entry struct {
	id    string
	st    state
	start time.Time // stHeld: delay start
	lease time.Time // stHeld, in t.leased: lease end (last renew + LeaseTTL)
	stamp time.Time // in t.mem: when remembered
	gen   uint64
	// blocks of a held request (never mutated after being stored).
	blocks   []int
	expected int // stHeld: DONEs expected in total
	received int // DONEs received (early ones included)
	reported bool
	el       *list.Element // in t.held or t.leased (stHeld), t.earlyQ or t.mem; nil when pending only
	inEarly  bool          // stEarly: el is in t.earlyQ (HoldEarly)
	leased   bool          // stHeld: el is in t.leased
}

// Tracker is the prefill side's record of which requests wait for DONE.
// All methods are safe for concurrent use.
type Tracker struct {
	mu   sync.Mutex
	opts Options
	gen  uint64

	byID map[string]*entry
	held *list.List // *entry, stHeld never renewed, in insertion order (the seed's OrderedDict)
	// leased holds the renewed stHeld entries, in order of their last
	// renewal, so in non-decreasing order of lease end.
	leased *list.List
	mem    *list.List // *entry, stEarly and reported stGone, oldest first
	// early holds HoldEarly's stEarly entries, oldest first.
	earlyQ *list.List

	// pending is the seed's finished_requests: freed, not yet reported.
	pending    []Freed
	pendingSet map[string]struct{}
	lastStamp  time.Time
	lastRenew  time.Time

	st Stats
}

// New returns an empty Tracker. Zero fields of opts select their defaults;
// negative MaxRecords or EarlyDoneQuorum also select the default (see
// Options.Validate to reject them instead).
func New(opts Options) *Tracker {
	return &Tracker{
		opts:       opts.normalized(),
		byID:       make(map[string]*entry),
		held:       list.New(),
		leased:     list.New(),
		mem:        list.New(),
		earlyQ:     list.New(),
		pendingSet: make(map[string]struct{}),
	}
}

// Options returns the effective options (defaults applied).
func (t *Tracker) Options() Options { return t.opts }

// AddNotTransfer records that this rank does not wait for a DONE for id
// (the seed's add_not_transfer_request): id is reported by the next
// Finished. If id is held it is freed at once (its read grant ends); if it
// is already finished the call is ignored.
func (t *Tracker) AddNotTransfer(id string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	switch {
	case e == nil:
		e = &entry{id: id, st: stGone}
		t.byID[id] = e
		t.free(e, ReasonNotTransfer)
	case e.st == stHeld:
		t.unhold(e)
		t.free(e, ReasonNotTransfer)
	case e.st == stEarly && !e.reported:
		t.unlinkEarly(e)
		e.st = stGone
		t.free(e, ReasonNotTransfer)
	default:
		t.st.DupAdds++
	}
}

// AddDelayed records that id waits for expectedDones DONEs (values < 1 mean
// 1) before its blocks may be freed, counting its abort timeout from start
// (the seed's add_delayed_request). blockIDs are the blocks a read grant may
// serve; they are copied.
//
// It returns the hold's generation, never 0, when id is held afterwards,
// and 0 when it is not: early DONEs already satisfied it, or it is already
// finished (§5b.9: never re-armed). A second AddDelayed for a held request
// refreshes its start in place (the seed's OrderedDict assignment), keeps
// its generation and position, replaces blockIDs when non-nil and raises
// the expected count if larger.
func (t *Tracker) AddDelayed(id string, start time.Time, expectedDones int, blockIDs []int) uint64 {
	if expectedDones < 1 {
		expectedDones = 1
	}
	var blocks []int
	if blockIDs != nil {
		blocks = append(make([]int, 0, len(blockIDs)), blockIDs...)
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	switch {
	case e == nil:
		e = &entry{id: id}
		t.byID[id] = e
		t.arm(e, start, expectedDones, blocks)
		return e.gen
	case e.st == stHeld:
		t.st.Refreshed++
		e.start = start
		if blocks != nil {
			e.blocks = blocks
		}
		if expectedDones > e.expected {
			e.expected = expectedDones
		}
		return e.gen
	case e.st == stEarly:
		t.st.Absorbed++
		if e.reported {
			// The seed's record_finished_requests.discard: already
			// reported freed; it stays remembered (same stamp, same
			// place) as finished, so a further AddDelayed is ignored.
			if expectedDones > e.received {
				t.st.EarlyShort++
			}
			e.st = stGone
			return 0
		}
		t.unlinkEarly(e)
		if e.received >= expectedDones {
			e.st = stGone
			t.free(e, ReasonDone)
			return 0
		}
		t.arm(e, start, expectedDones, blocks)
		return e.gen
	default: // stGone
		t.st.DupAdds++
		return 0
	}
}

// Done records one DONE for id at now (the seed's update_done_task_count).
//
// A held request counts it, and is freed by its last expected DONE. A
// request the tracker does not hold is kept as an early DONE and, as in the
// seed, reported freed once Options.EarlyDoneQuorum early DONEs arrived (1
// by default); a later AddDelayed then finds it satisfied. A DONE for a
// finished request changes nothing and returns ErrAlreadyFinished.
func (t *Tracker) Done(id string, now time.Time) (DoneResult, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	switch {
	case e == nil:
		e = &entry{id: id, st: stEarly}
		t.byID[id] = e
		t.st.EarlyDones++
		if t.opts.HoldEarly {
			t.holdEarly(e, now)
			return DoneResult{Status: DoneEarly, Early: e.received}, nil
		}
		t.early(e, now)
		return DoneResult{Status: DoneEarly, Early: e.received, Reported: e.reported}, nil
	case e.st == stHeld:
		t.st.Dones++
		e.received++
		if e.received < e.expected {
			return DoneResult{Status: DoneWaiting, Remaining: e.expected - e.received, Gen: e.gen}, nil
		}
		t.unhold(e)
		t.free(e, ReasonDone)
		return DoneResult{Status: DoneFreed, Gen: e.gen}, nil
	case e.st == stEarly:
		t.st.EarlyDones++
		e.received++
		if !t.opts.HoldEarly && !e.reported && e.received >= t.quorum(e.id) {
			e.reported = true
			t.queue(e.id, ReasonDone)
		}
		return DoneResult{Status: DoneEarly, Early: e.received, Reported: e.reported}, nil
	default:
		t.st.DupDones++
		return DoneResult{Status: DoneDuplicate}, fmt.Errorf("done %q: %w", id, ErrAlreadyFinished)
	}
}

// Abort frees a held request at once (reason aborted) and reports whether
// it was held.
func (t *Tracker) Abort(id string) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	if e == nil || e.st != stHeld {
		return false
	}
	t.unhold(e)
	t.free(e, ReasonAborted)
	return true
}

// Renew extends the lease of a held request at now: from then on it is
// force-freed when now + LeaseTTL has passed without another Renew (or a
// DONE, abort or not-transfer), and its abort timeout no longer applies
// (so a first Renew may bring the hold's end forward: its decode is known,
// and a dead one's blocks come back one TTL after its last word). It
// reports whether id is held; a Renew of a request that is not held (not
// yet AddDelayed, already finished, unknown) or with leases off changes
// nothing and records nothing. The lease end only moves forward (a now
// earlier than a previous Renew's counts as that one).
func (t *Tracker) Renew(id string, now time.Time) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	if e == nil || e.st != stHeld || t.opts.LeaseTTL <= 0 {
		t.st.RenewMisses++
		return false
	}
	if now.Before(t.lastRenew) {
		now = t.lastRenew
	}
	t.lastRenew = now
	t.st.Renewals++
	if until := now.Add(t.opts.LeaseTTL); until.After(e.lease) {
		e.lease = until
	}
	if e.leased {
		t.leased.MoveToBack(e.el)
	} else {
		t.held.Remove(e.el)
		e.el = t.leased.PushBack(e)
		e.leased = true
	}
	return true
}

// Finished returns and clears the requests freed since the last call, then
// force-frees the held requests whose abort timeout passed at now (strictly
// now - start > AbortTimeout), scanning from the oldest insertion and
// stopping at the first unexpired one, exactly as the seed's
// get_and_clear_finished_requests. Renewed requests are not in that scan:
// they are force-freed when now is past their lease end (Freed.Lease),
// whatever their position and start. Each request appears once, in
// the order it was freed (expired ones last: never-renewed first). Finally
// it evicts records beyond MaxRecords.
func (t *Tracker) Finished(now time.Time) []Freed {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := t.pending
	t.pending = nil
	clear(t.pendingSet)
	for el := t.held.Front(); el != nil; {
		e := el.Value.(*entry)
		if now.Sub(e.start) <= t.opts.AbortTimeout {
			break
		}
		next := el.Next()
		t.unhold(e)
		out = append(out, Freed{ID: e.id, Reason: ReasonExpired})
		el = next
	}
	// Lease ends are non-decreasing along t.leased: free every ended lease,
	// stop at the first live one. The abort timeout does not apply to them:
	// their decode said it was alive, and stopped saying so one TTL ago.
	for el := t.leased.Front(); el != nil; {
		e := el.Value.(*entry)
		if !now.After(e.lease) {
			break
		}
		next := el.Next()
		t.unhold(e)
		t.st.LeaseExpired++
		out = append(out, Freed{ID: e.id, Reason: ReasonExpired, Lease: true})
		el = next
	}
	for _, f := range out {
		t.st.Freed[f.Reason]++
		if e := t.byID[f.ID]; e != nil && e.el == nil && e.st == stGone {
			t.stampAt(e, now)
		}
	}
	t.evict()
	t.expireEarly(now)
	return out
}

// IsHeld reports whether id is held (awaiting DONE) under generation gen:
// a read grant for id's blocks is valid only while this is true.
func (t *Tracker) IsHeld(id string, gen uint64) bool {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	return e != nil && e.st == stHeld && e.gen == gen && gen != 0
}

// Held returns the generation and a copy of the blocks of a held request.
func (t *Tracker) Held(id string) (gen uint64, blocks []int, ok bool) {
	t.mu.Lock()
	defer t.mu.Unlock()
	e := t.byID[id]
	if e == nil || e.st != stHeld {
		return 0, nil, false
	}
	if e.blocks != nil {
		blocks = append(make([]int, 0, len(e.blocks)), e.blocks...)
	}
	return e.gen, blocks, true
}

// Len returns the number of held requests (awaiting DONE).
func (t *Tracker) Len() int {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.held.Len() + t.leased.Len()
}

// Stats returns a snapshot of the counters.
func (t *Tracker) Stats() Stats {
	t.mu.Lock()
	defer t.mu.Unlock()
	s := t.st
	s.Held = t.held.Len() + t.leased.Len()
	s.Leased = t.leased.Len()
	s.Pending = len(t.pending)
	s.Records = t.mem.Len()
	s.Early = t.earlyQ.Len()
	return s
}

// --- internals; t.mu held ---

func (t *Tracker) arm(e *entry, start time.Time, expected int, blocks []int) {
	t.gen++
	t.st.Delayed++
	e.st = stHeld
	e.gen = t.gen
	e.start = start
	e.expected = expected
	e.blocks = blocks
	e.el = t.held.PushBack(e)
}

// unhold takes a held e out of its list; it becomes stGone.
func (t *Tracker) unhold(e *entry) {
	if e.leased {
		t.leased.Remove(e.el)
	} else {
		t.held.Remove(e.el)
	}
	e.el = nil
	e.leased = false
	e.lease = time.Time{}
	e.st = stGone
	e.blocks = nil
}

// free queues e (already stGone, in no list) for the next Finished.
func (t *Tracker) free(e *entry, r Reason) {
	e.reported = true
	t.queue(e.id, r)
}

func (t *Tracker) queue(id string, r Reason) {
	if _, dup := t.pendingSet[id]; dup {
		return
	}
	t.pendingSet[id] = struct{}{}
	t.pending = append(t.pending, Freed{ID: id, Reason: r})
}

// early records a first early DONE at now.
func (t *Tracker) early(e *entry, now time.Time) {
	e.received = 1
	t.stampAt(e, now)
	if t.quorum(e.id) <= 1 {
		e.reported = true
		t.queue(e.id, ReasonDone)
	}
	t.evict()
}

// holdEarly records a first early DONE at now under HoldEarly: kept, not
// reported, within MaxEarly and EarlyTTL.
func (t *Tracker) holdEarly(e *entry, now time.Time) {
	e.received = 1
	if now.Before(t.lastStamp) {
		now = t.lastStamp
	}
	t.lastStamp = now
	e.stamp = now
	e.el = t.earlyQ.PushBack(e)
	e.inEarly = true
	t.expireEarly(now)
	for t.earlyQ.Len() > t.opts.MaxEarly {
		t.st.EarlyEvicted++
		t.dropEarly(t.earlyQ.Front().Value.(*entry))
	}
}

// expireEarly drops HoldEarly's early DONEs older than EarlyTTL at now.
func (t *Tracker) expireEarly(now time.Time) {
	for el := t.earlyQ.Front(); el != nil; el = t.earlyQ.Front() {
		e := el.Value.(*entry)
		if now.Sub(e.stamp) <= t.opts.EarlyTTL {
			return
		}
		t.st.EarlyExpired++
		t.dropEarly(e)
	}
}

func (t *Tracker) dropEarly(e *entry) {
	t.earlyQ.Remove(e.el)
	e.el = nil
	e.inEarly = false
	delete(t.byID, e.id)
}

// unlinkEarly takes a stEarly e out of t.earlyQ or t.mem.
func (t *Tracker) unlinkEarly(e *entry) {
	if e.inEarly {
		t.earlyQ.Remove(e.el)
		e.inEarly = false
	} else {
		t.mem.Remove(e.el)
	}
	e.el = nil
}

// quorum is the number of early DONEs that free request id.
func (t *Tracker) quorum(id string) int {
	if t.opts.EarlyQuorum != nil {
		return max(t.opts.EarlyQuorum(id), 1)
	}
	return t.opts.EarlyDoneQuorum
}

// stampAt appends e to t.mem. Stamps are clamped to be non-decreasing (mem
// is oldest first; stamps are for tests and debugging, nothing ages).
func (t *Tracker) stampAt(e *entry, now time.Time) {
	if now.Before(t.lastStamp) {
		now = t.lastStamp
	}
	t.lastStamp = now
	e.stamp = now
	e.el = t.mem.PushBack(e)
}

// evict drops the oldest records beyond MaxRecords. A record still awaiting
// its report is not forgotten (a later AddDelayed would hold blocks the
// engine is about to free): it leaves t.mem as a plain finished entry and
// is remembered again when Finished reports it.
func (t *Tracker) evict() {
	for t.mem.Len() > t.opts.MaxRecords {
		e := t.mem.Front().Value.(*entry)
		t.st.RecordsEvicted++
		if _, pending := t.pendingSet[e.id]; pending {
			t.mem.Remove(e.el)
			e.el = nil
			e.st = stGone
			continue
		}
		t.drop(e)
	}
}

func (t *Tracker) drop(e *entry) {
	t.mem.Remove(e.el)
	e.el = nil
	delete(t.byID, e.id)
}

// Held is one held request as Inventory lists it (/debug/kv).
type Held struct {
	RequestID string `json:"request_id"`
	Blocks    int    `json:"blocks"`
	// Age is the time since its delay started (the send).
	Age           time.Duration `json:"age_ns"`
	ExpectedDones int           `json:"expected_dones"`
	DonesSeen     int           `json:"dones_seen"`
	// Leased: a RENEW arrived; LeaseRemaining is then the time until it
	// is force-freed unless renewed again. Otherwise AbortIn is the time
	// until the abort timeout force-frees it.
	Leased         bool          `json:"leased"`
	LeaseRemaining time.Duration `json:"lease_remaining_ns,omitempty"`
	AbortIn        time.Duration `json:"abort_in_ns,omitempty"`
}

// Inventory lists every held request (awaiting DONEs), oldest delay start
// first, as of now. It copies; the tracker is unchanged.
func (t *Tracker) Inventory(now time.Time) []Held {
	t.mu.Lock()
	defer t.mu.Unlock()
	out := make([]Held, 0, t.held.Len()+t.leased.Len())
	for _, l := range []*list.List{t.held, t.leased} {
		for el := l.Front(); el != nil; el = el.Next() {
			e := el.Value.(*entry)
			h := Held{RequestID: e.id, Blocks: len(e.blocks), Age: now.Sub(e.start), ExpectedDones: e.expected,
				DonesSeen: e.received, Leased: e.leased}
			if e.leased {
				h.LeaseRemaining = e.lease.Sub(now)
			} else {
				h.AbortIn = e.start.Add(t.opts.AbortTimeout).Sub(now)
			}
			out = append(out, h)
		}
	}
	slices.SortStableFunc(out, func(a, b Held) int { return cmp.Compare(b.Age, a.Age) })
	return out
}

// HeldPast counts the held requests whose delay started more than age
// before now.
func (t *Tracker) HeldPast(now time.Time, age time.Duration) int {
	t.mu.Lock()
	defer t.mu.Unlock()
	n := 0
	for _, l := range []*list.List{t.held, t.leased} {
		for el := l.Front(); el != nil; el = el.Next() {
			if now.Sub(el.Value.(*entry).start) > age {
				n++
			}
		}
	}
	return n
}
