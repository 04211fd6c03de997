"""Shared by the tests: kvflow on sys.path, the kvflow binary, temp dirs."""

import os
import shutil
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

from kvflow.sidecar import SidecarError, find_binary  # noqa: E402


def kvflow_bin(test):
    """The kvflow binary, or skip the test saying how to get one."""
    try:
        return find_binary()
    except SidecarError as e:
        raise unittest.SkipTest(str(e))


def shm_dir(prefix="kvflow-pytest-"):
    """A fresh directory for cache files: under /dev/shm when it exists."""
    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    return tempfile.mkdtemp(prefix=prefix, dir=base)


def rmtree(d):
    shutil.rmtree(d, ignore_errors=True)
