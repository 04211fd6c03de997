"""The proof by computation: the tiny engine's disaggregated run (prefill
TP p -> kvflow serve sidecars -> decode TP d, driven through
KvflowConnector in vLLM's call order) generates exactly the monolith's
tokens, also for decode TP above prefill TP and decode PP
(TinyTopologyTest); a failed transfer is recomputed to the same tokens; a
broken stitch (two heads swapped after the transfer) or a wrong head slice
does not."""

import json
import os
import signal
import time
import unittest

import _util

try:
    import torch  # noqa: F401
except ImportError:  # pragma: no cover
    torch = None

if torch is not None:
    from kvflow.tiny.model import TinyConfig, TinyModel
    from kvflow.tiny.run import Pair, monolith, prompts

MAX_TOKENS = 6


def setUpModule():
    if torch is None:
        raise unittest.SkipTest("torch not importable (apt-get install python3-torch)")
    _util.kvflow_bin(None)


class TinyTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        cls.model = TinyModel(TinyConfig(seed=1234))
        cls.ps = prompts(2, 11, cls.model.cfg.vocab, seed=3)  # 11 tokens: 2 full blocks + 3
        cls.want = {dt: monolith(cls.model, dt, cls.ps, MAX_TOKENS) for dt in ("bf16", "fp16")}

    def disagg(self, p, d, dtype="bf16", **kw):
        got, infos = [], []
        with Pair(self.model, p, d, dtype=dtype, **kw) as pair:
            for i, pr in enumerate(self.ps):
                toks, info = pair.run("req-%d-%d-%d" % (p, d, i), pr, MAX_TOKENS)
                got.append(toks)
                infos.append(info)
                self.assertEqual(info["prefill_first_token"], toks[0])
            self.assertEqual(pair.prefill._held, {}, "prefill blocks not freed")
        return got, infos

    def test_topologies(self):
        cases = [
            ("TP 1->1 bf16", 1, 1, "bf16", {}),
            ("TP 2->1 bf16", 2, 1, "bf16", {}),
            ("TP 4->2 bf16", 4, 2, "bf16", {}),
            ("TP 4->2 fp16", 4, 2, "fp16", {}),
            ("TP 2->2 fp16", 2, 2, "fp16", {}),
            ("TP 4->2 bf16, prefill read grants (send carries the block ids)", 4, 2, "bf16",
             {"kvflow_opts": {"sidecar": {"read": {"grants": True}}}}),
            ("TP 2->1 fp16, device caches through the host buffer", 2, 1, "fp16",
             {"decode_zero_copy": False, "prefill_zero_copy": False}),
        ]
        for name, p, d, dt, kw in cases:
            with self.subTest(name):
                got, infos = self.disagg(p, d, dt, **kw)
                self.assertTrue(all(i["loaded"] for i in infos), infos)
                self.assertEqual(got, self.want[dt])

    def test_prefix_hit(self):
        m = self.model
        ps = prompts(2, 14, m.cfg.vocab, seed=5, shared_prefix=9)  # 2 shared full blocks
        want = monolith(m, "bf16", ps, MAX_TOKENS)
        with Pair(m, 2, 1, prefix_caching=True) as pair:
            got = []
            for i, pr in enumerate(ps):
                toks, info = pair.run("pfx-%d" % i, pr, MAX_TOKENS)
                got.append(toks)
                self.assertTrue(info["loaded"])
                self.assertEqual(info["prefix_hit_blocks"], 0 if i == 0 else 2)
        self.assertEqual(got, want)

    def test_failed_transfer_recomputes(self):
        def other_boot(p):
            # The prefill's scheduler handed over both ranks' sidecar boot
            # epochs; the same request "from before a restart" (another
            # epoch for rank 1) is refused by the decode, nothing read.
            e = p["kvflow_boot_epochs"]
            self.assertEqual(len(e), 2)
            self.assertTrue(all(v > 1_500_000_000 * 10**9 for v in e), e)
            return dict(p, kvflow_boot_epochs=[e[0], e[1] - 1])

        cases = [
            ("remote blocks out of range", lambda p: dict(p, remote_block_ids=[900 + b for b in p["remote_block_ids"]])),
            ("wrong remote engine", lambda p: dict(p, remote_engine_id="not-the-prefill")),
            ("prefill restarted since (kvflow_boot_epochs)", other_boot),
        ]
        with Pair(self.model, 2, 1) as pair:
            for name, f in cases:
                with self.subTest(name):
                    toks, info = pair.run("fail-" + name[:5], self.ps[0], MAX_TOKENS, tamper_params=f)
                    self.assertTrue(info["failed"])
                    self.assertEqual(toks, self.want["bf16"][0])

    def test_broken_stitch_is_caught(self):
        """Swap KV heads 0 and 1 of the pulled blocks on the decode rank:
        the tokens must differ (the equality tests would see a bad stitch)."""

        def swap(inst, req):
            for layer in inst.caches[0]:
                for t in layer:
                    for b in req.block_ids:
                        t[b, :, [0, 1]] = t[b, :, [1, 0]]

        with Pair(self.model, 2, 1) as pair:
            toks, info = pair.run("swap", self.ps[0], MAX_TOKENS, after_load=swap)
            self.assertTrue(info["loaded"])
            self.assertNotEqual(toks, self.want["bf16"][0])

    def test_mla(self):
        """MLA-shaped caches (a latent and a rotary-key part of one head,
        replicated over TP: kvflow pulls each decode rank's copy from one
        prefill rank)."""
        m = TinyModel(TinyConfig(seed=99, mla=True))
        want = {dt: monolith(m, dt, self.ps, MAX_TOKENS) for dt in ("bf16", "fp16")}
        cases = [("TP 1->1 bf16", 1, 1, "bf16", {}), ("TP 4->2 fp16", 4, 2, "fp16", {}),
                 ("TP 2->2 bf16, host buffer", 2, 2, "bf16", {"decode_zero_copy": False})]
        for name, p, d, dt, kw in cases:
            with self.subTest(name):
                with Pair(m, p, d, dtype=dt, **kw) as pair:
                    for i, pr in enumerate(self.ps):
                        toks, info = pair.run("mla-%d-%d-%d" % (p, d, i), pr, MAX_TOKENS)
                        self.assertTrue(info["loaded"])
                        self.assertEqual(toks, want[dt][i])

        def corrupt(inst, req):  # the last decode rank's latent of the first block
            for lat, _ in inst.caches[-1]:
                lat[req.block_ids[0]] = 0

        with self.subTest("corrupted latent on decode rank 1 is caught"):
            with Pair(m, 2, 2) as pair:
                toks, info = pair.run("mla-bad", self.ps[0], MAX_TOKENS, after_load=corrupt)
                self.assertTrue(info["loaded"])
                self.assertNotEqual(toks, want["bf16"][0])

    def test_sidecar_death_and_hang_become_load_errors(self):
        """The decode sidecar is killed (or stopped) while a load is in
        flight (the prefill sidecar is frozen, so the load cannot end):
        within the control timeout the load is a load error, the request is
        recomputed, the tokens are the monolith's."""
        for how in ("SIGKILL", "SIGSTOP"):
            with self.subTest(how):
                with Pair(self.model, 1, 1, kvflow_opts={"control_timeout_ms": 1500}) as pair:
                    first, params = pair.prefill.prefill("dead", self.ps[1])
                    psc = pair.prefill.connectors[0].sidecar
                    dsc = pair.decode.connectors[0].sidecar
                    os.kill(psc.proc.pid, signal.SIGSTOP)
                    steps = []

                    def on_step(inst):
                        steps.append(1)
                        if len(steps) == 2:  # the load is in flight
                            os.kill(dsc.proc.pid, getattr(signal, how))

                    try:
                        toks = pair.decode.decode("dead", self.ps[1], params, MAX_TOKENS, on_step=on_step,
                                                  timeout=20)
                    finally:
                        os.kill(psc.proc.pid, signal.SIGCONT)
                        if how == "SIGSTOP":
                            os.kill(dsc.proc.pid, signal.SIGCONT)
                    self.assertTrue(pair.decode.last["failed"])
                    self.assertEqual(toks, self.want["bf16"][1])
                    self.assertIsNotNone(pair.decode.connectors[0]._dead)

    def test_abort_while_loading(self):
        """vLLM aborts a decode request whose pull is in flight: the
        connector passes the abort to its sidecar, never reports the
        request (vLLM already freed it), reports no load error, and the
        prefill still gets its DONE and frees the blocks."""
        from kvflow.tiny.engine import Blocks, Request

        with Pair(self.model, 1, 1) as pair:
            first, params = pair.prefill.prefill("ab", self.ps[0])
            psc = pair.prefill.connectors[0].sidecar
            dec = pair.decode
            os.kill(psc.proc.pid, signal.SIGSTOP)
            try:
                req = Request("ab", self.ps[0], MAX_TOKENS, dict(params))
                n, is_async = dec.scheduler.get_num_new_matched_tokens(req, 0)
                blocks = dec._alloc(dec._blocks_for(n))
                dec.scheduler.update_state_after_alloc(req, Blocks(blocks), n)
                dec._reset_counts()
                dec._step()  # the load goes to the sidecar
                self.assertIn("ab", dec.connectors[0]._loading)
                req.status = "FINISHED_ABORTED"
                self.assertEqual(dec.scheduler.request_finished(req, blocks), (False, None))
                dec._step()  # the abort goes to the sidecar
                self.assertNotIn("ab", dec.connectors[0]._loading)
            finally:
                os.kill(psc.proc.pid, signal.SIGCONT)
            deadline = time.monotonic() + 15
            while (pair.prefill._held or dec.connectors[0]._aborted) and time.monotonic() < deadline:
                dec._step()
                pair.prefill.poll()
                time.sleep(0.005)
            self.assertEqual(pair.prefill._held, {}, "prefill blocks not freed after the abort")
            self.assertNotIn("ab", dec._recvd)
            self.assertEqual(dec._errors, set())
            self.assertEqual(dec.connectors[0]._aborted, set(), "the aborted load's end was not collected")


