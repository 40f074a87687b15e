"""Scripts run as a user runs them (``python script.py ...``, ``python -m module ...``), each in a process
forked from one server that imported torch, rsdp, transformers, peft and trl once, instead of in a new
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

``run_ranks`` starts a script on several ranks as ``torchrun --nproc-per-node N`` does: one process per
rank with the environment torchrun's agent gives its workers (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``,
``MASTER_ADDR``/``MASTER_PORT`` for an ``env://`` rendezvous that rank 0 hosts, as without the agent's
store; ``OMP_NUM_THREADS=1`` unless set); when a rank fails the others are stopped, and the ranks'
outputs come back one after the other, rank 0's first.
"""

import multiprocessing
import multiprocessing.connection
import os
import runpy
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

PRELOADED = ("torch", "torch.distributed", "rsdp", "transformers", "peft", "trl")


class ScriptRunner:
    def __init__(self, preload: tuple[str, ...] = PRELOADED):
        self._context = multiprocessing.get_context("forkserver")
        # This module too, so that each child finds _run_script without importing anything.
        self._context.set_forkserver_preload([*preload, __name__])

    def run(self, argv: list[str], *, cwd=None, env: dict[str, str] | None = None, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """Run ``python *argv`` (a script path, or ``-m`` and a module, then its arguments)."""
        return self._launch(argv, [env or {}], cwd, timeout_s)

    def run_ranks(self, nproc: int, argv: list[str], *, cwd=None, timeout_s: float = 300) -> subprocess.CompletedProcess:
        """Run ``torchrun --nproc-per-node nproc *argv`` (see the module's docstring)."""
        common = {
            "LOCAL_WORLD_SIZE": str(nproc), "WORLD_SIZE": str(nproc), "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "1",
            "ROLE_NAME": "default", "ROLE_WORLD_SIZE": str(nproc), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()),
            "TORCHELASTIC_RESTART_COUNT": "0", "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "rsdp-tests",
            "TORCHELASTIC_USE_AGENT_STORE": "False", "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1"),
        }  # fmt: skip
        envs = [{**common, "RANK": str(rank), "LOCAL_RANK": str(rank), "ROLE_RANK": str(rank)} for rank in range(nproc)]
        return self._launch(argv, envs, cwd, timeout_s)

    def _launch(self, argv: list[str], envs: list[dict[str, str]], cwd, timeout_s: float) -> subprocess.CompletedProcess:
        """One process per environment in ``envs``; the first failure stops the others."""
        argv = [str(arg) for arg in argv]
        with tempfile.TemporaryDirectory(prefix="rsdp-script-") as logs:
            outputs = [(Path(logs, f"stdout-{i}"), Path(logs, f"stderr-{i}")) for i in range(len(envs))]
            processes = []
            for env, (stdout, stderr) in zip(envs, outputs):
                environment = {**os.environ, **env}
                processes.append(self._context.Process(
                    target=_run_script, args=(argv, str(cwd or os.getcwd()), environment, str(stdout), str(stderr))
                ))
                processes[-1].start()
            deadline = time.monotonic() + timeout_s
            failed = None
            while failed is None and any(p.exitcode is None for p in processes) and time.monotonic() < deadline:
                multiprocessing.connection.wait([p.sentinel for p in processes if p.exitcode is None], deadline - time.monotonic())
                failed = next((p for p in processes if p.exitcode not in (None, 0)), None)
            timed_out = failed is None and any(p.exitcode is None for p in processes)
            for process in processes:
                if process.exitcode is None:
                    _kill_group(process)
            stdout = "".join(out.read_text() for out, _ in outputs)
            stderr = "".join(err.read_text() for _, err in outputs)
            command = ["python", *argv]
            if timed_out:
                raise subprocess.TimeoutExpired(command, timeout_s, stdout, stderr)
            return subprocess.CompletedProcess(command, (failed or processes[0]).exitcode, stdout, stderr)


def _kill_group(process) -> None:
    """Kill ``process`` and every process it started (``_run_script`` made it a group's leader)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        process.kill()
    process.join()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _run_script(argv: list[str], cwd: str, environment: dict[str, str], stdout: str, stderr: str) -> None:
    """In the forked child: become ``python *argv`` started in ``cwd`` with ``environment``."""
    os.setpgrp()  # one group with whatever the script starts, to kill them all on a timeout
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(environment)
    if environment.get("OMP_NUM_THREADS"):  # read by a new interpreter's torch; the server's has chosen already
        torch.set_num_threads(int(environment["OMP_NUM_THREADS"]))
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
