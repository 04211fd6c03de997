#!/usr/bin/python3
"""Recompute a seedref vector set from its own inputs with gen.py's calls.

    /usr/bin/python3 scripts/seedref/verify.py --seed-file ../shared/seed/mooncake_connector.py \
        --dir testdata/seedref

For every case (and raising case) of the families gen.py writes, the inputs
are read back, the seed is run again through gen.py's case functions and the
result is compared with the stored case. Run on the public set this checks
that gen.py calls the seed the way the public generator did; run on a
generated set it checks that the files are self-consistent.
"""
import argparse
import json
import os
import sys

sys.dont_write_bytecode = True
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gen  # noqa: E402


def norm(x):
    return json.loads(json.dumps(x))


def check(name, stored, got, bad, limit=3):
    if norm(stored) != norm(got):
        bad.setdefault(name, []).append((stored, got))
        return False
    return True


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seed-file", required=True)
    ap.add_argument("--dir", required=True)
    a = ap.parse_args()
    mod = gen.load_seed(a.seed_file)
    load = lambda f: json.load(open(os.path.join(a.dir, f + ".json"), encoding="utf-8"))  # noqa
    bad, counts = {}, {}

    def tally(fam, ok):
        c = counts.setdefault(fam, [0, 0])
        c[0 if ok else 1] += 1

    for c in load("string_to_int64_hash")["cases"]:
        tally("string_to_int64_hash", check("string_to_int64_hash", c, gen.case_hash(mod, c["req_id"]), bad))
    for c in load("py_random_sample")["cases"]:
        tally("py_random_sample", check("py_random_sample", c, gen.case_py_random(mod, c["req_id"], c["n"], c["k"], len(c["first_getrandbits32"])), bad))
    for c in load("group_concurrent_contiguous")["cases"]:
        tally("group_concurrent_contiguous", check("group_concurrent_contiguous", c, gen.case_group(mod, c["src"], c["dst"]), bad))

    f = load("get_remote_ranks")
    for c in f["cases"] + f["raising_cases"]:
        cfg = {k: c["config"][k] for k in ("prefill_tp", "decode_tp", "prefill_pp",
                                           "num_key_value_heads", "is_deepseek_mla", "use_sparse")}
        got, exc = gen.case_remote_ranks(mod, cfg, c["req_id"])
        tally("get_remote_ranks", check("get_remote_ranks", c, got or exc, bad))

    for c in load("prefill_send_decision")["cases"]:
        got = gen.case_prefill_send(mod, c["worker"], c["requests_to_send"])
        tally("prefill_send_decision", check("prefill_send_decision", c, got, bad))

    f = load("tp_num_need_pulls")
    for c in f["cases"]:
        got, exc = gen.case_tp_num_need_pulls(mod, c["kind"], c["inputs"])
        tally("tp_num_need_pulls", check("tp_num_need_pulls", c, got or exc, bad))
    for c in f["raising_cases"]:
        inputs = json.loads(json.dumps(c["inputs"]))
        d = c["dropped_extra_config_key"]
        if d:  # the stored inputs lack the dropped key; put a value back to drop it again
            inputs[d[0]][d[1]] = 1
        got, exc = gen.case_tp_num_need_pulls(mod, "decode_worker", inputs, d)
        if exc and d:
            exc["inputs"] = c["inputs"]
        tally("tp_num_need_pulls", check("tp_num_need_pulls", c, got or exc, bad))

    f = load("kv_split_metadata")
    for c in f["cases"] + f["raising_cases"]:
        got, exc = gen.case_kv_split(mod, c["label"], c["worker"], c["req_id"], c["meta"])
        tally("kv_split_metadata", check("kv_split_metadata", c, got or exc, bad))

    # start_load_kv: the thread's block_len/layers come from transfer_kv_cache.json
    t = load("transfer_kv_cache")
    geo = {}
    for c in t["cases"] + t["raising_cases"]:
        geo.setdefault((c["scenario"], c["thread"]["tp_rank"]),
                       (c["thread"]["block_len"], c["thread"]["num_hidden_layers"]))
    f = load("start_load_kv")
    for c in f["cases"] + f["raising_cases"]:
        bl, layers = geo.get((c["scenario"], c["worker"]["tp_rank"]), ([8192], 4))
        sc = {"scenario": c["scenario"], "engine_return": c["engine_return"],
              "prefill_context_parallel_enable": c["prefill_context_parallel_enable"],
              "vllm_pp_layer_partition": c["vllm_pp_layer_partition"], "worker": c["worker"],
              "requests": c["requests"], "block_len": bl, "num_layers": layers}
        got, _, _ = gen.run_start_load(mod, sc)
        tally("start_load_kv", check("start_load_kv", c, got, bad))

    wk = {}
    for c in f["cases"] + f["raising_cases"]:
        wk[c["scenario"]] = c["worker"]
    for c in t["cases"] + t["raising_cases"]:
        th = c["thread"]
        w = wk.get(c["scenario"], {"prefill_tp": 2 * c["req_meta"]["tp_num_need_pulls"],
                                   "num_key_value_heads": 4, "is_deepseek_mla": False, "tp_size": 2})
        got, exc = gen.case_transfer(mod, c["scenario"], c["vllm_pp_layer_partition"],
                                     c["engine_return"], w["prefill_tp"], th["prefill_pp_size"],
                                     w["num_key_value_heads"], w["is_deepseek_mla"], th["tp_rank"],
                                     w["tp_size"], th["block_len"], th["num_hidden_layers"],
                                     c["req_meta"])
        if exc is not None and "remote_metadata" not in c:
            exc.pop("remote_metadata", None)  # sets from before gen.py recorded it in raising cases
        tally("transfer_kv_cache", check("transfer_kv_cache", c, got or exc, bad))

    for c in load("task_tracker")["cases"]:
        steps = [{k: v for k, v in s.items() if k not in ("result", "state")} for s in c["steps"]]
        tally("task_tracker", check("task_tracker", c, gen.case_tracker(mod, c["timeout"], steps), bad))

    for c in load("head_transpose")["cases"]:
        if c["kind"] == "transpose":
            got = gen.case_transpose(mod, c["num_blocks"], c["tp_num_need_pulls"], c["block_size"],
                                     c["num_kv_head"], c["head_dim"], c["input"][0])
        else:
            got = gen.case_cat(mod, c["cache_shape"], c["block_ids"], c["tp_num_need_pulls"],
                               c["num_key_value_heads"], c["tp_size"], len(c["caches_before"]))
        tally("head_transpose", check("head_transpose", c, got, bad))

    ok = True
    for fam, (good, nbad) in counts.items():
        print("%-28s %5d identical %4d different" % (fam, good, nbad))
        ok = ok and nbad == 0
    for fam, pairs in bad.items():
        for stored, got in pairs[:2]:
            print("\n--", fam, "\nstored:", json.dumps(stored)[:1500], "\ngot:   ", json.dumps(got)[:1500])
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
