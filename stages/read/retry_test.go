package read

import (
	"context"
	"errors"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus/testutil"

	"github.com/kvflow/kvflow/stages/job"
	"github.com/kvflow/kvflow/stages/plan"
)

func TestRetryVerdict(t *testing.T) {
	admitted := time.Unix(1_800_000_000, 0)
	epochAt := func(d time.Duration) uint64 { return uint64(admitted.Add(d).UnixNano()) }
	m := func(port int, epoch uint64, base uint64) job.Meta {
		return job.Meta{EngineID: "P", TERPCPort: port, BaseAddrs: []uint64{base}, NumBlocks: 8, BootEpoch: epoch}
	}
	old := m(17000, epochAt(-time.Hour), 1<<30)
	lost := Failure{ConnLost: true}
	for _, tc := range []struct {
		name      string
		f         Failure
		used      job.Meta
		fresh     job.Meta
		retry     bool
		restarted bool // refused with ErrPeerRestarted
	}{
		{"same process, connection lost", lost, old, old, true, false},
		{"same process, refused or short", Failure{}, old, old, false, false},
		{"same process, part landed", Failure{ConnLost: true, Moved: true}, old, old, false, false},
		{"restarted before admission, connection lost", lost, old, m(17001, epochAt(-time.Second), 2<<30), true, false},
		{"restarted before admission, reads refused (same port)", Failure{}, old, m(17000, epochAt(-time.Second), 2<<30), true, false},
		{"restarted before admission, part landed", Failure{ConnLost: true, Moved: true}, old, m(17001, epochAt(-time.Second), 2<<30), false, false},
		{"restarted at admission", lost, old, m(17001, epochAt(0), 2<<30), false, true},
		{"restarted after admission", lost, old, m(17001, epochAt(time.Millisecond), 2<<30), false, true},
		{"new epoch is no boot time", lost, m(17000, 1, 1<<30), m(17001, 2, 2<<30), false, true},
		{"new epoch past int64", lost, old, m(17001, 1<<63+5, 2<<30), false, true},
		{"epoch gone (seed peer now)", lost, old, m(17001, 0, 2<<30), false, true},
		{"seed peer, same process", lost, m(17000, 0, 1<<30), m(17000, 0, 1<<30), true, false},
		{"seed peer, new port", lost, m(17000, 0, 1<<30), m(17001, 0, 1<<30), false, true},
		{"seed peer, new addresses", lost, m(17000, 0, 1<<30), m(17000, 0, 2<<30), false, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := retryVerdict(tc.f, tc.used, tc.fresh, admitted)
			if (err == nil) != tc.retry {
				t.Fatalf("verdict %v, want retry %v", err, tc.retry)
			}
			if got := errors.Is(err, ErrPeerRestarted); got != tc.restarted {
				t.Fatalf("verdict %v: restarted %v, want %v", err, got, tc.restarted)
			}
		})
	}
}

var errLost = errors.New("peer closed the connection")

// sessionTransfer serves reads from live sessions only; a read from any
// other fails as a lost connection (ConnLost, or a refusal when refuse),
// with part of the batch landed when moved.
type sessionTransfer struct {
	mu     sync.Mutex
	live   map[string]bool
	reads  map[string]int
	refuse bool
	moved  bool
}

func (s *sessionTransfer) BatchRead(_ context.Context, session string, _ *Batch) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.reads[session]++
	if s.live[session] {
		return nil
	}
	if s.refuse {
		return errors.New("rejected")
	}
	return errLost
}

func (s *sessionTransfer) Capabilities() Capabilities {
	return Capabilities{Classify: func(err error) Failure {
		return Failure{ConnLost: errors.Is(err, errLost), Moved: s.moved}
	}}
}

