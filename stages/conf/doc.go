// Package conf holds the few configuration primitives the stages share:
// a Duration that reads and writes "30s" in JSON and on the command line,
// a stage's worker pool (Pool), and FieldError, the one problem a stage's
// Config.Validate reports, naming its field by its JSON key.
//
// Each stage package owns its Config (defaults, Validate, RegisterFlags
// under a prefix, the grafana/dskit per-component pattern); the binary's
// configuration (internal/config) composes them under its own keys and
// maps each FieldError to its full path.
//
// It must never import a stage, internal/ code or cgo: every stage imports
// it, and CGO_ENABLED=0 builds of the stages must keep working.
package conf
