"""Client of the ``_worker.py serve`` fork server used by test_crash_safety.py."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import tempfile
import threading
import time

HERE = pathlib.Path(__file__).resolve().parent
WORKER = HERE / "_worker.py"
_SERVER = None


class Server:
    """The ``_worker.py serve`` fork server: one warm interpreter, one forked child per run."""

    def __init__(self) -> None:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(
            [str(HERE.parent), str(HERE), os.environ.get("PYTHONPATH", "")]))
        self.stderr = tempfile.TemporaryFile(mode="w+")  # a pipe nobody reads could fill up
        self.proc = subprocess.Popen([sys.executable, str(WORKER), "serve"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.stderr, text=True,
                                     bufsize=1, env=env)
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._ready = False
        threading.Thread(target=self._pump, daemon=True).start()

    def expect_ready(self) -> None:
        if not self._ready:
            self.expect("ready", timeout=180)
            self._ready = True

    def _pump(self) -> None:
        for line in self.proc.stdout:
            with self._cv:
                self.lines.append(line.rstrip("\n"))
                self._cv.notify_all()
        with self._cv:
            self.lines.append("<eof>")
            self._cv.notify_all()

    def expect(self, prefix: str, timeout: float = 60.0) -> str:
        """Pop lines until one starts with ``prefix``; return it."""
        deadline = time.monotonic() + timeout
        with self._cv:
            while True:
                while self.lines:
                    line = self.lines.pop(0)
                    if line.startswith(prefix):
                        return line
                    if line.startswith("error") or line == "<eof>":
                        raise AssertionError(f"worker: {line}; stderr: {self._stderr()}")
                left = deadline - time.monotonic()
                if left <= 0:
                    raise AssertionError(f"timed out waiting for {prefix!r}")
                self._cv.wait(left)

    def _stderr(self) -> str:
        self.stderr.seek(0)
        return self.stderr.read()[-2000:]

    def send(self, cmd: str, *args) -> None:
        self.proc.stdin.write(json.dumps({"cmd": cmd, "args": [str(a) for a in args]}) + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.send("quit")
                self.proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        self.stderr.close()


def start_server() -> None:
    """Start the fork server in the background (idempotent); :func:`get_server` waits for it."""
    global _SERVER
    if _SERVER is None:
        _SERVER = Server()


def get_server() -> "Server":
    start_server()
    _SERVER.expect_ready()
    return _SERVER


def stop_server() -> None:
    global _SERVER
    if _SERVER is not None:
        _SERVER.close()
        _SERVER = None
