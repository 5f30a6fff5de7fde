"""Issue 16.1: a child forked from a process with a live TierStore never touches the parent's
spill directory, whichever way it ends, and refuses to use the store."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

HERE = pathlib.Path(__file__).resolve().parent


def test_a_forked_child_leaves_the_parents_spill_files_alone(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
    out = subprocess.run([sys.executable, str(HERE / "_worker.py"), "fork_child", str(tmp_path)],
                         capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    results = lines[-1]["results"]
    assert set(results) == {f"{b}-{h}" for b in ("posix", "aiofiles")
                            for h in ("exit", "close", "drop", "use")} | {"optimizer"}
    for name, r in results.items():
        assert r["code"] == 0, name  # the child ended cleanly (no hang, no traceback)
        assert r["dir_kept"] is True, name  # its exit, close or drop left the parent's dir
        assert r["data_ok"] is True, (name, r["data_ok"])  # every spilled key reads back
        assert r["removed_on_close"], name  # and the parent's own close still removes it
    uses = [line["error"] for line in lines[:-1] if line["how"] == "use"]
    assert len(uses) == 2
    for error in uses:  # the child's get was refused, saying why and what to do instead
        assert error is not None and "child forked from it" in error
        assert "create a new TierStore in the child" in error
    # a HybridAdam's step in the child is refused too (its worker thread is not there)
    [error] = [line["error"] for line in lines[:-1] if line["how"] == "optimizer"]
    assert error is not None and "child forked from it" in error and "new optimizer" in error
    assert os.listdir(tmp_path) == ["opt"] and os.listdir(tmp_path / "opt") == []
