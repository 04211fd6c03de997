"""kvflow.scheduler: the seed's scheduler rules, case by case, and the
cases kvflow handles differently (module docstring, 1-3)."""

import enum
import unittest

import _util  # noqa: F401
from kvflow.scheduler import SchedulerRules


class Status(enum.Enum):  # vLLM's RequestStatus names
    RUNNING = 2
    FINISHED_STOPPED = 6
    FINISHED_LENGTH_CAPPED = 7
    FINISHED_ABORTED = 8


class Req:
    def __init__(self, rid, params, prompt=10, out=(42,), status=Status.RUNNING):
        self.request_id = rid
        self.kv_transfer_params = params
        self.prompt_token_ids = list(range(prompt))
        self.output_token_ids = list(out)
        self.status = status


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_unhashed_block_ids(self):
        return list(self.ids)


def remote(**kw):
    p = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [7, 8, 9],
         "remote_engine_id": "p-eng", "remote_host": "10.0.0.1", "remote_port": 30000,
         "remote_pcp_size": 1, "remote_dcp_size": 1, "last_token_id": 5}
    p.update(kw)
    return p


def rules():
    return SchedulerRules("d-eng", "10.0.0.2", SchedulerRules.side_channel_port(30000, 1, 2, 1), block_size=4,
                          clock=lambda: 1712345678.5)


class MatchedTokensTest(unittest.TestCase):
    def test_cases(self):
        cases = [
            ("no params", None, 0, (0, False)),
            ("not remote", {"do_remote_prefill": False}, 0, (0, False)),
            ("remote, nothing local", remote(), 0, (10, True)),
            ("remote, prefix hit of 2 blocks", remote(), 8, (2, True)),
            ("remote, all local", remote(), 12, (0, False)),
        ]
        for name, params, computed, want in cases:
            with self.subTest(name):
                self.assertEqual(rules().get_num_new_matched_tokens(Req("r", params), computed), want)

    def test_partial_block_raises(self):  # the seed asserts (kvflow difference 1)
        with self.assertRaisesRegex(ValueError, "request r: num_computed_tokens 3 is not a multiple of block_size 4"):
            rules().get_num_new_matched_tokens(Req("r", remote()), 3)


class AllocTest(unittest.TestCase):
    def test_cases(self):
        cases = [
            # name, params, external tokens, queued local blocks (None: not queued)
            ("complete params", remote(), 10, [3, 4, 5]),
            ("full prefix hit: nothing to pull but DONE still owed", remote(), 0, []),
            ("remote_host None: the seed checks keys only", remote(remote_host=None), 10, [3, 4, 5]),
            ("no remote_host key", {k: v for k, v in remote().items() if k != "remote_host"}, 10, None),
            ("no remote_port key", {k: v for k, v in remote().items() if k != "remote_port"}, 10, None),
            ("no remote blocks", remote(remote_block_ids=[]), 0, None),
            ("not remote", {"do_remote_prefill": False}, 0, None),
            ("no params", None, 0, None),
        ]
        for name, params, ext, want in cases:
            with self.subTest(name):
                s = rules()
                req = Req("r", params)
                s.update_state_after_alloc(req, Blocks([3, 4, 5]), ext)
                meta = s.build_connector_meta(None)
                if want is None:
                    self.assertEqual(meta.requests, {})
                else:
                    self.assertEqual(list(meta.requests), ["r"])
                    self.assertEqual(meta.requests["r"].local_block_ids, want)
                if params is not None and "do_remote_prefill" in params:
                    self.assertIs(params["do_remote_prefill"], False)  # one transfer per request

    def test_only_one_transfer(self):
        s = rules()
        req = Req("r", remote())
        s.update_state_after_alloc(req, Blocks([1]), 4)
        s.update_state_after_alloc(req, Blocks([2]), 4)
        self.assertEqual(s.build_connector_meta(None).requests["r"].local_block_ids, [1])

    def test_external_tokens_without_blocks_raises(self):  # seed: assert
        with self.assertRaisesRegex(ValueError, "request r: 4 external tokens but no remote_block_ids"):
            rules().update_state_after_alloc(Req("r", remote(remote_block_ids=[])), Blocks([1]), 4)


