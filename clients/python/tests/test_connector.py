"""KvflowConnector's worker side on bad input: an inconsistent vLLM config
fails at register_kv_caches with a message naming the problem, before any
sidecar is started."""

import os
import types
import unittest

import _util

try:
    import torch
except ImportError:  # pragma: no cover
    torch = None


def vcfg(tp=2, kv_heads=4, layers=2, block_size=4, extra=None, buf="cpu", cache_dtype="auto", pp=1, pp_rank=0,
         opts=None):
    ex = {"prefill": {"tp_size": tp, "dp_size": 1, "pp_size": pp}, "decode": {"tp_size": 1, "dp_size": 1},
          "kvflow": dict({"tp_rank": 0, "pp_rank": pp_rank, "host": "127.0.0.1"}, **(opts or {}))}
    if extra is not None:
        ex = extra
    return types.SimpleNamespace(
        kv_transfer_config=types.SimpleNamespace(engine_id="e", kv_role="kv_producer", kv_port=20000,
                                                 kv_buffer_device=buf, kv_connector_extra_config=ex),
        parallel_config=types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                              data_parallel_size=1, data_parallel_rank=0),
        cache_config=types.SimpleNamespace(block_size=block_size, cache_dtype=cache_dtype),
        model_config=types.SimpleNamespace(hf_config=types.SimpleNamespace(num_hidden_layers=layers,
                                                                           num_key_value_heads=kv_heads)))


def caches(layers=2, heads=2, dtype=None, block_size=4, flash=False):
    dtype = dtype or torch.bfloat16
    out = {}
    for i in range(layers):
        if flash:
            out["l%d" % i] = torch.zeros(2, 8, block_size, heads, 16, dtype=dtype)
        else:
            out["l%d" % i] = (torch.zeros(8, block_size, heads, 16, dtype=dtype),
                              torch.zeros(8, block_size, heads, 16, dtype=dtype))
    return out


def mla_cfg(kv_lora_rank=32):
    c = vcfg(tp=2, kv_heads=1)
    c.model_config.use_mla = True
    c.model_config.hf_config.kv_lora_rank = kv_lora_rank
    c.model_config.hf_config.qk_rope_head_dim = 8
    return c


def kv_both():
    c = vcfg()
    c.kv_transfer_config.kv_role = "kv_both"
    return c


def mla_caches():
    return {"l%d" % i: (torch.zeros(8, 4, 1, 32, dtype=torch.bfloat16), torch.zeros(8, 4, 1, 8, dtype=torch.bfloat16))
            for i in range(2)}


