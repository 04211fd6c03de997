package peers

import (
	"encoding/json"
	"errors"
	"io"
	"net/http"
	"net/http/httptest"
	"testing"
)

// TestDebugPeersNoNulls: /debug/peers, fetched over HTTP, renders empty
// lists as [] (a peer that never failed has "recent_failures": [], a
// tracker with no peer "peers": []), never null.
func TestDebugPeersNoNulls(t *testing.T) {
	tr, err := New(Options{DownAfter: 3})
	if err != nil {
		t.Fatal(err)
	}
	srv := httptest.NewServer(tr)
	defer srv.Close()
	get := func() map[string]json.RawMessage {
		t.Helper()
		resp, err := http.Get(srv.URL + "/debug/peers")
		if err != nil {
			t.Fatal(err)
		}
		defer resp.Body.Close()
		body, err := io.ReadAll(resp.Body)
		if err != nil {
			t.Fatal(err)
		}
		var out map[string]json.RawMessage
		if err := json.Unmarshal(body, &out); err != nil {
			t.Fatalf("%v: %s", err, body)
		}
		return out
	}
	if got := string(get()["peers"]); got != "[]" {
		t.Fatalf(`no peers: "peers": %s, want []`, got)
	}
	tr.Begin("10.0.0.1:5000")
	tr.End("10.0.0.1:5000", nil)
	tr.Begin("10.0.0.2:5000")
	tr.End("10.0.0.2:5000", errors.New("read timeout"))
	var ps []map[string]json.RawMessage
	if err := json.Unmarshal(get()["peers"], &ps); err != nil || len(ps) != 2 {
		t.Fatalf("peers: %v %v", ps, err)
	}
	if got := string(ps[0]["recent_failures"]); got != "[]" {
		t.Errorf(`peer that never failed: "recent_failures": %s, want []`, got)
	}
	var fs []Failure
	if err := json.Unmarshal(ps[1]["recent_failures"], &fs); err != nil || len(fs) != 1 {
		t.Errorf("failed peer: recent_failures %s", ps[1]["recent_failures"])
	}
}