class MetaTest(unittest.TestCase):
    def test_build_clears_and_defaults(self):
        s = rules()
        p = remote()
        del p["remote_pcp_size"], p["remote_dcp_size"]
        s.update_state_after_alloc(Req("a", p), Blocks([1, 2]), 8)
        s.request_finished(Req("b", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED), [5])
        m = s.build_connector_meta(None)
        a = m.requests["a"]
        self.assertEqual((a.remote_block_ids, a.remote_engine_id, a.remote_host, a.remote_port,
                          a.remote_pcp_size, a.remote_dcp_size), ([7, 8, 9], "p-eng", "10.0.0.1", 30000, 1, 1))
        self.assertEqual(m.requests_to_send, {"b": 1712345678.5})
        m2 = s.build_connector_meta(None)
        self.assertEqual((m2.requests, m2.requests_to_send, m2.requests_to_abort), ({}, {}, []))


class RequestFinishedTest(unittest.TestCase):
    def test_not_handed_over(self):
        cases = [
            ("no params", None, Status.FINISHED_LENGTH_CAPPED),
            ("not do_remote_decode", {"do_remote_decode": False}, Status.FINISHED_LENGTH_CAPPED),
            ("stopped (EOS), not length capped", {"do_remote_decode": True}, Status.FINISHED_STOPPED),
            ("aborted", {"do_remote_decode": True}, Status.FINISHED_ABORTED),
            ("status as a string", {"do_remote_decode": True}, "FINISHED_STOPPED"),
        ]
        for name, params, st in cases:
            with self.subTest(name):
                s = rules()
                self.assertEqual(s.request_finished(Req("r", params, status=st), [1, 2]), (False, None))
                self.assertEqual(s.build_connector_meta(None).requests_to_send, {})

    def test_params_are_the_seeds(self):
        s = rules()
        delay, p = s.request_finished(
            Req("r", {"do_remote_decode": True}, out=(3, 99), status=Status.FINISHED_LENGTH_CAPPED), [4, 5, 6])
        self.assertIs(delay, True)
        self.assertEqual(list(p), ["do_remote_prefill", "do_remote_decode", "remote_block_ids", "remote_engine_id",
                                   "remote_host", "remote_port", "remote_pcp_size", "remote_dcp_size",
                                   "last_token_id"])
        self.assertEqual(p, {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [4, 5, 6],
                             "remote_engine_id": "d-eng", "remote_host": "10.0.0.2",
                             "remote_port": 30002, "remote_pcp_size": 1, "remote_dcp_size": 1,
                             "last_token_id": 99})
        self.assertEqual([type(v) for v in p.values()], [bool, bool, list, str, str, int, int, int, int])
        self.assertEqual(s.build_connector_meta(None).requests_to_send, {"r": 1712345678.5})

    def test_boot_epochs_handed_over(self):
        """kvflow's kvflow_boot_epochs: after the seed's nine keys, a copy
        of the ranks' epochs; absent when none is known."""
        s = rules()
        s.set_boot_epochs([1764870000123456789, 0])
        _, p = s.request_finished(Req("r", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED), [4])
        self.assertEqual(list(p)[-1], "kvflow_boot_epochs")
        self.assertEqual(len(p), 10)
        self.assertEqual(p["kvflow_boot_epochs"], [1764870000123456789, 0])
        p["kvflow_boot_epochs"][0] = 1
        self.assertEqual(s.boot_epochs[0], 1764870000123456789)
        s.set_boot_epochs([0, 0])  # nothing known: the seed's params exactly
        _, p = s.request_finished(Req("q", {"do_remote_decode": True}, status=Status.FINISHED_LENGTH_CAPPED), [4])
        self.assertNotIn("kvflow_boot_epochs", p)
        for bad in (["1"], [-1], [True], [1.0], [1 << 63]):
            with self.subTest(bad=bad), self.assertRaisesRegex(ValueError, "boot epochs"):
                s.set_boot_epochs(bad)

    def test_no_blocks_no_delay(self):
        s = rules()
        delay, p = s.request_finished(Req("r", {"do_remote_decode": True}, status="FINISHED_LENGTH_CAPPED"), [])
        self.assertEqual((delay, p["remote_block_ids"]), (False, []))
        self.assertEqual(s.build_connector_meta(None).requests_to_send, {})


