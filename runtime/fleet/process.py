"""A child process of the fleet: started pinned to its cores, its output relayed line by line under a name."""
from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections import deque
from functools import partial
from typing import Sequence

log = logging.getLogger("pagedgraph.fleet")
TAIL_LINES = 40  # kept per child, shown when it fails to start


_PR_SET_PDEATHSIG = 1


def _in_child(cores: set[int] | None) -> None:
    """Runs in the child between fork and exec: SIGTERM when the parent dies, then its cores."""
    ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    if cores is not None:
        os.sched_setaffinity(0, cores)


class Child:
    """One subprocess; `start` may be called again after it exited (a restart reuses name, command and cores)."""

    def __init__(self, name: str, command: Sequence[str], cores: tuple[int, ...] | None = None,
                 env: dict[str, str] | None = None) -> None:
        self.name = name
        self.command = list(command)
        self.cores = cores
        self.env = env
        self.proc: subprocess.Popen[str] | None = None
        self.tail: deque[str] = deque(maxlen=TAIL_LINES)
        self.starts = 0

    def start(self) -> None:
        """In a session of its own, so a terminal's Ctrl-C or a signal to the fleet's process group reaches only
        the fleet, which drains each child once; the child gets SIGTERM if the fleet dies."""
        env = {**os.environ, **(self.env or {})}
        cores = None if self.cores is None else set(self.cores)
        if cores is not None:
            env["OMP_NUM_THREADS"] = str(len(cores))  # oneDNN's OpenMP pool, like ONNX Runtime's intra-op threads
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, env=env, start_new_session=True,
                                     preexec_fn=partial(_in_child, cores))
        self.starts += 1
        threading.Thread(target=self._relay, args=(self.proc,), name=f"relay-{self.name}", daemon=True).start()

    def _relay(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.tail.append(line.rstrip())
            sys.stdout.write(f"{self.name} | {line}")
            sys.stdout.flush()

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def poll(self) -> int | None:
        """The exit status once it exited, else None (also None before the first start)."""
        return None if self.proc is None else self.proc.poll()

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()

    def wait(self, timeout_s: float) -> int:
        """The exit status; killed (and -9) if still running after `timeout_s`."""
        assert self.proc is not None
        try:
            return self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("%s (pid %d) still running after %.0f s: killing it", self.name, self.proc.pid, timeout_s)
            self.proc.kill()
            return self.proc.wait()

    def failure(self, what: str) -> str:
        return f"{self.name} {what}; its last output:\n  " + "\n  ".join(self.tail)


def http_ok(url: str, timeout_s: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as response:
            return response.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


def wait_ready(child: Child | None, url: str, timeout_s: float, stop: threading.Event | None = None) -> None:
    """Until `url` answers 200; raises RuntimeError if the child exits first or the time runs out."""
    deadline = time.monotonic() + timeout_s
    while not http_ok(url):
        if child is not None and child.poll() is not None:
            raise RuntimeError(child.failure(f"exited with status {child.poll()} before {url} answered"))
        if time.monotonic() > deadline:
            raise RuntimeError(child.failure(f"did not answer {url} within {timeout_s:.0f} s") if child else
                               f"{url} did not answer within {timeout_s:.0f} s")
        if stop is not None and stop.wait(0.2):
            raise RuntimeError(f"stopped while waiting for {url}")
        if stop is None:
            time.sleep(0.2)
