"""The seed's scheduler-side connector rules (MooncakeConnectorScheduler),
ported faithfully, with the engine-facing types duck-typed so the module runs
without vLLM.

What the scheduler sees of a request: ``request_id``, ``kv_transfer_params``
(a dict or None; mutated as the seed mutates it), ``prompt_token_ids``,
``output_token_ids`` and ``status`` (vLLM's RequestStatus, or anything whose
``name`` or str is the status name). ``blocks`` in update_state_after_alloc
has ``get_unhashed_block_ids()`` (vLLM's KVCacheBlocks).

The rules, as in the seed:

* get_num_new_matched_tokens: with ``do_remote_prefill`` the whole prompt
  beyond the locally computed tokens is external and loaded asynchronously
  (``count, count > 0``); otherwise ``0, False``.
* update_state_after_alloc: with ``do_remote_prefill``, a request whose
  params have ``remote_block_ids`` and all of ``remote_engine_id``,
  ``remote_host``, ``remote_port`` is queued to receive into its unhashed
  blocks (none when ``num_external_tokens`` is 0, a full local prefix hit);
  incomplete params are skipped (the request is computed locally); without
  remote blocks ``num_external_tokens`` must be 0. Either way
  ``do_remote_prefill`` is turned off: one transfer per request.
* build_connector_meta: hands the queued receives and sends to the workers
  and clears both queues.
* request_finished: only a ``do_remote_decode`` request that finished by
  length cap (the prefill's max_tokens=1) is handed over: with blocks, their
  free is delayed and the request queued to send with time.time(); the
  returned kv_transfer_params have exactly the seed's keys and types, plus
  kvflow's optional ``kvflow_boot_epochs`` last when ``boot_epochs`` is
  set (below).

Where kvflow differs (each is a case the seed gets wrong; tested):

1. The seed's ``assert``s (num_computed_tokens a whole number of blocks;
   no remote blocks but external tokens) vanish under ``python -O``; here
   they raise ValueError naming the request.
2. Abort before scheduling: a request finished (aborted) while
   ``do_remote_prefill`` is still set was never allocated; the seed drops
   it and the prefill holds its blocks until its abort timeout. kvflow
   queues a receive with no local blocks, so the decode worker sends DONE
   at once and the prefill frees them (vLLM's NixlConnector does the same).
3. Abort while loading: a request finished while its load is queued (not
   yet handed to workers) is dropped from the queue and handled as 2; one
   handed to workers and not yet finished is listed in
   ``requests_to_abort`` of the next metadata so the workers cancel it
   (the seed keeps pulling into blocks the engine has freed).

Boot epochs (kvflow only). A prefill instance's ranks each have a boot
epoch (their sidecar's start time, in its status). With ``boot_epochs``
set (entry r: the rank at side_channel_port + r; 0 where unknown),
request_finished adds ``kvflow_boot_epochs`` to the params after the
seed's keys. A kvflow decode worker compares each entry with the rank's
metadata and fails the request, reading nothing, if the rank restarted
since (its blocks are gone with the old process). A seed decode ignores
the key; params without it (a seed prefill) are read as before. ReqMeta
passes it through, checked (a list of whole numbers >= 0).
"""

import operator
import time

__all__ = ["ReqMeta", "ConnectorMetadata", "SchedulerRules", "status_name", "MAX_BOOT_EPOCHS"]

FINISHED_LENGTH_CAPPED = "FINISHED_LENGTH_CAPPED"

# At most one kvflow_boot_epochs entry per prefill rank: their side-channel
# ports are all below 65536 (the sidecar's own bound).
MAX_BOOT_EPOCHS = 65535


def status_name(status):
    """A request status's name: vLLM's RequestStatus enum or a string."""
    return getattr(status, "name", None) or str(status).rsplit(".", 1)[-1]


