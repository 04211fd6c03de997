// Package notify is the decode pipeline's last stage: it tells every remote
// prefill rank a job read from that it may free the job's blocks
// (DONE_RECVING, answered by ACK) — after a success and also after a
// failure, so the prefill side never holds blocks until its abort timeout
// because of us. Messages to distinct ranks go out concurrently; one per
// rank and task, as the seed sends them (a prefill rank that expects
// several DONEs counts them).
//
// Batched DONEs (kvflow only, negotiated): when the Sender is a
// BatchSender and a remote rank's metadata advertised batch_done
// (job.Meta.BatchDone), that rank's DONE goes through SendDoneBatched,
// which shares one done_batch_msg round trip with the other DONEs to the
// same endpoint in flight at the time (group commit in the side channel's
// client; no timer, so no added latency at low load). Meaning, ACK and
// error handling are those of a plain DONE. Seed ranks and kvflow ranks
// that do not advertise it get plain DONEs; so does every rank when the
// Sender is not a BatchSender (e.g. wrapped by a fault injector).
//
// After a failed handshake, a rank whose side-channel port refused the
// connection (job.ErrRefused in the job's job.PeerError for that rank) gets
// no DONE: nothing listens there. One whose side channel answered none of
// the GET_META's attempts (job.ErrNoReply) gets its DONE with one attempt
// instead of all: the request does not wait out the same timeouts twice.
// The first is counted as result skipped_refused, the second as any DONE.
//
// No DONE goes to a rank whose metadata shows another boot epoch than the
// one the request's kv_transfer_params name (job.Job.OwesDone): that
// process never held the request (the one that did is gone with its
// blocks), and a DONE could only free a same-id request of its own while
// its decode still reads it. Counted as result skipped_restarted. The
// seed, which has no epochs, sends every task's DONE; so does kvflow
// whenever either epoch is unknown.
//
// A DONE that cannot be delivered is counted and logged; it does not fail a
// job whose bytes all landed (the prefill side frees it at its abort
// timeout). Its subpackage tracker is the prefill side's bookkeeping of
// which requests wait for DONE.
//
// The package never opens sockets itself (it calls a Sender) and never
// changes a job's outcome on the strength of an ACK.
//
// Shutdown: a request the decode worker's Close canceled before it reached
// this stage has sent no DONE; End records the DONEs it owes (one per
// task) and Close sends them, within ReleaseTimeout, so the prefill frees
// those blocks at once rather than at its abort timeout
// (kvflow_decode_shutdown_dones_total). One canceled inside this stage may
// have sent some already and owes none (a DONE counted twice could free
// blocks another decode rank still reads).
//
// New(Config, Deps) builds the stage; Config (timeout, attempts, backoff
// of the DONE/RENEW client, JobTimeout bounding one job) has
// DefaultConfig, Validate and RegisterFlags; DefaultPool is its pool.
package notify
