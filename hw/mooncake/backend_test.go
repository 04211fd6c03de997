package mooncake

import (
	"errors"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/testutil"
)

// The exported helpers other backends (mooncakec) are built on behave as
// the TCP engine's own table: ranges checked, Remove waits for pins.
func TestRegionsExported(t *testing.T) {
	mem := mmap(t, 1<<16)
	base := AddrOf(mem)
	var r Regions
	if err := r.Add(base, 1<<16, "a"); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name         string
		addr, length uint64
		want         error
	}{
		{"inside", base + 10, 100, nil},
		{"past end", base + 1<<16 - 4, 8, ErrNotRegistered},
		{"zero", base, 0, ErrZeroLength},
		{"below", base - 8, 8, ErrNotRegistered},
	} {
		t.Run(tc.name, func(t *testing.T) {
			unpin, err := r.Pin(tc.addr, tc.length)
			if !errors.Is(err, tc.want) {
				t.Fatalf("Pin = %v, want %v", err, tc.want)
			}
			if err == nil {
				unpin()
			}
		})
	}
	if err := r.Add(base+8, 8, "b"); !errors.Is(err, ErrOverlap) {
		t.Fatalf("overlapping Add = %v", err)
	}
	unpin, err := r.Pin(base, 8)
	if err != nil {
		t.Fatal(err)
	}
	wait, err := r.Remove(base)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.Pin(base, 8); !errors.Is(err, ErrNotRegistered) {
		t.Fatalf("Pin after Remove = %v", err)
	}
	drained := make(chan struct{})
	go func() { wait(); close(drained) }()
	select {
	case <-drained:
		t.Fatal("Remove's wait returned while a pin was held")
	case <-time.After(10 * time.Millisecond):
	}
	unpin()
	<-drained
}

func TestTransferMetricsExported(t *testing.T) {
	reg := prometheus.NewRegistry()
	m := NewTransferMetrics(reg)
	m.Completed(DirRead, 100)
	m.Completed(DirWrite, 7)
	m.Batch(DirRead, time.Millisecond, nil)
	m.Batch(DirWrite, time.Millisecond, errors.New("x"))
	NewTransferMetrics(reg).Completed(DirRead, 1) // a second engine shares the series
	if got := testutil.ToFloat64(m.m.bytes.WithLabelValues(dirRead)); got != 101 {
		t.Errorf("read bytes %v, want 101", got)
	}
	if got := testutil.ToFloat64(m.m.ops.WithLabelValues(dirWrite)); got != 1 {
		t.Errorf("write ops %v, want 1", got)
	}
	if got := testutil.CollectAndCount(m.m.batch); got != 4 {
		t.Errorf("batch series %d, want 4", got)
	}
	if _, _, err := ParseSession("nohost"); !errors.Is(err, ErrSession) {
		t.Errorf("ParseSession(nohost) = %v", err)
	}
}
