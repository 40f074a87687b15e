"""Scripts run as a user runs them (``python script.py ...``, ``python -m module ...``), each in a process
forked from one server that imported torch, rsdp, transformers and peft once, instead of in a new
interpreter that imports them again (~6-12 s a script on 2 cores, more than most of these scripts run).

The server is multiprocessing's fork server with those modules preloaded. Pitfall: it must not be
pytest's own process. A child forked from a process that ran parallel work hangs in its first parallel
region under GNU OpenMP, and these scripts choose their own thread counts (``cpu_count // ranks``); the
fork server is started as a new interpreter and never runs a tensor op, so its children may use any
number of threads. (rank_pool's ranks and torchtitan's launches are forked from pytest, and run with
one thread each.)

Each script runs as ``__main__`` with its own argv, working directory, ``sys.path[0]`` (the script's
folder, as ``python script.py`` sets it) and environment (pytest's at the call, as ``subprocess.run``
passes it, updated with ``env``); what it prints comes back as a ``subprocess.CompletedProcess``. A
script that outlives its timeout is killed with every process it started, and ``subprocess.TimeoutExpired``
raised, as ``subprocess.run`` does.
"""

import multiprocessing
import os
import runpy
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

PRELOADED = ("torch", "torch.distributed", "rsdp", "transformers", "peft")


class ScriptRunner:
    def __init__(self, preload: tuple[str, ...] = PRELOADED):
        self._context = multiprocessing.get_context("forkserver")
        # This module too, so that each child finds _run_script without importing anything.
        self._context.set_forkserver_preload([*preload, __name__])

    def run(self, argv: list[str], *, cwd=None, env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """Run ``python *argv`` (a script path, or ``-m`` and a module, then its arguments)."""
        argv = [str(arg) for arg in argv]
        environment = {**os.environ, **(env or {})}
        with tempfile.TemporaryDirectory(prefix="rsdp-script-") as logs:
            stdout, stderr = Path(logs, "stdout"), Path(logs, "stderr")
            process = self._context.Process(
                target=_run_script, args=(argv, str(cwd or os.getcwd()), environment, str(stdout), str(stderr))
            )
            process.start()
            process.join(timeout_s)
            if process.exitcode is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)  # the script and the ranks it started
                except ProcessLookupError:
                    process.kill()
                process.join()
                raise subprocess.TimeoutExpired(["python", *argv], timeout_s, stdout.read_text(), stderr.read_text())
            return subprocess.CompletedProcess(["python", *argv], process.exitcode, stdout.read_text(), stderr.read_text())


def _run_script(argv: list[str], cwd: str, environment: dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked child: become ``python *argv`` started in ``cwd`` with ``environment``."""
    os.setpgrp()  # one group with whatever the script starts, to kill them all on a timeout
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    for fd, path in ((1, stdout), (2, stderr)):
        with open(path, "w") as log:
            os.dup2(log.fileno(), fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    if argv[0] == "-m":
        sys.argv = argv[1:]  # run_module puts the module's path in argv[0], as python -m does
        runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = argv
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
        runpy.run_path(argv[0], run_name="__main__")
