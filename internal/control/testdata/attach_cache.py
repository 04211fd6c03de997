"""Driven by python_test.go: attaches to a cache file kvflow made
(npu.CreateShm), checks the layout and the Go-written pattern of every
cache, then writes block 1 of the last cache with 0xAB for Go to see."""

import json
import sys

import numpy as np

import kvflow_client as kc


def pattern(k, n):
    i = np.arange(n, dtype=np.uint64)
    return ((k * 37 + i * 7 + i // 251) % 256).astype(np.uint8)


def main(spec):
    spec = json.loads(spec)
    c = kc.attach_cache(spec["path"])
    want = (spec["kind"], spec["dtype"], spec["num_layers"], spec["num_parts"], spec["block_lens"])
    got = (c.kind, c.dtype, c.num_layers, c.num_parts, c.block_lens)
    if got != want:
        sys.exit("FAIL: header %r, want %r" % (got, want))
    for e in spec["caches"]:
        a = c[e["layer"], e["part"]]
        if list(a.shape) != e["shape"] or a.dtype != np.dtype(e["np_dtype"]):
            sys.exit("FAIL: cache %r: shape %r dtype %s" % (e, a.shape, a.dtype))
        if c.offsets[e["k"]] != e["offset"]:
            sys.exit("FAIL: cache %r: offset %d" % (e, c.offsets[e["k"]]))
        b = a.view(np.uint8).reshape(-1)
        if not np.array_equal(b, pattern(e["k"], b.size)):
            bad = int(np.argmax(b != pattern(e["k"], b.size)))
            sys.exit("FAIL: cache %r: byte %d is %d" % (e, bad, b[bad]))
    last = spec["caches"][-1]
    c.block(last["layer"], last["part"], 1).view(np.uint8)[...] = 0xAB
    c.close()
    print("ok", spec["kind"], spec["dtype"])


if __name__ == "__main__":
    main(sys.argv[1])
