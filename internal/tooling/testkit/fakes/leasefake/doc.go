// Package leasefake is a recording fake of the lease keeper's Renewer
// (stages/lease): the side channel's RENEW, as stages/lease's own tests and
// the decode worker's tests drive it.
//
// It sits apart from package fakes because fakes imports stages/read, which
// imports stages/lease: stages/lease's tests could not import it without an
// import cycle. This package imports only the standard library (Renewer is a
// one-method interface of strings), so any package's tests may use it.
//
// # Never
//
// Product code never imports it (internal/tooling's rule); it sends
// nothing and never asserts on a test's behalf.
package leasefake
