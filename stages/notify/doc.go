// Package notify is the decode pipeline's last stage: it tells every remote
// prefill rank a job read from that it may free the job's blocks
// (DONE_RECVING, answered by ACK) — after a success and also after a
// failure, so the prefill side never holds blocks until its abort timeout
// because of us. Messages to distinct ranks go out concurrently; one per
// rank and task, as the seed sends them (a prefill rank that expects
// several DONEs counts them).
//
// A DONE that cannot be delivered is counted and logged; it does not fail a
// job whose bytes all landed (the prefill side frees it at its abort
// timeout). Its subpackage tracker is the prefill side's bookkeeping of
// which requests wait for DONE.
//
// The package never opens sockets itself (it calls a Sender) and never
// changes a job's outcome on the strength of an ACK.
package notify
