"""The cache-file writer (create_cache): its header is what hw/npu writes,
and a real kvflow serve attaches to it with cache mode shm_attach."""

import os
import struct
import unittest

import _util
from kvflow import client as kc
from kvflow.sidecar import Sidecar, SidecarError, free_port_base, worker_config


class WriterTest(unittest.TestCase):
    def setUp(self):
        self.dir = _util.shm_dir()

    def tearDown(self):
        _util.rmtree(self.dir)

    def test_header_fields(self):
        p = os.path.join(self.dir, "c")
        c = kc.create_cache(p, num_layers=3, num_blocks=5, block_size=4, dtype="torch.float16",
                            num_kv_heads=2, head_dim=8)
        with open(p, "rb") as f:
            b = f.read(132)
        self.assertEqual(b[:8], b"KVFLOWKV")
        self.assertEqual(struct.unpack_from("<IIII", b, 8), (1, 128, 2, 0))
        self.assertEqual(struct.unpack_from("<8Q", b, 32), (3, 5, 4, 2, 8, 0, 0, 0))
        # one block: 4 tokens x 2 heads x 8 x 2 bytes = 128; 5 blocks -> 640 -> aligned 4096
        self.assertEqual(struct.unpack_from("<4Q", b, 96), (4096, 2 << 20, 6 * 4096, (2 << 20) + 6 * 4096))
        self.assertEqual(struct.unpack_from("<I", b, 128)[0], kc.crc32c(b[:128]))
        self.assertEqual(os.path.getsize(p), (2 << 20) + 6 * 4096)
        self.assertEqual((c.kind, c.dtype, c.block_lens), ("gqa", "fp16", [128]))
        self.assertEqual(c[2, 1].shape, (5, 4, 2, 8))
        c.close()

    def test_mla_and_sparse(self):
        p = os.path.join(self.dir, "m")
        c = kc.create_cache(p, 2, 4, 8, "bf16", mla=True, kv_lora_rank=32, qk_rope_head_dim=8,
                            sparse=True, indexer_dim=16)
        self.assertEqual((c.kind, c.num_parts, c.block_lens), ("sparse", 3, [512, 128, 256]))
        c.close()

    def test_bad_input(self):
        cases = [
            (dict(dtype="fp64", num_kv_heads=2, head_dim=8), "unknown cache dtype"),
            (dict(dtype="bf16", num_kv_heads=0, head_dim=8), "heads 0"),
            (dict(dtype="bf16", sparse=True, mla=False, num_kv_heads=1, head_dim=8), "sparse without MLA"),
        ]
        for kw, want in cases:
            with self.subTest(want=want):
                with self.assertRaisesRegex(kc.CacheFileError, want):
                    kc.create_cache(os.path.join(self.dir, "bad"), 2, 4, 4, **kw)
                self.assertFalse(os.path.exists(os.path.join(self.dir, "bad")))

    def test_existing_file_untouched(self):
        p = os.path.join(self.dir, "x")
        with open(p, "wb") as f:
            f.write(b"mine")
        with self.assertRaises(FileExistsError):
            kc.create_cache(p, 1, 1, 1, "fp32", num_kv_heads=1, head_dim=1)
        with open(p, "rb") as f:
            self.assertEqual(f.read(), b"mine")
        self.assertEqual(os.listdir(self.dir), ["x"])


class ServeAttachTest(unittest.TestCase):
    """A real kvflow serve, cache.mode shm_attach, on a Python-made file."""

    def setUp(self):
        _util.kvflow_bin(self)
        self.dir = _util.shm_dir()

    def tearDown(self):
        _util.rmtree(self.dir)

    def cfg(self, role, path, model):
        par = {"tp_size": 2, "dp_size": 1}
        return worker_config(role, "e-" + role, free_port_base(1), par, par, model, {"tp": 1}, path,
                             "ipc://" + os.path.join(self.dir, role + ".sock"))

    def test_attaches(self):
        for role, dtype in (("prefill", "bf16"), ("decode", "fp16")):
            with self.subTest(role=role):
                model = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "block_size": 4, "dtype": dtype,
                         "num_blocks": 16}
                path = os.path.join(self.dir, role + ".kv")
                # TP 2: this rank holds 2 of the model's 4 KV heads.
                c = kc.create_cache(path, 2, 16, 4, dtype, num_kv_heads=2, head_dim=8)
                c[1, 1][3] = 7
                s = Sidecar.launch(self.cfg(role, path, model), self.dir, role)
                try:
                    self.assertIn("kvflow ready role=" + role, s.ready_line)
                    self.assertEqual(s.client.status()["role"], role)
                finally:
                    self.assertEqual(s.stop(), 0)
                # kvflow wrote nothing to it.
                self.assertTrue((c[1, 1][3] == 7).all())
                self.assertTrue((c[0, 0] == 0).all())
                c.close()

    def test_shape_mismatch_rejected(self):
        model = {"num_layers": 2, "num_kv_heads": 4, "head_dim": 8, "block_size": 4, "dtype": "bf16",
                 "num_blocks": 16}
        path = os.path.join(self.dir, "p.kv")
        kc.create_cache(path, 2, 16, 4, "bf16", num_kv_heads=4, head_dim=8).close()  # 4 heads, not 2
        with self.assertRaisesRegex(SidecarError, "status 2"):
            Sidecar.launch(self.cfg("prefill", path, model), self.dir, "p")


if __name__ == "__main__":
    unittest.main()
