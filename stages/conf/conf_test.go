package conf

import (
	"encoding/json"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"
)

func TestDuration(t *testing.T) {
	for _, tc := range []struct {
		in   string
		want time.Duration
		err  string
	}{
		{`"30s"`, 30 * time.Second, ""},
		{`" 250ms "`, 250 * time.Millisecond, ""},
		{`null`, 7, ""},
		{`30`, 0, `want a duration string such as "30s", got number 30`},
		{`"soon"`, 0, `want a duration such as "30s" or "250ms", got "soon"`},
	} {
		t.Run(tc.in, func(t *testing.T) {
			d := Duration(7)
			err := json.Unmarshal([]byte(tc.in), &d)
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("err %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || d.D() != tc.want {
				t.Fatalf("got %v, %v; want %v", d.D(), err, tc.want)
			}
			b, _ := json.Marshal(d)
			var back Duration
			if err := json.Unmarshal(b, &back); err != nil || back != d {
				t.Fatalf("round trip %s: %v %v", b, back, err)
			}
		})
	}
	var d Duration
	if err := d.Set("1m"); err != nil || d.D() != time.Minute || d.String() != "1m0s" {
		t.Fatalf("Set: %v %v", d, err)
	}
	if err := d.Set("x"); err == nil {
		t.Fatal("Set accepted x")
	}
}

func TestPoolAndFields(t *testing.T) {
	err := fmt.Errorf("stage x: %w", Pool{Workers: 0, Queue: -1}.Validate())
	fs := Fields(errors.Join(err, errors.New("plain")))
	var got []string
	for _, f := range fs {
		got = append(got, f.Error())
	}
	want := []string{"workers: must be >= 1, got 0", "queue: must be >= 1, got -1", "plain"}
	if strings.Join(got, "|") != strings.Join(want, "|") {
		t.Fatalf("got %q, want %q", got, want)
	}
	if err := (Pool{1, 1}).Validate(); err != nil {
		t.Fatal(err)
	}
}