class BadConfigTest(unittest.TestCase):
    def setUp(self):
        if torch is None:
            self.skipTest("torch not importable")

    def test_register_rejects(self):
        from kvflow.vllm import ConfigError, KVConnectorRole, KvflowConnector

        cases = [
            ("heads not divisible by TP", vcfg(tp=2, kv_heads=3), caches(heads=1),
             "3 KV heads are not divisible by tensor_parallel_size 2"),
            ("TP not a multiple of heads", vcfg(tp=4, kv_heads=3), caches(heads=1),
             "tensor_parallel_size 4 is not a multiple of 3 KV heads"),
            ("unknown dtype", vcfg(), caches(dtype=torch.float64), "unknown cache dtype torch.float64"),
            ("unknown cache_dtype", vcfg(cache_dtype="fp4"), caches(), "unknown cache_config.cache_dtype 'fp4'"),
            ("heads disagree with the model", vcfg(tp=2, kv_heads=8), caches(heads=2),
             "cache tensors hold 2 KV heads, the model has 8 over TP 2 \\(want 4\\)"),
            ("layers disagree", vcfg(layers=3), caches(), "2 cache layers, model has 3"),
            ("replicated heads: TP 4 over 2 KV heads holds one", vcfg(tp=4, kv_heads=2), caches(heads=2),
             "cache tensors hold 2 KV heads, the model has 2 over TP 4 \\(want 1, head 0 replicated over 2 ranks\\)"),
            ("PP stage holds other layers", vcfg(layers=3, pp=2, pp_rank=1), caches(layers=2),
             "2 cache layers, PP stage 1 of 2 holds layers \\[2, 3\\) of 3"),
            ("PP stage layers under a partition", vcfg(layers=3, pp=2, pp_rank=1, opts={"pp_layer_partition": "2,1"}),
             caches(layers=2), "PP stage 1 of 2 holds layers \\[2, 3\\) of 3 \\(partition 2,1\\)"),
            ("bad partition", vcfg(layers=3, pp=2, opts={"pp_layer_partition": "1,1"}), caches(layers=1),
             "partitions in '1,1' sum to 2, not num_hidden_layers 3"),
            ("pp_size in the extra config disagrees with parallel_config",
             vcfg(pp=2, extra={"prefill": {"tp_size": 2, "dp_size": 1, "pp_size": 1},
                               "decode": {"tp_size": 1, "dp_size": 1}, "kvflow": {"tp_rank": 0}}),
             caches(layers=1), "kv_connector_extra_config.prefill.pp_size is 1, this instance's parallel_config "
                               "says 2"),
            ("block size disagrees", vcfg(block_size=16), caches(), "cache block size 4, cache_config.block_size 16"),
            ("not a cache tensor", vcfg(), {"l0": torch.zeros(3, 3)}, "want a \\(k, v\\) pair"),
            ("device caches without a host buffer", vcfg(buf="cuda"), caches(flash=True),
             "kv_buffer_device is 'cuda'"),
            ("MLA: latent width disagrees with the model", mla_cfg(kv_lora_rank=16), mla_caches(),
             "cache kv_lora_rank 32, model_config.hf_config.kv_lora_rank 16"),
            ("MLA: a GQA-shaped cache", mla_cfg(), caches(), "MLA cache parts hold 2 and 2 heads, want 1"),
            ("kv_both", kv_both(), caches(), "kv_role 'kv_both': kvflow runs kv_producer"),
            ("missing prefill/decode layout", vcfg(extra={"kvflow": {"tp_rank": 0}}), caches(),
             "kv_connector_extra_config.prefill needs tp_size and dp_size"),
        ]
        for name, cfg, kv, want in cases:
            with self.subTest(name):
                c = KvflowConnector(cfg, KVConnectorRole.WORKER)
                with self.assertRaisesRegex(ConfigError, want):
                    c.register_kv_caches(kv)
                self.assertIsNone(c.sidecar)
                c.shutdown()

    def test_scheduler_side_params(self):
        from kvflow.vllm import KVConnectorRole, KvflowConnector

        c = KvflowConnector(vcfg(), KVConnectorRole.SCHEDULER)
        req = types.SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                                    status="FINISHED_LENGTH_CAPPED", output_token_ids=[9], prompt_token_ids=[1])
        delay, p = c.request_finished(req, [3, 4])
        self.assertEqual((delay, p["remote_port"], p["remote_host"], p["remote_engine_id"]),
                         (True, 20000, "127.0.0.1", "e"))
        m = c.build_connector_meta(None)
        self.assertEqual(list(m.requests_to_send), ["r"])
        self.assertEqual(m.send_block_ids, {"r": [3, 4]})

    def test_boot_epochs_from_workers(self):
        """Each prefill worker's get_handshake_metadata carries its
        sidecar's boot epoch; the scheduler side (set_xfer_handshake_metadata,
        as vLLM calls it with {tp_rank: metadata}) hands them over in
        every kv_transfer_params as kvflow_boot_epochs, 0 for a rank that
        sent none; ill-formed metadata is ignored."""
        from kvflow.vllm import KVConnectorRole, KvflowConnector, KvflowHandshakeMetadata

        epochs = {0: 1764870000000000001, 1: 1764870000000000002}
        mds = {}
        for tp in (0, 1):
            w = KvflowConnector(vcfg(opts={"tp_rank": tp}), KVConnectorRole.WORKER)
            self.assertIsNone(w.get_handshake_metadata())  # before register_kv_caches
            w.sidecar = types.SimpleNamespace(client=types.SimpleNamespace(
                status=lambda tp=tp: {"role": "prefill", "boot_epoch": epochs[tp]}))
            mds[tp] = w.get_handshake_metadata()
            self.assertEqual((mds[tp].tp_rank, mds[tp].pp_rank, mds[tp].boot_epoch), (tp, 0, epochs[tp]))
        req = types.SimpleNamespace(request_id="r", kv_transfer_params={"do_remote_decode": True},
                                    status="FINISHED_LENGTH_CAPPED", output_token_ids=[9], prompt_token_ids=[1])
        cases = [("both ranks", mds, [epochs[0], epochs[1]]),
                 ("one rank", {1: mds[1]}, [0, epochs[1]]),
                 ("ill-formed ignored", {0: KvflowHandshakeMetadata(0, 0, "x"), 1: mds[1], 2: object()}, [0, epochs[1]]),
                 ("none", {}, None)]
        for name, md, want in cases:
            with self.subTest(name):
                c = KvflowConnector(vcfg(), KVConnectorRole.SCHEDULER)
                if name.startswith("ill-formed"):
                    with self.assertLogs("kvflow", "WARNING") as logs:
                        c.set_xfer_handshake_metadata(md)
                    self.assertEqual(len(logs.output), 2, logs.output)
                else:
                    c.set_xfer_handshake_metadata(md)
                _, p = c.request_finished(types.SimpleNamespace(**vars(req)), [3])
                self.assertEqual(p.get("kvflow_boot_epochs"), want)
        d = KvflowConnector(vcfg(), KVConnectorRole.WORKER)
        d.kv_role = "kv_consumer"
        d.sidecar = types.SimpleNamespace(client=types.SimpleNamespace(status=lambda: {"boot_epoch": 5}))
        self.assertIsNone(d.get_handshake_metadata())  # a decode worker hands over nothing

    def test_malformed_params_fail_alone(self):
        """kv_transfer_params from the router with a wrong type (a port that
        is no number, block ids that are a string) fail that request alone
        as a load error naming the field: start_load_kv does not raise, the
        other requests of the step are still loaded."""
        from kvflow.scheduler import SchedulerRules
        from kvflow.vllm import KVConnectorRole, KvflowConnector, KvflowMetadata

        class Blocks:
            def __init__(self, ids):
                self.ids = ids

            def get_unhashed_block_ids(self):
                return self.ids

        class FakeClient:
            def __init__(self):
                self.loads = []

            def load(self, reqs):
                self.loads.append(reqs)
                return [None] * len(reqs)

            def finished(self):
                return [], [], []

        fake = types.SimpleNamespace(client=FakeClient(), alive=lambda: True, control="fake", proc=None)
        good = {"remote_block_ids": [1, 2], "remote_engine_id": "p", "remote_host": "127.0.0.1",
                "remote_port": 20001}
        bad = [("port", dict(good, remote_port="zz"), "kv_transfer_params.remote_port is 'zz', want an int"),
               ("blocks", dict(good, remote_block_ids="abc"), "remote_block_ids is 'abc', want a list of ints"),
               ("block", dict(good, remote_block_ids=[1, 2.5]), "remote_block_ids\\[1\\] is 2.5, want an int"),
               ("host", dict(good, remote_host=None), "remote_host is None, want a non-empty string"),
               ("epochs", dict(good, kvflow_boot_epochs="1764870000123456789"),
                "kv_transfer_params.kvflow_boot_epochs is '1764870000123456789', want a list of ints"),
               ("epoch", dict(good, kvflow_boot_epochs=[-3]),
                "kv_transfer_params.kvflow_boot_epochs\\[0\\] is -3, want a boot epoch")]
        rules = SchedulerRules("d", "127.0.0.1", 30000, 4)
        reqs = [("ok", good, [7, 8]), ("ok-epochs", dict(good, kvflow_boot_epochs=[1764870000123456789]), [9])] + [
            ("bad-" + n, p, [10 + i]) for i, (n, p, _) in enumerate(bad)]
        for rid, params, local in reqs:
            r = types.SimpleNamespace(request_id=rid, prompt_token_ids=[0] * 8,
                                      kv_transfer_params=dict(params, do_remote_prefill=True))
            n, _ = rules.get_num_new_matched_tokens(r, 0)
            rules.update_state_after_alloc(r, Blocks(local), n)
        m = rules.build_connector_meta()
        meta = KvflowMetadata()
        meta.requests = m.requests
        c = KvflowConnector(vcfg(), KVConnectorRole.WORKER)
        c.sidecar = fake
        c.bind_connector_metadata(meta)
        with self.assertLogs("kvflow", "WARNING") as logs:
            c.start_load_kv(None)
        self.assertEqual([[r["request_id"] for r in call] for call in fake.client.loads], [["ok", "ok-epochs"]])
        sent = {r["request_id"]: r["kv_transfer_params"] for r in fake.client.loads[0]}
        self.assertNotIn("kvflow_boot_epochs", sent["ok"])  # the seed's params stay the seed's
        self.assertEqual(sent["ok-epochs"]["kvflow_boot_epochs"], [1764870000123456789])
        for (_, _, want) in bad:
            self.assertTrue(any(__import__("re").search(want, line) for line in logs.output), (want, logs.output))
        _, recving = c.get_finished(set())
        self.assertEqual(recving, {"bad-" + n for n, _, _ in bad})
        self.assertEqual(c.get_block_ids_with_load_errors(), set(range(10, 10 + len(bad))))
        self.assertIn("ok", c._loading)


