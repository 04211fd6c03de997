"""Driven by python_test.go: calls every op of kvflow_client against a real
kvflow control socket served with the Go test's fake Backend, checks the
replies, and exits non-zero with a message on the first mismatch."""

import sys

import msgpack
import numpy as np
import zmq

import kvflow_client as kc


def check(cond, what):
    if not cond:
        sys.exit("FAIL: " + what)


def main(endpoint, role):
    params = {"remote_block_ids": np.array([7, 8, 9]), "remote_engine_id": "p-engine",
              "remote_host": "10.0.0.2", "remote_port": 30001, "remote_pcp_size": 1, "remote_dcp_size": 2}
    with kc.Client(endpoint, timeout_ms=5000) as c:
        st = c.status()
        check(st == {"role": role, "in_flight": 2, "peers": ["a"]}, "status %r" % (st,))

        load = [{"request_id": "r1", "local_block_ids": np.arange(1, 4), "kv_transfer_params": params},
                {"request_id": "bad1", "local_block_ids": [], "kv_transfer_params": params}]
        send = [{"request_id": "s1", "delay_start_time": 1712345678.25, "block_ids": [4, 5]},
                {"request_id": "bad2", "delay_start_time": 0}]
        if role == "decode":
            errs = c.load(load)
            check(errs == [None, "rejected bad1"], "load errors %r" % (errs,))
            check(c.load([]) == [], "empty load")
            try:
                c.send(send)
                check(False, "send on a decode worker succeeded")
            except kc.ControlError as e:
                check("not supported by a decode worker" in str(e), "send error %s" % e)
        else:
            errs = c.send(send)
            check(errs == [None, "rejected bad2"], "send errors %r" % (errs,))
            try:
                c.load(load)
                check(False, "load on a prefill worker succeeded")
            except kc.ControlError as e:
                check("not supported by a prefill worker" in str(e), "load error %s" % e)

        n = c.abort(["known1", "other", "known2"])
        check(n == 2, "aborted %r" % (n,))
        ds, dr, failed = c.finished()
        if role == "decode":
            check(ds == [] and dr == ["r1"], "finished %r %r" % (ds, dr))
            check(failed == [{"request_id": "r2", "block_ids": [3, 4], "reason": "peer gone"}], "failed %r" % (failed,))
        else:
            check(ds == ["s1", "s2"] and dr == [] and failed == [], "finished %r %r %r" % (ds, dr, failed))

        # Error replies raise and leave the client usable.
        for msg, want in [({"op": "frobnicate"}, "unknown op"), ({"op": "abort"}, "request_ids missing"),
                          ({"op": "load", "requests": [{"request_id": "x"}]}, "local_block_ids missing")]:
            try:
                c.call(msg)
                check(False, "%r accepted" % (msg,))
            except kc.ControlError as e:
                check(want in e.message and e.reply["ok"] is False, "%r: %s" % (msg, e))
        check(c.status()["role"] == role, "status after errors")

    # Garbage from a raw socket gets an error reply; the server keeps serving.
    ctx = zmq.Context()
    s = ctx.socket(zmq.REQ)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.RCVTIMEO, 5000)
    s.connect(endpoint)
    for garbage in [b"\xc1not msgpack", msgpack.packb(["status"]), msgpack.packb({"op": "status"}) + b"\x00"]:
        s.send(garbage)
        rep = msgpack.unpackb(s.recv())
        check(rep["ok"] is False and rep["error"].startswith("control: bad request"), "garbage reply %r" % (rep,))
    s.close()
    ctx.term()
    with kc.Client(endpoint, timeout_ms=5000) as c:
        check(c.status()["role"] == role, "status after garbage")
    print("ok", role)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
