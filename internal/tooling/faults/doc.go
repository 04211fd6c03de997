// Package faults injects failures into kvflow's decode pipeline from a
// seeded schedule, so that tests can drive thousands of requests through
// failing transfers, handshakes and notifications and check that every
// request still ends the way the pipeline promises.
//
// A Schedule holds, for each operation (Read = read.Transfer.BatchRead,
// GetMeta = handshake.Fetcher.GetMeta, SendDone = notify.Sender.SendDone),
// the probability of each fault Kind, a delay bound and a PCG seed. An
// Injector built from it wraps the stage interfaces:
//
//	in, _ := faults.New(faults.Schedule{Seed: 7, Read: faults.Rates{Fail: 0.05, Delay: 0.1}})
//	w, _ := decode.New(decode.Options{Transfer: in.Transfer(t), Fetcher: in.Fetcher(f), Sender: in.Sender(s), ...})
//
// Faults by operation:
//
//	Read:     Fail (not run, error), Delay (run late), Truncate (first k of n ops
//	          run, then error), ShortRead (first k of n ops run, then nil: the
//	          silent partial transfer a byte ledger must catch), Duplicate (run twice)
//	GetMeta:  Fail, Delay, Corrupt (the answer altered: see Corruption)
//	SendDone (plain and batched): Drop (not sent, error), Delay, Duplicate (sent twice)
//
// # Replay
//
// The decision for a call is a pure function of the seed, the operation, a
// key derived from the call's arguments (session and op addresses;
// endpoint; endpoint and request id) and how many calls with that key the
// injector has seen before (Schedule.Decide). Goroutine interleaving does
// not change which call gets which fault: the same seed with the same
// requests injects the same faults, so a failing run is replayed by its
// seed. Counters (Injector.Counts) report the calls and the faults injected
// per operation and kind.
//
// # Contract
//
// A wrapper never retries and never hides an error of the wrapped
// interface; a Delay ends early with the context's cause (the operation is
// then not run). Injected errors wrap ErrInjected. The package does no I/O
// of its own and starts no goroutine; it must never be wired into a
// production worker (cmd/kvflow does not import it).
package faults