class ReqMeta:
    """One request to receive (the seed's ReqMeta)."""

    __slots__ = ("local_block_ids", "remote_block_ids", "remote_engine_id", "remote_host", "remote_port",
                 "remote_pcp_size", "remote_dcp_size", "kvflow_boot_epochs")

    def __init__(self, local_block_ids, remote_block_ids, remote_engine_id, remote_host, remote_port,
                 remote_pcp_size=1, remote_dcp_size=1, kvflow_boot_epochs=None):
        self.local_block_ids = local_block_ids
        self.remote_block_ids = remote_block_ids
        self.remote_engine_id = remote_engine_id
        self.remote_host = remote_host
        self.remote_port = remote_port
        self.remote_pcp_size = remote_pcp_size
        self.remote_dcp_size = remote_dcp_size
        self.kvflow_boot_epochs = kvflow_boot_epochs  # None: the params had none (a seed prefill)

    def kv_transfer_params(self):
        """The params as kvflow's control socket takes them. Raises
        ValueError naming the field when one has the wrong type (the
        router's params are not checked when they are scheduled)."""
        def whole(name, v):
            if isinstance(v, str) and v.strip().isdigit():
                return int(v)
            try:
                if isinstance(v, bool):
                    raise TypeError
                return operator.index(v)  # int, numpy integers
            except TypeError:
                raise ValueError("kv_transfer_params.%s is %r, want an int" % (name, v)) from None

        def text(name, v):
            if isinstance(v, int) and not isinstance(v, bool):
                v = str(v)
            if not isinstance(v, str) or not v:
                raise ValueError("kv_transfer_params.%s is %r, want a non-empty string" % (name, v))
            return v

        if isinstance(self.remote_block_ids, (str, bytes)) or not hasattr(self.remote_block_ids, "__iter__"):
            raise ValueError("kv_transfer_params.remote_block_ids is %r, want a list of ints"
                             % (self.remote_block_ids,))
        out = {"remote_block_ids": [whole("remote_block_ids[%d]" % i, b) for i, b in enumerate(self.remote_block_ids)],
               "remote_engine_id": text("remote_engine_id", self.remote_engine_id),
               "remote_host": text("remote_host", self.remote_host),
               "remote_port": whole("remote_port", self.remote_port),
               "remote_pcp_size": whole("remote_pcp_size", self.remote_pcp_size),
               "remote_dcp_size": whole("remote_dcp_size", self.remote_dcp_size)}
        epochs = self.kvflow_boot_epochs
        if epochs is not None:
            if isinstance(epochs, (str, bytes, dict)) or not hasattr(epochs, "__iter__"):
                raise ValueError("kv_transfer_params.kvflow_boot_epochs is %r, want a list of ints" % (epochs,))
            epochs = list(epochs)
            if len(epochs) > MAX_BOOT_EPOCHS:
                raise ValueError("kv_transfer_params.kvflow_boot_epochs has %d entries, at most %d (one per prefill rank)"
                                 % (len(epochs), MAX_BOOT_EPOCHS))
            out["kvflow_boot_epochs"] = []
            for i, e in enumerate(epochs):
                name = "kvflow_boot_epochs[%d]" % i
                v = whole(name, e)
                if v < 0 or v >= 1 << 63:
                    raise ValueError("kv_transfer_params.%s is %r, want a boot epoch in [0, 2**63)" % (name, e))
                out["kvflow_boot_epochs"].append(v)
        return out

    def __repr__(self):
        return "ReqMeta(local=%r, remote=%r, %s@%s:%s)" % (self.local_block_ids, self.remote_block_ids,
                                                         self.remote_engine_id, self.remote_host, self.remote_port)


class ConnectorMetadata:
    """What one scheduler step hands the workers (the seed's
    MooncakeConnectorMetadata, plus requests_to_abort)."""

    def __init__(self):
        self.requests = {}          # request id -> ReqMeta (to receive)
        self.requests_to_send = {}  # request id -> delay_start_time
        self.requests_to_abort = []  # request ids whose load the workers cancel

    def add_new_req(self, request_id, local_block_ids, kv_transfer_params):
        p = kv_transfer_params
        self.requests[request_id] = ReqMeta(
            local_block_ids=local_block_ids, remote_block_ids=p["remote_block_ids"],
            remote_engine_id=p["remote_engine_id"], remote_host=p["remote_host"], remote_port=p["remote_port"],
            remote_pcp_size=p.get("remote_pcp_size", 1), remote_dcp_size=p.get("remote_dcp_size", 1),
            kvflow_boot_epochs=p.get("kvflow_boot_epochs"))