class HostBufferTest(unittest.TestCase):
    """vLLM's FlashAttention layout ([2, blocks, block_size, heads,
    head_dim] per layer, not in a kvflow file): the connector creates the
    rank's cache file, starts a real kvflow serve on it, and copies blocks
    between the file and the engine's tensors."""

    def setUp(self):
        if torch is None:
            self.skipTest("torch not importable")
        _util.kvflow_bin(self)
        self.dir = _util.shm_dir()

    def tearDown(self):
        _util.rmtree(self.dir)

    def test_flash_layout_copies(self):
        from kvflow.vllm import KVConnectorRole, KvflowConnector

        ex = {"prefill": {"tp_size": 1, "dp_size": 1}, "decode": {"tp_size": 1, "dp_size": 1},
              "kvflow": {"tp_rank": 0, "host": "127.0.0.1", "workdir": self.dir, "shm_dir": self.dir}}
        cfg = vcfg(tp=1, kv_heads=2, extra=ex)
        cfg.kv_transfer_config.kv_role = "kv_consumer"
        kv = caches(heads=2, dtype=torch.float16, flash=True)
        c = KvflowConnector(cfg, KVConnectorRole.WORKER)
        try:
            c.register_kv_caches(kv)
            self.assertEqual(c.sidecar.client.status()["role"], "decode")
            self.assertEqual((c.cache.num_layers, c.cache.num_kv_heads, c.cache.dtype), (2, 2, "fp16"))
            c._file[1][1][3] = 5.0          # as if kvflow landed block 3 of layer 1's V
            c._copy_from_file([3])
            self.assertTrue((kv["l1"][1][3] == 5.0).all())
            self.assertTrue((kv["l1"][1][2] == 0).all())
            kv["l0"][0][6] = 2.0            # the engine computed block 6 of layer 0's K
            c._copy_to_file([6])
            self.assertTrue((c._file[0][0][6] == 2.0).all())
            path = c.cache.path
        finally:
            c.shutdown()
        self.assertFalse(os.path.exists(path))

    def test_attach_to_running_sidecar(self):
        """kvflow.control set: the connector attaches to a sidecar started
        by someone else (on the engine's cache file: zero-copy) and leaves
        it running at shutdown."""
        from kvflow import client as kc
        from kvflow.sidecar import Sidecar, free_port_base, worker_config
        from kvflow.vllm import KVConnectorRole, KvflowConnector, cache_tensors

        path = os.path.join(self.dir, "p0.kv")
        cache = kc.create_cache(path, 2, 8, 4, "bf16", num_kv_heads=2, head_dim=16)
        par = {"tp_size": 1, "dp_size": 1}
        model = {"num_layers": 2, "num_kv_heads": 2, "head_dim": 16, "block_size": 4, "dtype": "bf16", "num_blocks": 8}
        ep = "ipc://" + os.path.join(self.dir, "p-tp0.sock")
        sc = Sidecar.launch(worker_config("prefill", "e", free_port_base(1), par, par, model, {"tp": 0}, path, ep),
                            self.dir, "p0")
        try:
            ex = {"prefill": par, "decode": par,
                  "kvflow": {"tp_rank": 0, "control": "ipc://" + os.path.join(self.dir, "p-tp{tp}.sock")}}
            cfg = vcfg(tp=1, kv_heads=2, extra=ex)
            t = cache_tensors(cache)
            c = KvflowConnector(cfg, KVConnectorRole.WORKER)
            c.register_kv_caches({"l%d" % i: (t[i][0], t[i][1]) for i in range(2)})
            self.assertIs(c.cache, cache)              # zero-copy: the engine's own mapping
            self.assertIsNone(c._device_caches)
            self.assertEqual(c.sidecar.client.status()["role"], "prefill")
            md = c.get_handshake_metadata()  # the real sidecar's boot epoch, for kvflow_boot_epochs
            self.assertEqual((md.tp_rank, md.pp_rank), (0, 0))
            self.assertEqual(md.boot_epoch, sc.client.status()["boot_epoch"])
            self.assertGreater(md.boot_epoch, 1_500_000_000 * 10**9)  # its start, in unix nanoseconds
            c.shutdown()
            self.assertTrue(sc.alive())
            self.assertTrue(os.path.exists(path))
        finally:
            self.assertEqual(sc.stop(), 0)
            cache.close()


if __name__ == "__main__":
    _util  # noqa: B018
    unittest.main()
