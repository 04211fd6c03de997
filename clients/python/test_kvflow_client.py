"""Tests of kvflow.client against a fake control server and Python-made
cache files. The Go tests in internal/control run these too (go test ./...)
and also test the client against the real control socket and a cache file
made by kvflow itself."""

import os
import shutil
import struct
import sys
import tempfile
import threading
import time
import unittest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import msgpack  # noqa: E402
import numpy as np  # noqa: E402
import zmq  # noqa: E402

from kvflow import client as kc  # noqa: E402


class FakeServer:
    """A REP socket answering like a kvflow worker, on its own thread.
    handler(msg) -> reply bytes, or None to never answer (a dead worker)."""

    def __init__(self, endpoint, handler):
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)
        self.handler = handler
        self.received = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        poller = zmq.Poller()
        poller.register(self.sock, zmq.POLLIN)
        while not self.stop.is_set():
            if not dict(poller.poll(20)):
                continue
            frames = self.sock.recv_multipart()
            ident, payload = frames[0], frames[-1]
            try:
                msg = msgpack.unpackb(payload, raw=False)
            except Exception:
                msg = payload
            self.received.append(msg)
            rep = self.handler(msg)
            if rep is not None:
                self.sock.send_multipart([ident, b"", rep])

    def close(self):
        self.stop.set()
        self.thread.join()
        self.sock.close()
        self.ctx.term()


def ok(**kw):
    d = {"ok": True, "done_sending": None, "done_recving": None, "failed_recving": None}
    d.update(kw)
    return msgpack.packb(d, use_bin_type=True)


def fake_worker(msg):
    op = msg.get("op") if isinstance(msg, dict) else None
    if op == "load" or op == "send":
        errs = [None if r.get("request_id") != "bad" else "rejected" for r in msg["requests"]]
        return ok(errors=errs)
    if op == "abort":
        return ok(aborted=len([i for i in msg["request_ids"] if i.startswith("known")]))
    if op == "finished":
        return ok(done_sending=["s1"], done_recving=["r1", "r2"],
                  failed_recving=[{"request_id": "r3", "block_ids": [5, 6], "reason": "peer gone"}])
    if op == "status":
        return ok(role="decode", status={"in_flight": 3})
    if op == "raw-error":
        return b"ERR bad envelope: 2 payload frames, want 1"
    if op == "garbage":
        return b"\xc1\xc1"
    if op == "sleep":
        time.sleep(msg.get("seconds", 0.5))
        return ok()
    if op == "never":
        return None
    return msgpack.packb({"ok": False, "error": "control: bad request: unknown op %r" % (op,)})


class ClientTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvfc")
        self.ep = "ipc://" + os.path.join(self.dir, "ctl.sock")
        self.srv = FakeServer(self.ep, fake_worker)
        self.c = kc.Client(self.ep, timeout_ms=2000)

    def tearDown(self):
        self.c.close()
        self.srv.close()
        shutil.rmtree(self.dir)

    def test_load(self):
        params = {"remote_block_ids": np.array([7, 8]), "remote_engine_id": "p0",
                  "remote_host": "10.0.0.1", "remote_port": 30000}
        errs = self.c.load([
            {"request_id": "a", "local_block_ids": np.arange(2), "kv_transfer_params": params},
            {"request_id": "bad", "local_block_ids": [], "kv_transfer_params": params},
        ])
        self.assertEqual(errs, [None, "rejected"])
        msg = self.srv.received[-1]
        self.assertEqual(msg["op"], "load")
        self.assertEqual(msg["requests"][0]["local_block_ids"], [0, 1])
        self.assertEqual(msg["requests"][0]["kv_transfer_params"]["remote_block_ids"], [7, 8])
        self.assertEqual(msg["requests"][0]["kv_transfer_params"]["remote_port"], 30000)

    def test_load_empty(self):
        self.assertEqual(self.c.load([]), [])

    def test_send(self):
        errs = self.c.send([{"request_id": "a", "delay_start_time": 12, "block_ids": (1, 2)}])
        self.assertEqual(errs, [None])
        r = self.srv.received[-1]["requests"][0]
        self.assertIsInstance(r["delay_start_time"], float)
        self.assertEqual(r["block_ids"], [1, 2])

    def test_abort(self):
        self.assertEqual(self.c.abort(["known1", "x", "known2"]), 2)
        self.assertEqual(self.srv.received[-1], {"op": "abort", "request_ids": ["known1", "x", "known2"]})

    def test_finished(self):
        ds, dr, f = self.c.finished()
        self.assertEqual(ds, ["s1"])
        self.assertEqual(dr, ["r1", "r2"])
        self.assertEqual(f, [{"request_id": "r3", "block_ids": [5, 6], "reason": "peer gone"}])

    def test_status(self):
        self.assertEqual(self.c.status(), {"role": "decode", "in_flight": 3})

    def test_error_reply(self):
        with self.assertRaises(kc.ControlError) as cm:
            self.c.call({"op": "nope"})
        self.assertIn("unknown op", str(cm.exception))
        self.assertEqual(cm.exception.op, "nope")
        self.assertFalse(cm.exception.reply["ok"])
        self.assertEqual(self.c.status()["role"], "decode")  # still usable

    def test_raw_error_reply(self):
        with self.assertRaises(kc.ControlError) as cm:
            self.c.call({"op": "raw-error"})
        self.assertIn("bad envelope", cm.exception.message)
        self.assertIsNone(cm.exception.reply)

    def test_garbage_reply(self):
        with self.assertRaises(kc.ProtocolError):
            self.c.call({"op": "garbage"})
        self.assertEqual(self.c.abort([]), 0)

    def test_timeout_recreates_socket(self):
        c = kc.Client(self.ep, timeout_ms=200)
        try:
            t0 = time.monotonic()
            with self.assertRaises(kc.ControlTimeout):
                c.call({"op": "never"})
            self.assertLess(time.monotonic() - t0, 1.5)
            first = c._sock
            self.assertIsNone(first)  # discarded, not reused
            # A late reply to a timed-out call must not be taken for the
            # answer to the next one.
            with self.assertRaises(kc.ControlTimeout):
                c.call({"op": "sleep", "seconds": 0.4})
            time.sleep(0.5)
            self.assertEqual(c.abort(["known"]), 1)
            self.assertEqual(c.status()["role"], "decode")
        finally:
            c.close()

    def test_closed(self):
        self.c.close()
        with self.assertRaises(kc.KvflowError):
            self.c.status()

    def test_bad_arguments(self):
        with self.assertRaises(ValueError):
            kc.Client("/tmp/x")
        for bad in ("10", 0, -1, None, True, float("nan")):
            with self.assertRaisesRegex(ValueError, "timeout_ms must be a number > 0"):
                kc.Client("ipc:///tmp/x", timeout_ms=bad)
        with self.assertRaises(TypeError):
            self.c.load([{"request_id": "a", "local_block_ids": None, "kv_transfer_params": {}}])
        with self.assertRaisesRegex(TypeError, "delay_start_time of 'a' must be a number"):
            self.c.send([{"request_id": "a", "delay_start_time": "soon"}])

    def test_threads(self):
        errs = []

        def worker(i):
            try:
                for _ in range(20):
                    self.assertEqual(self.c.abort(["known%d" % i]), 1)
            except Exception as e:  # pragma: no cover
                errs.append(e)

        ts = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        self.assertEqual(errs, [])


# ---------------------------------------------------------------------------
# Cache files written the way hw/npu/header.go writes them.


def write_cache(path, dtype=1, flags=0, dims=(2, 3, 4, 2, 8, 0, 0, 0), corrupt=None,
                corrupt_after_crc=False):
    """Write a cache file as npu.CreateShm would (header, zero padding to
    the 2 MiB data offset, caches) and return its data size."""
    elem = kc.DTYPES[dtype][2]
    nl, nb, bs, heads, hd, rank, rope, idx = dims
    if flags & 2:
        widths = [rank, rope] + ([idx] if flags & 4 else [])
    else:
        widths = [heads * hd, heads * hd]
    size = 0
    for k in range(nl * len(widths)):
        size += (nb * bs * widths[k % len(widths)] * elem + 4095) // 4096 * 4096
    data_off = 2 << 20
    hdr = bytearray(132)
    hdr[0:8] = b"KVFLOWKV"
    struct.pack_into("<IIII", hdr, 8, 1, 128, dtype, flags)
    struct.pack_into("<8Q", hdr, 32, *dims)
    struct.pack_into("<4Q", hdr, 96, 4096, data_off, size, data_off + size)
    if corrupt and not corrupt_after_crc:
        corrupt(hdr)
    struct.pack_into("<I", hdr, 128, kc.crc32c(bytes(hdr[:128])))
    if corrupt and corrupt_after_crc:
        corrupt(hdr)
    with open(path, "wb") as f:
        f.write(hdr)
        f.truncate(data_off + size)
    return size


class CacheTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="kvfc")
        self.path = os.path.join(self.dir, "cache")

    def tearDown(self):
        shutil.rmtree(self.dir)

    def test_gqa(self):
        write_cache(self.path)
        with kc.attach_cache(self.path) as c:
            self.assertEqual((c.kind, c.dtype, c.num_layers, c.num_parts), ("gqa", "bf16", 2, 2))
            self.assertEqual(c[0, 0].shape, (3, 4, 2, 8))
            self.assertEqual(c[1, 1].dtype, np.dtype("<u2"))
            self.assertEqual(c.block_lens, [4 * 2 * 8 * 2])
            self.assertEqual(c.offsets, [0, 4096, 8192, 12288])
            c[1, 0][2, 3, 1, 7] = 0xBEEF
            c.block(0, 1, 1)[:] = 7
        with open(self.path, "rb") as f:
            data = f.read()
        off = (2 << 20) + 8192 + ((2 * 4 + 3) * 2 + 1) * 8 * 2 + 7 * 2
        self.assertEqual(struct.unpack_from("<H", data, off)[0], 0xBEEF)
        self.assertEqual(data[(2 << 20) + 4096 + 128:(2 << 20) + 4096 + 256], b"\x07\x00" * 64)

    def test_flat_mla_sparse(self):
        write_cache(self.path, dtype=2, flags=1)
        c = kc.attach_cache(self.path)
        self.assertEqual(c[0, 1].shape, (3, 4, 16))
        self.assertEqual(c[0, 1].dtype, np.float16)
        c.close()
        os.remove(self.path)
        write_cache(self.path, dtype=3, flags=2, dims=(1, 2, 4, 0, 0, 16, 8, 0))
        c = kc.attach_cache(self.path, writable=False)
        self.assertEqual([p.name for p in c.parts], ["kv_lora", "k_rope"])
        self.assertEqual(c[0, 0].shape, (2, 4, 1, 16))
        self.assertEqual(c[0, 1].shape, (2, 4, 1, 8))
        self.assertEqual(c.block_lens, [256, 128])
        with self.assertRaises(ValueError):
            c[0, 0][0] = 1
        c.close()
        os.remove(self.path)
        write_cache(self.path, dtype=5, flags=6, dims=(2, 2, 4, 0, 0, 16, 8, 4))
        c = kc.attach_cache(self.path)
        self.assertEqual(c.kind, "sparse")
        self.assertEqual(c[1, 2].shape, (2, 4, 1, 4))
        self.assertEqual(c[1, 2].dtype, np.uint8)
        c.close()

    def test_bad_files(self):
        cases = {
            "magic": lambda h: h.__setitem__(slice(0, 8), b"NOTKVFLO"),
            "version": lambda h: struct.pack_into("<I", h, 8, 2),
            "checksum": lambda h: h.__setitem__(40, h[40] ^ 1),
            "flags": lambda h: struct.pack_into("<I", h, 20, 8),
            "offset": lambda h: struct.pack_into("<Q", h, 104, 100),
            "dtype": lambda h: struct.pack_into("<I", h, 16, 9),
            "size": lambda h: struct.pack_into("<Q", h, 112, 4096),
        }
        for name, corrupt in cases.items():
            with self.subTest(name):
                p = os.path.join(self.dir, name)
                write_cache(p, corrupt=corrupt, corrupt_after_crc=name == "checksum")
                with self.assertRaises(kc.CacheFileError) as cm:
                    kc.attach_cache(p)
                self.assertIn(p, str(cm.exception))
        p = os.path.join(self.dir, "short")
        write_cache(p)
        with open(p, "r+b") as f:
            f.truncate(4 << 20)
        with self.assertRaisesRegex(kc.CacheFileError, "file is"):
            kc.attach_cache(p)
        with self.assertRaises(kc.CacheFileError):
            kc.attach_cache(self.dir)
        p = os.path.join(self.dir, "shape")
        write_cache(p, dims=(0, 3, 4, 2, 8, 0, 0, 0))
        with self.assertRaisesRegex(kc.CacheFileError, "num_layers"):
            kc.attach_cache(p)


if __name__ == "__main__":
    unittest.main()
