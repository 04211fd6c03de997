package main

import (
	"io"
	"net/http"
	"net/http/httptest"
	"strings"
	"sync/atomic"
	"testing"
)

// A debug endpoint asked of the wrong role, or before the worker started,
// or the profiler while it is off, says why instead of a bare 404.
func TestDebugEndpointsSayWhy(t *testing.T) {
	var empty, set atomic.Pointer[http.Handler]
	var ok http.Handler = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { io.WriteString(w, "{}") })
	set.Store(&ok)
	tests := []struct {
		name string
		h    http.Handler
		code int
		want string
	}{
		{"wrong role", debugHandler("/debug/kv", "prefill", "decode", &empty), 404, "/debug/kv: served by prefill workers only; this one is decode"},
		{"starting", debugHandler("/debug/peers", "decode", "decode", &empty), 404, "/debug/peers: not served yet"},
		{"served", debugHandler("/debug/peers", "decode", "decode", &set), 200, "{}"},
		{"pprof off", http.HandlerFunc(pprofOff), 404, "start the worker with --pprof"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			rec := httptest.NewRecorder()
			tt.h.ServeHTTP(rec, httptest.NewRequest("GET", "/x", nil))
			if rec.Code != tt.code || !strings.Contains(rec.Body.String(), tt.want) {
				t.Fatalf("got %d %q, want %d containing %q", rec.Code, rec.Body.String(), tt.code, tt.want)
			}
		})
	}
}
