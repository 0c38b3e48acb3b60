"""Warm starts for local peers: a template process imports torch and Lightning once, then forks each peer.

A peer that starts as a fresh interpreter spends about 6 s of CPU importing torch and Lightning (measured on a
2-core machine: ``benchmarks/RESULTS.md``, "warm starts"). A local swarm starts many peers on few cores, so
:class:`~lightning_swarm.launch.LocalSwarm` forks them from a template that paid for those imports once. The forked
peer then runs its script as ``python script.py`` would: its own session, arguments, environment, working directory
and log, ``__main__`` set, ``atexit`` handlers run at its exit.

Only torch and Lightning are preloaded, never hivemind or this package, which read ``HIVEMIND_*`` and ``SWARM_*``
variables when imported. Any other variable may be read at import time, so a template serves only peers whose
environment equals its own apart from those two families; a peer with another environment gets a template of its
own. The template never initializes CUDA, so forked peers may use it.

This file runs as the template (``python prefork.py``): it then imports nothing of this package.
"""

from __future__ import annotations

import atexit
import gc
import json
import os
import select
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

RUNTIME_ONLY = ("SWARM_", "HIVEMIND_")  # variables read after the preloaded imports: they may differ per peer
MAX_TEMPLATES = 2  # templates kept at once (a process's swarms mostly share one environment)
UNKNOWN_EXIT = 255  # the exit code reported for a peer whose template died before it (its parent is gone)
REPORT_TIMEOUT = 10.0  # seconds to wait for the exit code of a peer the template reaped (sent right after)


class TemplateError(RuntimeError):
    """The template process is gone: peers can no longer be forked from it."""