class SchedulerRules:
    """The seed's MooncakeConnectorScheduler. engine_id, side_channel_host,
    block_size as the engine has them; side_channel_port is the instance's
    base handshake port (``side_channel_port(...)``); pcp/dcp sizes are
    this instance's. ``clock`` (time.time) gives delay_start_time.
    ``boot_epochs`` (None until set_boot_epochs) are the instance's
    ranks' boot epochs, handed over as kvflow_boot_epochs."""

    def __init__(self, engine_id, side_channel_host, side_channel_port, block_size, pcp_size=1, dcp_size=1,
                 clock=time.time):
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError("block_size %r: want an int >= 1" % (block_size,))
        self.engine_id = str(engine_id)
        self.side_channel_host = side_channel_host
        self.side_channel_port = int(side_channel_port)
        self.block_size = block_size
        self.pcp_size = pcp_size
        self.dcp_size = dcp_size
        self.clock = clock
        self.boot_epochs = None
        self._reqs_need_recv = {}   # request id -> (request, local block ids)
        self._reqs_need_send = {}   # request id -> delay_start_time
        self._reqs_loading = set()  # handed to workers, not yet reported finished
        self._reqs_to_abort = []

    def set_boot_epochs(self, epochs):
        """The boot epoch of each prefill rank of this instance (entry r:
        the rank listening at side_channel_port + r; 0 where unknown), or
        None for none. Every later hand-over carries them as
        kvflow_boot_epochs. Raises ValueError unless a list of ints in
        [0, 2**63)."""
        if epochs is None:
            self.boot_epochs = None
            return
        epochs = list(epochs)
        if len(epochs) > MAX_BOOT_EPOCHS or any(
                isinstance(e, bool) or not isinstance(e, int) or not 0 <= e < 1 << 63 for e in epochs):
            raise ValueError("boot epochs %r: want at most %d ints in [0, 2**63)" % (epochs[:8], MAX_BOOT_EPOCHS))
        self.boot_epochs = epochs if any(epochs) else None

    @staticmethod
    def side_channel_port(kv_port, dp_rank, tp_size, pp_size, pcp_size=1):
        """The seed's handshake base: kv_port + dp_rank*tp*pp*pcp."""
        return int(kv_port) + dp_rank * tp_size * pp_size * pcp_size

    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            if num_computed_tokens % self.block_size != 0:
                raise ValueError("request %s: num_computed_tokens %d is not a multiple of block_size %d"
                                 % (request.request_id, num_computed_tokens, self.block_size))
            count = max(len(request.prompt_token_ids) - num_computed_tokens, 0)
            return count, count > 0
        return 0, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        params = request.kv_transfer_params
        if params is not None and params.get("do_remote_prefill"):
            if params.get("remote_block_ids"):
                if all(p in params for p in ("remote_engine_id", "remote_host", "remote_port")):
                    local = list(blocks.get_unhashed_block_ids()) if num_external_tokens > 0 else []
                    self._reqs_need_recv[request.request_id] = (request, local)
                # else: invalid params, the request is computed locally (seed: a warning)
            elif num_external_tokens != 0:
                raise ValueError("request %s: %d external tokens but no remote_block_ids"
                                 % (request.request_id, num_external_tokens))
            params["do_remote_prefill"] = False

    def build_connector_meta(self, scheduler_output=None):
        meta = ConnectorMetadata()
        for req_id, (req, block_ids) in self._reqs_need_recv.items():
            meta.add_new_req(req_id, block_ids, req.kv_transfer_params)
            if block_ids:
                self._reqs_loading.add(req_id)
        self._reqs_need_recv = {}
        meta.requests_to_send = self._reqs_need_send
        self._reqs_need_send = {}
        meta.requests_to_abort = self._reqs_to_abort
        self._reqs_to_abort = []
        return meta

    def finished_recving(self, request_ids):
        """The workers reported these loads finished (done or failed)."""
        for r in request_ids:
            self._reqs_loading.discard(r)

    def request_finished(self, request, block_ids):
        params = request.kv_transfer_params
        rid = request.request_id
        if rid in self._reqs_loading:          # (3) aborted while its load runs
            self._reqs_loading.discard(rid)
            self._reqs_to_abort.append(rid)
            return False, None
        queued = self._reqs_need_recv.pop(rid, None)
        if params is not None and (params.get("do_remote_prefill") or queued is not None):
            # (2) never scheduled, or (3) queued and not yet handed over:
            # receive nothing, so the prefill frees its blocks now.
            if params.get("remote_block_ids") and all(
                    p in params for p in ("remote_engine_id", "remote_host", "remote_port")):
                self._reqs_need_recv[rid] = (request, [])
            params["do_remote_prefill"] = False
            return False, None
        if (params is None or not params.get("do_remote_decode")
                or status_name(request.status) != FINISHED_LENGTH_CAPPED):
            return False, None
        computed_block_ids = block_ids
        delay_free_blocks = len(computed_block_ids) > 0
        if delay_free_blocks:
            self._reqs_need_send[rid] = self.clock()
        params = dict(
            do_remote_prefill=True,
            do_remote_decode=False,
            remote_block_ids=computed_block_ids,
            remote_engine_id=self.engine_id,
            remote_host=self.side_channel_host,
            remote_port=self.side_channel_port,
            remote_pcp_size=self.pcp_size,
            remote_dcp_size=self.dcp_size,
            last_token_id=request.output_token_ids[-1],
        )
        if self.boot_epochs is not None:
            params["kvflow_boot_epochs"] = list(self.boot_epochs)
        return delay_free_blocks, params
