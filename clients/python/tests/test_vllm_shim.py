"""The shim base class mirrors vLLM's KVConnectorBase_V1: every public
method and property, with the same parameter names, kinds and defaults,
and the same abstract set. The list below was taken by reading
vllm/distributed/kv_transfer/kv_connector/v1/base.py of vllm-project/vllm
at commit 13f4ad0f55b08ca1d37d1459f50ce950feaeb547. Where vLLM is
importable, the live class is checked against the same list too."""

import inspect
import unittest

import _util  # noqa: F401
from kvflow.vllm import _shim

VLLM_COMMIT = "13f4ad0f55b08ca1d37d1459f50ce950feaeb547"

# name -> (kind, parameters after self/cls as "name", "name=default", "**kwargs")
SIGNATURES = {
    "__init__": ("method", ["vllm_config", "role", "kv_cache_config=None"]),
    "prefer_cross_layer_blocks": ("property", None),
    "role": ("property", None),
    "bind_connector_metadata": ("method", ["connector_metadata"]),
    "clear_connector_metadata": ("method", []),
    "_get_connector_metadata": ("method", []),
    "has_connector_metadata": ("method", []),
    "register_kv_caches": ("method", ["kv_caches"]),
    "register_cross_layers_kv_cache": ("method", ["kv_cache", "attn_backend"]),
    "set_host_xfer_buffer_ops": ("method", ["copy_operation"]),
    "handle_preemptions": ("method", ["preempted_req_ids"]),
    "start_load_kv": ("abstract", ["forward_context", "**kwargs"]),
    "wait_for_layer_load": ("abstract", ["layer_name"]),
    "save_kv_layer": ("abstract", ["layer_name", "kv_layer", "attn_metadata", "**kwargs"]),
    "wait_for_save": ("abstract", []),
    "get_finished": ("method", ["finished_req_ids"]),
    "get_block_ids_with_load_errors": ("method", []),
    "shutdown": ("method", []),
    "get_kv_connector_stats": ("method", []),
    "get_kv_connector_kv_cache_events": ("method", []),
    "get_handshake_metadata": ("method", []),
    "get_num_new_matched_tokens": ("abstract", ["request", "num_computed_tokens"]),
    "update_state_after_alloc": ("abstract", ["request", "blocks", "num_external_tokens"]),
    "build_connector_meta": ("abstract", ["scheduler_output"]),
    "update_connector_output": ("method", ["connector_output"]),
    "request_finished": ("method", ["request", "block_ids"]),
    "take_events": ("method", []),
    "get_required_kvcache_layout": ("classmethod", ["vllm_config"]),
    "get_finished_count": ("method", []),
    "build_kv_connector_stats": ("classmethod", ["data=None"]),
    "set_xfer_handshake_metadata": ("method", ["metadata"]),
    "build_prom_metrics": ("classmethod", ["vllm_config", "metric_types", "labelnames", "per_engine_labelvalues"]),
    "reset_cache": ("method", []),
}


def params(fn):
    out = []
    for p in list(inspect.signature(fn).parameters.values()):
        if p.name in ("self", "cls"):
            continue
        if p.kind == p.VAR_KEYWORD:
            out.append("**" + p.name)
        elif p.default is not p.empty:
            out.append("%s=%r" % (p.name, p.default))
        else:
            out.append(p.name)
    return out


def check(tc, cls):
    public = {n for n in vars(cls) if not n.startswith("__") and (not n.startswith("_") or n == "_get_connector_metadata")}
    public.add("__init__")
    tc.assertEqual(sorted(public), sorted(SIGNATURES), "methods differ from vLLM's list")
    for name, (kind, want) in SIGNATURES.items():
        raw = inspect.getattr_static(cls, name)
        with tc.subTest(name=name):
            if kind == "property":
                tc.assertIsInstance(raw, property)
                continue
            if kind == "classmethod":
                tc.assertIsInstance(raw, classmethod)
            fn = getattr(cls, name)
            tc.assertEqual(params(fn), want)
            tc.assertEqual(getattr(fn, "__isabstractmethod__", False), kind == "abstract")
    tc.assertEqual(set(cls.__abstractmethods__), {n for n, (k, _) in SIGNATURES.items() if k == "abstract"})


class ShimTest(unittest.TestCase):
    def test_shim_matches_vllm(self):
        check(self, _shim.KVConnectorBase_V1)
        self.assertEqual([r.name for r in _shim.KVConnectorRole], ["SCHEDULER", "WORKER"])

    def test_live_vllm_matches_list(self):
        try:
            from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
        except Exception as e:  # noqa: BLE001
            self.skipTest("vLLM not importable (%s); the shim is checked against the list from %s"
                          % (type(e).__name__, VLLM_COMMIT))
        check(self, KVConnectorBase_V1)

    def test_connector_overrides_keep_signatures(self):
        try:
            from kvflow.vllm import KvflowConnector
        except ImportError as e:
            self.skipTest("kvflow.vllm needs torch: %s" % e)
        for name, (kind, want) in SIGNATURES.items():
            if kind in ("property",) or name not in vars(KvflowConnector):
                continue
            with self.subTest(name=name):
                self.assertEqual(params(getattr(KvflowConnector, name)), want)


if __name__ == "__main__":
    unittest.main()