class ForkedProcess:
    """A peer forked by a template: the part of :class:`subprocess.Popen` that launchers use (``pid``,
    ``returncode``, ``poll``, ``wait``). The peer is the template's child, which reports its exit code."""

    def __init__(self, template: Template, pid: int, args: list[str]) -> None:
        self.template, self.pid, self.args = template, pid, args
        self.returncode: Optional[int] = None

    def poll(self) -> Optional[int]:
        if self.returncode is None:
            self.returncode = self.template.exit_code(self.pid)
        return self.returncode

    def wait(self, timeout: Optional[float] = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() >= deadline:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self.template.changed(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
        return self.returncode


class Template:
    """The launcher's side of one template process: asks it to fork peers and learns their exit codes."""

    def __init__(self, env: dict[str, str]) -> None:
        self._stderr = tempfile.TemporaryFile()
        self.process = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__)],
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            start_new_session=True,  # a Ctrl-C meant for the launcher must not reach it: it ends when its stdin does
        )
        self._state = threading.Condition()
        self._pids: dict[int, int] = {}  # request -> pid forked for it
        self._codes: dict[int, int] = {}  # pid -> exit code
        self._requests = 0
        self._gone = False
        threading.Thread(target=self._read, name="swarm-template-reader", daemon=True).start()

    def spawn(self, argv: list[str], env: dict[str, str], cwd: str, log: str, timeout: float = 120.0) -> ForkedProcess:
        """Fork a peer running ``argv`` (a script's path, then its arguments) with ``env``, in ``cwd``, its output
        into the file ``log``. ``timeout``: seconds to wait for the template (its imports included)."""
        with self._state:
            self._requests += 1
            request = self._requests
            line = json.dumps({"id": request, "argv": argv, "env": env, "cwd": cwd, "log": log}) + "\n"
            try:
                self.process.stdin.write(line.encode())
                self.process.stdin.flush()
            except (BrokenPipeError, ValueError) as e:
                raise TemplateError(f"the template process is gone: {self._why()}") from e
            if not self._state.wait_for(lambda: request in self._pids or self._gone, timeout):
                raise TemplateError(f"the template process did not fork a peer within {timeout:.0f}s")
            if request not in self._pids:
                raise TemplateError(f"the template process is gone: {self._why()}")
            return ForkedProcess(self, self._pids.pop(request), argv)

    def exit_code(self, pid: int) -> Optional[int]:
        """The peer's exit code, None while it runs (or has exited, not yet reaped). A peer already reaped has its
        report on the way: it is awaited, so that a peer never seems to run once its pid is gone."""
        with self._state:
            if pid not in self._codes and not _exists(pid):
                self._state.wait_for(lambda: pid in self._codes or self._gone, REPORT_TIMEOUT)
            if pid in self._codes:
                return self._codes[pid]
            return UNKNOWN_EXIT if not _exists(pid) else None

    def changed(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for news from the template (a peer forked or exited)."""
        with self._state:
            self._state.wait(timeout)

    @property
    def alive(self) -> bool:
        return not self._gone and self.process.poll() is None

    def close(self) -> None:
        """End the template. Peers it forked run on (in sessions of their own): their launcher stops them."""
        try:
            self.process.stdin.close()
        except OSError:
            pass
        try:
            self.process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self._stderr.close()

    def _read(self) -> None:
        for line in self.process.stdout:
            message = json.loads(line)
            with self._state:
                if "exited" in message:
                    self._codes[message["exited"]] = message["code"]
                else:
                    self._pids[message["id"]] = message["pid"]
                self._state.notify_all()
        with self._state:
            self._gone = True
            self._state.notify_all()

    def _why(self) -> str:
        self.process.poll()
        self._stderr.seek(0)
        return f"exit code {self.process.returncode}: {self._stderr.read()[-2000:].decode(errors='replace')}"


_templates: dict[tuple, Template] = {}
_templates_lock = threading.Lock()


def spawn(argv: list[str], env: dict[str, str], cwd: str, log: str) -> ForkedProcess:
    """Fork a peer from the template for ``env``: the one started with an environment that differs from ``env`` in
    :data:`RUNTIME_ONLY` variables at most, started now if there is none. Raises :class:`TemplateError` if it cannot
    fork the peer; the caller may then start the peer as a fresh interpreter."""
    key = tuple(sorted((k, v) for k, v in env.items() if not k.startswith(RUNTIME_ONLY)))
    with _templates_lock:
        template = _templates.get(key)
        if template is not None and not template.alive:
            _templates.pop(key).close()
            template = None
        if template is None:
            while len(_templates) >= MAX_TEMPLATES:
                _templates.pop(next(iter(_templates))).close()
            template = _templates[key] = Template(env)
    return template.spawn(argv, env, cwd, log)


@atexit.register
def close_templates() -> None:
    """End every template this process started (peers they forked run on)."""
    with _templates_lock:
        while _templates:
            _templates.popitem()[1].close()


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


# ---- the template process ---------------------------------------------------------------------------------------


def _send(message: dict) -> None:
    os.write(1, (json.dumps(message) + "\n").encode())


def _reap() -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        _send({"exited": pid, "code": os.waitstatus_to_exitcode(status)})


def _become(request: dict) -> None:
    """In the forked child: turn into ``python script args`` and run it; never returns (exits as Python does)."""
    import runpy

    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    script = request["argv"][0]
    sys.argv = list(request["argv"])
    sys.path.insert(0, os.path.dirname(os.path.realpath(script)))  # as ``python script`` puts it first
    import numpy

    numpy.random.seed()  # the legacy global generator was seeded once, in the template (Python's random reseeds)
    runpy.run_path(script, run_name="__main__")
    sys.exit(0)


def main() -> None:
    del sys.path[0]  # this file's folder: its modules are not top-level modules
    import lightning  # noqa: F401  (the imports every peer shares)
    import torch

    assert not torch.cuda.is_initialized(), "the template must not initialize CUDA: its forks could not use it"
    # the imports' objects, in every fork, are never garbage: no collection walks them (a peer's exit spent 1 of its
    # 3 s of leaving in the final collection)
    gc.freeze()
    pending = b""
    while True:
        readable, _, _ = select.select([0], [], [], 0.2)
        _reap()
        if not readable:
            continue
        chunk = os.read(0, 1 << 16)
        if not chunk:
            return  # the launcher closed the pipe, or exited
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                _become(request)
            _send({"id": request["id"], "pid": pid})


if __name__ == "__main__":
    main()
