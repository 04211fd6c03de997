// Package control is the engine-facing control socket of one kvflow
// worker: a ZMQ ROUTER (ipc:// by default) speaking msgpack maps, one
// request and one reply at a time per peer (REQ-style), mirroring the
// worker API of the seed (start_load_kv / get_finished). load, send and
// abort are served one at a time in arrival order on a goroutine of their
// own; finished and status are answered at once, so a load waiting for
// room in a full pipeline does not delay a finished poll:
//
//	{"op":"load",  "requests":[{request_id, local_block_ids, kv_transfer_params}]}   decode
//	{"op":"send",  "requests":[{request_id, delay_start_time, block_ids}]}          prefill
//	{"op":"abort", "request_ids":[...]}
//	{"op":"finished"} → {done_sending, done_recving, failed_recving:[{request_id, block_ids, reason}]}
//	{"op":"status"}
//
// Every reply is a map with "ok" (bool) and, when not ok, "error". Per-request
// results of load/send are in "errors" (nil = accepted), index-aligned with
// the request list (absent when the list is empty). abort answers
// "aborted" (how many ids the worker knew), status "role" and "status".
// A send's request gets its own error (package prefill) when its
// delay_start_time is not finite, negative or more than 60 s in the future
// (prefill.MaxClockSkew), when its request_id is already held (sent and
// not freed yet), when a block id is out of range, and when the worker is
// draining after SIGTERM (prefill.ErrDraining: send it elsewhere).
// Unknown ops, malformed msgpack and ill-typed fields get an error reply;
// the server keeps serving. Unknown map keys are ignored so clients can add
// fields. Required, as the seed reads them: request_id of every request;
// local_block_ids and kv_transfer_params (remote_block_ids,
// remote_engine_id, remote_host, remote_port) of a load; request_ids of an
// abort. kvflow's optional kv_transfer_params.kvflow_boot_epochs (the
// prefill ranks' boot epochs when they handed the request over) must be an
// array of integers: another type is an error naming the field; a negative
// entry or more than decode.MaxBootEpochs is the load's own error (package
// decode). A prefill's status reports its boot_epoch, which the engine's
// scheduler puts there.
// A message must be one msgpack map, nested at most 16 deep, with no
// integer above 2^63-1. A request that is not exactly one non-empty frame
// (after REQ's empty delimiter) never reaches the codec: it gets the side
// channel's raw "ERR <reason>" reply, not msgpack.
//
// The codec (Decode/Encode, Dispatch) is pure; the socket is
// sidechannel.NewRouter's, on the process's one ZMQ context.
//
// # Who holds an ipc:// socket
//
// ZMQ's ipc bind unlinks whatever file is at the path and binds anew, so a
// second worker with the same engine id, role and ranks would silently take
// the first one's engine away; and ZMQ never removes the file it bound.
// LockSocket, called before the bind, makes the path this process's: an
// exclusive flock on <path>.lock (its pid written in it for people), which
// the kernel drops when the process dies. A live holder is ErrInUse (the
// binary exits 2), naming the endpoint and the holder's pid; a dead one's
// lock file and socket file are taken over (the bind replaces the stale
// socket). SocketLock.Release, after the ZMQ context is terminated, removes
// the socket file and the lock file while still holding the lock.
package control
