module github.com/kvflow/kvflow

go 1.26.0

require (
	github.com/lmittmann/tint v1.2.1 // indirect
	github.com/pebbe/zmq4 v1.4.0 // indirect
	github.com/prometheus/client_golang v1.25.0 // indirect
	github.com/sourcegraph/conc v0.3.0 // indirect
	github.com/vmihailenco/msgpack/v5 v5.4.1 // indirect
	github.com/vmihailenco/tagparser/v2 v2.0.0 // indirect
	golang.org/x/sync v0.25.0 // indirect
)
