"""Launching one ``kvflow serve`` per rank (the sidecar) and talking to it.

A sidecar is configured by a JSON file (internal/config): vLLM's own
kv_transfer_config, the whole model's cache shape, this worker's ranks,
where the cache lives and the control endpoint. ``worker_config`` builds
that dict; ``Sidecar.launch`` writes it, starts ``kvflow serve -config``,
and waits for the one ``kvflow ready ...`` line it prints on stdout.
``Sidecar.attach`` talks to a sidecar someone else started (only the
control endpoint is needed).

The binary is found as: the ``exe`` argument, $KVFLOW_BIN, then ``kvflow``
on PATH.
"""

import json
import os
import selectors
import shutil
import signal
import socket
import subprocess
import time

from .client import Client, KvflowError

__all__ = ["SidecarError", "Sidecar", "worker_config", "find_binary", "free_port_base"]


class SidecarError(KvflowError):
    """The sidecar could not be found, started, or stopped."""


def find_binary(exe=None):
    """The kvflow binary: exe, $KVFLOW_BIN, or kvflow on PATH."""
    for cand in (exe, os.environ.get("KVFLOW_BIN"), shutil.which("kvflow")):
        if cand and os.access(cand, os.X_OK):
            return cand
    raise SidecarError("kvflow binary not found: pass exe=, set KVFLOW_BIN, or put kvflow on PATH "
                       "(go build -o bin/kvflow ./cmd/kvflow)")


def free_port_base(n, host="127.0.0.1", tries=200):
    """A base port p such that p..p+n-1 could all be bound just now on host
    (a race with other processes remains; the sidecar then fails to start
    with an address-in-use error, and the caller may retry)."""
    import random

    rng = random.Random(os.getpid() ^ time.monotonic_ns())
    for _ in range(tries):
        base = rng.randrange(10000, 30000 - n)  # below the ephemeral range (32768+), where the OS picks ports for :0 binds and outgoing connections
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                socks.append(s)
                s.bind((host, p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise SidecarError("no %d consecutive free ports on %s" % (n, host))


def worker_config(role, engine_id, kv_port, prefill, decode, model, rank, cache_path, control,
                  cache_mode="shm_attach", host="127.0.0.1", extra=None):
    """A kvflow serve configuration (internal/config's JSON) for one rank.

    role: "prefill" or "decode". prefill/decode: each instance's
    {"tp_size", "dp_size", "pp_size"} (vLLM's kv_connector_extra_config).
    model: the whole model's shape {"num_layers", "num_kv_heads",
    "head_dim", "block_size", "dtype", "num_blocks"} (+ MLA keys).
    rank: {"tp", "pp", "dp"}. extra: more top-level sections merged in
    (e.g. {"notify": {...}})."""
    if role not in ("prefill", "decode"):
        raise SidecarError("role %r: want prefill or decode" % (role,))
    cfg = {
        "kv_transfer_config": {
            "kv_connector": "KvflowConnector",
            "engine_id": str(engine_id),
            "kv_role": "kv_producer" if role == "prefill" else "kv_consumer",
            "kv_port": int(kv_port),
            "kv_connector_extra_config": {"prefill": dict(prefill), "decode": dict(decode)},
        },
        "model": dict(model),
        "rank": dict(rank),
        "cache": {"mode": cache_mode, "path": cache_path, "no_huge_pages": True, "no_lock": True},
        "node": {"side_channel_host": host, "control": control},
        "log": {"level": "warn", "format": "json"},
    }
    for k, v in (extra or {}).items():
        cfg.setdefault(k, {}).update(v)
    return cfg


class Sidecar:
    """One kvflow serve process (launched) or endpoint (attached)."""

    def __init__(self, control, proc=None, config_path=None, log_path=None, ready_line="", timeout_ms=10000):
        self.control = control
        self.proc = proc
        self.config_path = config_path
        self.log_path = log_path
        self.ready_line = ready_line
        self.client = Client(control, timeout_ms=timeout_ms)

    @classmethod
    def attach(cls, control, timeout_ms=10000):
        """A sidecar someone else runs: checks it answers status."""
        s = cls(control, timeout_ms=timeout_ms)
        try:
            s.client.status()
        except KvflowError as e:
            s.client.close()
            raise SidecarError("attach to kvflow sidecar at %s: %s" % (control, e)) from e
        return s

    @classmethod
    def launch(cls, config, workdir, name, exe=None, ready_timeout=20.0, timeout_ms=10000):
        """Write config to workdir/name.json and start kvflow serve on it;
        return once it printed its ready line. A sidecar that exits first
        (a bad config, a port in use, a cache file of another shape) raises
        SidecarError with its exit status and the end of its log."""
        exe = find_binary(exe)
        os.makedirs(workdir, exist_ok=True)
        cpath = os.path.join(workdir, name + ".json")
        lpath = os.path.join(workdir, name + ".log")
        with open(cpath, "w") as f:
            json.dump(config, f, indent=1)
        log = open(lpath, "wb")
        try:
            proc = subprocess.Popen([exe, "serve", "-config", cpath], stdout=subprocess.PIPE, stderr=log,
                                    stdin=subprocess.DEVNULL, start_new_session=True)
        finally:
            log.close()
        line = b""
        deadline = time.monotonic() + ready_timeout
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        try:
            while not line.endswith(b"\n"):
                left = deadline - time.monotonic()
                if left <= 0:
                    proc.kill()
                    proc.wait()
                    proc.stdout.close()
                    raise SidecarError("kvflow sidecar %s: not ready within %.0fs; log %s:\n%s"
                                       % (name, ready_timeout, lpath, _tail(lpath)))
                if not sel.select(left):
                    continue
                b = os.read(proc.stdout.fileno(), 4096)
                if not b:
                    rc = proc.wait()
                    proc.stdout.close()
                    raise SidecarError("kvflow sidecar %s exited with status %d before it was ready; log %s:\n%s"
                                       % (name, rc, lpath, _tail(lpath)))
                line += b
        finally:
            sel.close()
        ready = line.decode(errors="replace").strip()
        control = config["node"]["control"]
        return cls(control, proc=proc, config_path=cpath, log_path=lpath, ready_line=ready, timeout_ms=timeout_ms)

    def alive(self):
        return self.proc is None or self.proc.poll() is None

    def kill(self):
        """SIGKILL the process (tests: a sidecar dying mid-run)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self, timeout=15.0):
        """Close the client and, for a launched sidecar, SIGTERM it and wait
        (SIGKILL after timeout). Returns its exit status (None if attached)."""
        self.client.close()
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()
        return self.proc.returncode


def _tail(path, n=2000):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - n))
            return f.read().decode(errors="replace")
    except OSError as e:
        return "(no log: %s)" % e
