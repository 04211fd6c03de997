"""kvflow.scheduler against the op scripts in internal/sched/testdata/
cases.json, which the Go port (internal/sched) runs too: both ports answer
every case the same."""

import copy
import json
import os
import unittest

import _util
from kvflow.scheduler import SchedulerRules

CASES = os.path.join(os.path.dirname(_util.HERE), "..", "..", "internal", "sched", "testdata", "cases.json")


class Req:
    def __init__(self, rid, spec):
        self.request_id = rid
        self.kv_transfer_params = copy.deepcopy(spec["params"])
        self.prompt_token_ids = list(range(spec["prompt_len"]))
        self.output_token_ids = list(spec["output"])
        self.status = spec["status"]


class Blocks:
    def __init__(self, ids):
        self.ids = ids

    def get_unhashed_block_ids(self):
        return list(self.ids)


def recv_json(rid, r):
    out = {"id": rid, "local": r.local_block_ids, "remote": r.remote_block_ids, "engine": r.remote_engine_id,
           "host": r.remote_host, "port": r.remote_port, "pcp": r.remote_pcp_size, "dcp": r.remote_dcp_size}
    if r.kvflow_boot_epochs:
        out["boot_epochs"] = list(r.kvflow_boot_epochs)
    return out


def meta_json(m):
    return {"requests": [recv_json(rid, r) for rid, r in m.requests.items()],
            "to_send": [[rid, t] for rid, t in m.requests_to_send.items()], "to_abort": list(m.requests_to_abort)}


class SharedCasesTest(unittest.TestCase):
    def test_cases(self):
        if not os.path.exists(CASES):
            self.skipTest("%s not found (run from a kvflow checkout)" % CASES)
        with open(CASES) as f:
            doc = json.load(f)
        self.assertGreater(len(doc["cases"]), 20)
        for c in doc["cases"]:
            with self.subTest(c["name"]):
                s = SchedulerRules(doc["engine_id"], doc["host"], doc["port"], doc["block_size"],
                                   clock=lambda: doc["clock"])
                reqs = {rid: Req(rid, spec) for rid, spec in c["requests"].items()}
                for i, op in enumerate(c["ops"]):
                    where = "op %d (%s)" % (i, op["op"])
                    try:
                        if op["op"] == "matched":
                            got = list(s.get_num_new_matched_tokens(reqs[op["req"]], op["computed"]))
                        elif op["op"] == "alloc":
                            got = s.update_state_after_alloc(reqs[op["req"]], Blocks(op["unhashed"]), op["ext"])
                        elif op["op"] == "meta":
                            got = meta_json(s.build_connector_meta(None))
                        elif op["op"] == "finished":
                            d, p = s.request_finished(reqs[op["req"]], op["blocks"])
                            got = [d, None if p is None else list(p.items())]
                            op = dict(op, want=[op["want"][0], None if op["want"][1] is None
                                                else list(op["want"][1].items())])
                        elif op["op"] == "recv_done":
                            got = s.finished_recving(op["ids"])
                        elif op["op"] == "boot_epochs":
                            got = s.set_boot_epochs(op["epochs"])
                        elif op["op"] == "param":
                            got = reqs[op["req"]].kv_transfer_params[op["key"]]
                        else:
                            self.fail("%s: unknown op" % where)
                    except ValueError as e:
                        self.assertIn("want_error", op, "%s: %s" % (where, e))
                        self.assertIn(op["want_error"], str(e), where)
                        continue
                    self.assertNotIn("want_error", op, where)
                    if "want" in op:
                        self.assertEqual(got, op["want"], where)


if __name__ == "__main__":
    unittest.main()
