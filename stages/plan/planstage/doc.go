// Package planstage is the decode pipeline's first stage around the pure
// planner (package plan): it validates a job's request against the
// topology and stores the plan on the job.
//
// It also owns what happens at admission: with leases on (Deps.Renewer),
// Admit plans a request as the decode worker admits it and leases it at
// once through the stage's lease.Keeper (stages/lease) — at the ranks
// whose metadata is cached, and at the others once a fetch it starts
// lands — so that time queued never outlasts the prefill's abort timeout;
// Process then has nothing left to do. End drops a request's leases when
// it ends; Close stops the fetches and the renewals.
//
// The planning itself does no I/O; admission's fetches go through the
// handshake stage's cache (injected). It must never import cgo.
package planstage