class TinyTopologyTest(unittest.TestCase):
    """kvflow ↔ kvflow topologies the seed has not: decode TP above prefill
    TP (each decode rank reads a head slice of one prefill rank's blocks;
    replicated heads when TP exceeds them; MLA's latent from one prefill
    rank) and decode PP (each stage reads only its layers). Tokens must be
    the monolith's, every load a real transfer (no recompute)."""

    @classmethod
    def setUpClass(cls):
        cls.models = {"gqa": TinyModel(TinyConfig(seed=1234)),                      # 8 q heads, 4 KV heads
                      "kv2": TinyModel(TinyConfig(seed=77, kv_heads=2)),            # 2 KV heads
                      "mla": TinyModel(TinyConfig(seed=99, mla=True)),
                      "pp": TinyModel(TinyConfig(seed=4321, layers=3))}             # 3 layers: stages of 2 + 1
        cls.ps = prompts(2, 11, 96, seed=3)
        cls.want = {(m, dt): monolith(cls.models[m], dt, cls.ps, MAX_TOKENS)
                    for m, dt in (("gqa", "bf16"), ("gqa", "fp16"), ("kv2", "bf16"), ("mla", "bf16"), ("pp", "bf16"))}

    def run_pair(self, m, p, d, dtype="bf16", after_load=None, check=None, **kw):
        got = []
        with Pair(self.models[m], p, d, dtype=dtype, **kw) as pair:
            if check is not None:
                check(pair)
            for i, pr in enumerate(self.ps):
                toks, info = pair.run("%s-%d-%d-%d" % (m, p, d, i), pr, MAX_TOKENS, after_load=after_load)
                self.assertTrue(info["loaded"], "load failed and was recomputed: %s" % (info,))
                self.assertEqual(info["prefill_first_token"], toks[0])
                got.append(toks)
            self.assertEqual(pair.prefill._held, {}, "prefill blocks not freed")
        return got

    def test_decode_tp_above_prefill_tp(self):
        cases = [
            ("GQA TP 1->2 bf16", "gqa", 1, 2, "bf16"),
            ("GQA TP 1->2 fp16", "gqa", 1, 2, "fp16"),
            ("GQA TP 2->4 bf16", "gqa", 2, 4, "bf16"),
            ("2 KV heads, TP 2->4 bf16 (replicated: decode ranks 0, 1 hold head 0)", "kv2", 2, 4, "bf16"),
            ("2 KV heads, TP 1->4 bf16 (replicated, head slices of one prefill rank)", "kv2", 1, 4, "bf16"),
            ("MLA TP 1->2 bf16", "mla", 1, 2, "bf16"),
        ]
        for name, m, p, d, dt in cases:
            with self.subTest(name):
                self.assertEqual(self.run_pair(m, p, d, dt), self.want[(m, dt)])

    def test_decode_pp(self):
        def stages(ranges, part):
            def check(pair):
                dec = pair.decode
                self.assertEqual(dec.layer_ranges, ranges)
                for w, conn in enumerate(dec.connectors):
                    s = w // dec.tp
                    self.assertEqual(len(dec.caches[w]), ranges[s][1] - ranges[s][0])
                    with open(conn.sidecar.config_path) as f:
                        cfg = json.load(f)
                    self.assertEqual(cfg["rank"]["pp"], s)
                    self.assertEqual(cfg["kv_transfer_config"]["kv_connector_extra_config"]["decode"]["pp_size"], 2)
                    self.assertEqual(cfg["model"].get("decode_pp_layer_partition"), part)
                with open(pair.prefill.connectors[0].sidecar.config_path) as f:
                    cfg = json.load(f)
                self.assertEqual(cfg["kv_transfer_config"]["kv_connector_extra_config"]["decode"]["pp_size"], 2)
                self.assertEqual(cfg["model"].get("decode_pp_layer_partition"), part)
            return check

        cases = [
            ("prefill TP 1 PP 1 -> decode TP 1 PP 2 (layers 2 + 1)", 1, 1, None, [(0, 2), (2, 3)]),
            ("prefill TP 2 -> decode TP 2 PP 2, partition 1,2", 2, 2, "1,2", [(0, 1), (1, 3)]),
            ("prefill TP 1 -> decode TP 2 PP 2 (head slices per stage)", 1, 2, None, [(0, 2), (2, 3)]),
            ("prefill TP 1 PP 2 (layers 1 + 2) -> decode TP 1 PP 2 (layers 2 + 1)", 1, 1, None, [(0, 2), (2, 3)],
             {"prefill_pp": 2, "prefill_pp_layer_partition": "1,2"}),
        ]
        for name, p, d, part, ranges, *kw in cases:
            with self.subTest(name):
                got = self.run_pair("pp", p, d, decode_pp=2, decode_pp_layer_partition=part,
                                    check=stages(ranges, part), **(kw[0] if kw else {}))
                self.assertEqual(got, self.want[("pp", "bf16")])

    def test_wrong_head_slice_is_caught(self):
        """One decode rank given another rank's head slice after the load
        (what a planner bug choosing the wrong slice would leave): the
        tokens differ from the monolith's."""

        def copy_rank(src, dst):
            def f(inst, req):
                for ls, ld in zip(inst.caches[src], inst.caches[dst]):
                    for ts, td in zip(ls, ld):
                        td[req.block_ids] = ts[req.block_ids]
            return f

        cases = [("GQA TP 2->4: rank 1 holds head 0 instead of 1", "gqa", 2, 4, copy_rank(0, 1)),
                 ("2 KV heads, TP 2->4: rank 2 holds head 0 instead of 1", "kv2", 2, 4, copy_rank(0, 2))]
        for name, m, p, d, f in cases:
            with self.subTest(name):
                with Pair(self.models[m], p, d) as pair:
                    toks, info = pair.run("bad-%s" % m, self.ps[0], MAX_TOKENS, after_load=f)
                    self.assertTrue(info["loaded"])
                    self.assertNotEqual(toks, self.want[(m, "bf16")][0])


if __name__ == "__main__":
    unittest.main()