class BootEpochsPassThroughTest(unittest.TestCase):
    """A decode request's kvflow_boot_epochs reach the control socket
    checked: a list of whole numbers >= 0 (decimal strings read as ints,
    as for the seed's fields); anything else is a ValueError naming the
    field; absent, the params are the seed's."""

    def params_for(self, **kw):
        s = rules()
        s.update_state_after_alloc(Req("a", remote(**kw)), Blocks([1, 2]), 8)
        return s.build_connector_meta(None).requests["a"].kv_transfer_params()

    def test_passed_through(self):
        self.assertNotIn("kvflow_boot_epochs", self.params_for())
        for got, want in (([1764870000123456789, 0], [1764870000123456789, 0]), ((5,), [5]),
                          (["7", 0], [7, 0]), ([], [])):
            with self.subTest(got=got):
                self.assertEqual(self.params_for(kvflow_boot_epochs=got)["kvflow_boot_epochs"], want)

    def test_malformed(self):
        cases = [("string", "123", r"kvflow_boot_epochs is '123', want a list of ints"),
                 ("int", 5, r"kvflow_boot_epochs is 5, want a list of ints"),
                 ("map", {"0": 5}, r"kvflow_boot_epochs is \{'0': 5\}, want a list of ints"),
                 ("negative", [5, -1], r"kvflow_boot_epochs\[1\] is -1, want a boot epoch"),
                 ("too big", [1 << 63], r"kvflow_boot_epochs\[0\] is 9223372036854775808, want a boot epoch"),
                 ("float", [1.5], r"kvflow_boot_epochs\[0\] is 1.5, want an int"),
                 ("bool", [True], r"kvflow_boot_epochs\[0\] is True, want an int"),
                 ("none entry", [None], r"kvflow_boot_epochs\[0\] is None, want an int"),
                 ("too many", [0] * 65536, r"kvflow_boot_epochs has 65536 entries, at most 65535")]
        for name, v, want in cases:
            with self.subTest(name), self.assertRaisesRegex(ValueError, "kv_transfer_params." + want):
                self.params_for(kvflow_boot_epochs=v)


class AbortTest(unittest.TestCase):
    """kvflow differences 2 and 3: the prefill's blocks are freed, the
    workers stop pulling into freed blocks."""

    def test_abort_before_scheduling_frees_prefill(self):
        s = rules()
        p = remote()
        self.assertEqual(s.request_finished(Req("r", p, status=Status.FINISHED_ABORTED), []), (False, None))
        m = s.build_connector_meta(None)
        self.assertEqual(m.requests["r"].local_block_ids, [])  # a DONE, no bytes
        self.assertIs(p["do_remote_prefill"], False)

    def test_abort_while_queued(self):
        s = rules()
        req = Req("r", remote(), status=Status.FINISHED_ABORTED)
        s.update_state_after_alloc(req, Blocks([1, 2, 3]), 10)
        self.assertEqual(s.request_finished(req, [1, 2, 3]), (False, None))
        m = s.build_connector_meta(None)
        self.assertEqual(m.requests["r"].local_block_ids, [])
        self.assertEqual(m.requests_to_abort, [])

    def test_abort_while_loading(self):
        s = rules()
        req = Req("r", remote(), status=Status.FINISHED_ABORTED)
        s.update_state_after_alloc(req, Blocks([1, 2, 3]), 10)
        s.build_connector_meta(None)
        self.assertEqual(s.request_finished(req, [1, 2, 3]), (False, None))
        m = s.build_connector_meta(None)
        self.assertEqual((m.requests, m.requests_to_abort), ({}, ["r"]))

    def test_finished_load_is_not_aborted(self):
        s = rules()
        req = Req("r", remote(), status=Status.FINISHED_STOPPED)
        s.update_state_after_alloc(req, Blocks([1, 2, 3]), 10)
        s.build_connector_meta(None)
        s.finished_recving(["r"])
        self.assertEqual(s.request_finished(req, [1, 2, 3]), (False, None))
        self.assertEqual(s.build_connector_meta(None).requests_to_abort, [])


if __name__ == "__main__":
    unittest.main()
