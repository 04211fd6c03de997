"""Compatibility alias: the client moved to the kvflow package
(``from kvflow.client import ...``). This module re-exports it so that
scripts importing ``kvflow_client`` keep working."""

from kvflow.client import *  # noqa: F401,F403
from kvflow.client import crc32c  # noqa: F401
