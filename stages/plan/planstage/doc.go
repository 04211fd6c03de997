// Package planstage wraps the pure planner as the decode pipeline's first
// stage: it validates a job's request against the topology and stores the
// plan on the job. It does no I/O.
package planstage