// The stage's recovery: what is re-fetched, whether the task is read again
// and how the job ends.
func TestRetryOnce(t *testing.T) {
	admitted := time.Unix(1_800_000_000, 0)
	oldMeta := testJob(1).Metas[0]
	oldMeta.BootEpoch = uint64(admitted.Add(-time.Hour).UnixNano())
	newMeta := oldMeta
	newMeta.TERPCPort, newMeta.BootEpoch = 17001, uint64(admitted.Add(-time.Second).UnixNano())
	late := newMeta
	late.BootEpoch = uint64(admitted.Add(time.Second).UnixNano())
	for _, tc := range []struct {
		name        string
		fresh       job.Meta
		refetchErr  error
		refuse      bool  // the old session refuses instead of losing the connection
		moved       bool  // part of the failed batch landed
		newDead     bool  // the new session fails too
		before      error // BeforeRetry's answer
		noClassify  bool
		wantRetried bool // the new session was read
		wantErr     string
		result      string // retries counter that moved
	}{
		{name: "restarted: read again", fresh: newMeta, wantRetried: true, result: "done"},
		{name: "restarted after admission: lost", fresh: late, wantErr: "prefill peer restarted", result: "refused"},
		{name: "part landed: not read again", fresh: newMeta, moved: true, wantErr: "peer closed", result: "refused"},
		{name: "read again and failed", fresh: newMeta, newDead: true, wantRetried: true, wantErr: "retried once", result: "failed"},
		{name: "same process refused: not read again", fresh: oldMeta, refuse: true, wantErr: "rejected", result: "refused"},
		{name: "refetch failed", refetchErr: errors.New("side channel gone"), wantErr: "side channel gone", result: "refetch_failed"},
		{name: "deadline passed", fresh: newMeta, before: errors.New("too late"), wantErr: "peer closed", result: "refused"},
		{name: "no classifier: old behaviour", fresh: newMeta, noClassify: true, wantErr: "peer closed"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			st := &sessionTransfer{live: map[string]bool{}, reads: map[string]int{}, refuse: tc.refuse, moved: tc.moved}
			newSession := "127.0.0.1:17001"
			st.live[newSession] = !tc.newDead
			var refetches int
			var invalidated bool
			var tr Transfer = st
			if tc.noClassify {
				tr = transferOnly{st}
			}
			s, err := build(tr, Options{
				Layout:     plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
				Local:      plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
				Invalidate: func(*job.Job, int) { invalidated = true },
				Refetch: func(_ context.Context, j *job.Job, i int, used job.Meta, _ time.Time) (job.Meta, error) {
					refetches++
					if used.TERPCPort != oldMeta.TERPCPort {
						t.Errorf("refetch with used port %d", used.TERPCPort)
					}
					return tc.fresh, tc.refetchErr
				},
				BeforeRetry: func(*job.Job, int) error { return tc.before },
			})
			if err != nil {
				t.Fatal(err)
			}
			j := testJob(1)
			j.Metas[0], j.Submitted = oldMeta, admitted
			err = s.Process(context.Background(), j)
			if tc.wantErr == "" && err != nil || tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)) {
				t.Fatalf("err %v, want %q", err, tc.wantErr)
			}
			if got := st.reads[newSession] > 0; got != tc.wantRetried {
				t.Fatalf("new session read %d times, want retried %v", st.reads[newSession], tc.wantRetried)
			}
			if st.reads[newSession] > 1 || st.reads["127.0.0.1:17000"] != 1 {
				t.Fatalf("reads %v: more than one attempt per session", st.reads)
			}
			if tc.noClassify {
				if refetches != 0 || !invalidated {
					t.Fatalf("without a classifier: %d refetches, invalidated %v; want none and invalidated", refetches, invalidated)
				}
				return
			}
			if want := map[bool]int{true: 0, false: 1}[tc.moved]; refetches != want {
				t.Fatalf("%d refetches, want %d", refetches, want)
			}
			if n := testutil.ToFloat64(s.m.retries.WithLabelValues(tc.result)); n != 1 {
				t.Fatalf("retries{result=%s} = %v, want 1", tc.result, n)
			}
			if tc.result == "done" && j.BytesRead.Load() == 0 {
				t.Fatal("retried read counted no bytes")
			}
		})
	}
}

// A job whose rank's metadata says the process booted after the job was
// admitted (fetched after a restart) fails before any read: that process
// cannot hold its blocks.
func TestBootedAfterAdmissionNotRead(t *testing.T) {
	admitted := time.Unix(1_800_000_000, 0)
	for _, tc := range []struct {
		name  string
		epoch uint64
		read  bool
	}{
		{"booted before", uint64(admitted.Add(-time.Second).UnixNano()), true},
		{"booted after", uint64(admitted.Add(time.Second).UnixNano()), false},
		{"opaque epoch", 7, true},
		{"no epoch", 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			f := &fakeTransfer{}
			s := newStage(t, f, nil)
			j := testJob(1)
			j.Submitted, j.Metas[0].BootEpoch = admitted, tc.epoch
			err := s.Process(context.Background(), j)
			if tc.read != (err == nil) || !tc.read && !errors.Is(err, ErrPeerRestarted) {
				t.Fatalf("err %v, want read %v", err, tc.read)
			}
			if read := f.peak.Load() > 0; read != tc.read {
				t.Fatalf("read %v, want %v", read, tc.read)
			}
		})
	}
}

// transferOnly hides a transfer's failure classifier.
type transferOnly struct{ t Transfer }

func (t transferOnly) BatchRead(ctx context.Context, session string, b *Batch) error {
	return t.t.BatchRead(ctx, session, b)
}

func (t transferOnly) Capabilities() Capabilities {
	c := t.t.Capabilities()
	c.Classify = nil
	return c
}

// A job whose context ended (aborted, or past read.timeout) as its read
// failed is not re-fetched or read again.
func TestNoRetryAfterCancel(t *testing.T) {
	started := make(chan struct{})
	var once sync.Once
	tr := abortedTransfer(func(ctx context.Context) error {
		once.Do(func() { close(started) })
		<-ctx.Done()
		return errLost // the connection "failed" as the abort landed
	})
	var refetches int
	s, err := build(tr, Options{
		Layout: plan.CacheLayout{BlockLen: []uint64{4096}, CachesPerLayer: 2},
		Local:  plan.Caches{Base: []uint64{5 << 30, 6 << 30, 7 << 30, 8 << 30}, NumBlocks: 8},
		Refetch: func(context.Context, *job.Job, int, job.Meta, time.Time) (job.Meta, error) {
			refetches++
			return job.Meta{}, nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	j := testJob(1)
	go func() {
		<-started
		j.Abort(nil)
	}()
	if err := s.Process(context.Background(), j); err == nil {
		t.Fatal("aborted job read")
	}
	if refetches != 0 {
		t.Fatalf("%d refetches for an aborted job", refetches)
	}
}

// abortedTransfer is a classifying transfer whose every batch is f.
type abortedTransfer func(ctx context.Context) error

func (f abortedTransfer) BatchRead(ctx context.Context, _ string, _ *Batch) error { return f(ctx) }

func (abortedTransfer) Capabilities() Capabilities {
	return Capabilities{Classify: func(err error) Failure { return Failure{ConnLost: errors.Is(err, errLost)} }}
}
