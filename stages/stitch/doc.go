// Package stitch is the decode pipeline's fourth stage. When one decode
// rank pulls its heads from P = tp_num_need_pulls prefill ranks, each task
// lands its 1/P of every block side by side ([P][block_size][heads/P·dim]);
// after all tasks of the job have landed (the read stage hands a job on
// only then) this stage reorders those blocks, every layer and part, into
// [block_size][heads][dim] through the device's stitch kernel — the seed's
// _cat_kv_cache. With P = 1 it passes the job through without work, and
// so it does for a job the read stage already landed stitched (its engine
// scattered every slice straight to its place: job.Job.Stitched).
//
// It never reorders a block twice and never touches blocks of other jobs.
package stitch
