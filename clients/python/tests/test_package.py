"""clients/python installs offline with setuptools only (no network, no
build isolation, no dependency downloads) and the installed package
imports from anywhere, the kvflow_client alias included."""

import os
import shutil
import subprocess
import sys
import tempfile
import unittest

import _util

SRC = os.path.dirname(_util.HERE)


class InstallTest(unittest.TestCase):
    def test_pip_install_offline(self):
        if subprocess.run([sys.executable, "-m", "pip", "--version"], capture_output=True).returncode != 0:
            self.skipTest("pip not available for %s" % sys.executable)
        tmp = tempfile.mkdtemp(prefix="kvflow-pip-")
        try:
            src = os.path.join(tmp, "src")  # a copy: the build leaves build/ and egg-info behind
            shutil.copytree(SRC, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__", "tests"))
            target = os.path.join(tmp, "site")
            env = dict(os.environ, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
            env.pop("PYTHONPATH", None)
            r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                                "--target", target, src], capture_output=True, text=True, env=env, timeout=120)
            self.assertEqual(r.returncode, 0, r.stdout + r.stderr)
            env["PYTHONPATH"] = target
            code = ("import kvflow, kvflow.client, kvflow.scheduler, kvflow.sidecar, kvflow_client; "
                    "assert kvflow.client.__file__.startswith(%r), kvflow.client.__file__; "
                    "assert kvflow_client.attach_cache is kvflow.client.attach_cache; print('ok')" % target)
            r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=tmp,
                               timeout=60)
            self.assertEqual((r.returncode, r.stdout.strip()), (0, "ok"), r.stderr)
            for mod in ("kvflow/vllm/_shim.py", "kvflow/vllm/connector.py", "kvflow/tiny/engine.py",
                        "kvflow/tiny/model.py", "kvflow/tiny/run.py"):
                self.assertTrue(os.path.exists(os.path.join(target, mod)), mod)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    unittest.main()
