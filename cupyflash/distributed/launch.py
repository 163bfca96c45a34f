"""``python -m cupyflash.distributed.launch --nproc N script.py [args...]``: N processes, one per GPU.

Each process gets RANK and LOCAL_RANK (0..N-1), WORLD_SIZE (N), MASTER_ADDR and
MASTER_PORT in its environment, as torchrun sets them, so the script's
``cupyflash.distributed.from_env()`` joins the NCCL group on GPU LOCAL_RANK. The launcher
waits for all of them; when one fails it stops the others and exits with its status.
One host only (for several hosts start the processes yourself with those variables).
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time


def _free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(nproc, argv, *, port=None, addr="127.0.0.1", poll=0.2):
    """Run ``python argv...`` in ``nproc`` processes with the ring's environment; returns
    the first nonzero exit status (0 when all succeed)."""
    if nproc < 1:
        raise ValueError(f"--nproc must be >= 1, got {nproc}")
    port = port or _free_port()
    procs = []
    for rank in range(nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(nproc),
                   MASTER_ADDR=addr, MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, *argv], env=env))
    status = 0
    try:
        while procs:
            for p in list(procs):
                code = p.poll()
                if code is None:
                    continue
                procs.remove(p)
                if code and not status:
                    status = code
                    for other in procs:   # a rank that failed leaves the others waiting on it
                        other.terminate()
            time.sleep(poll)
    finally:
        for p in procs:
            p.kill()
    return status


def main(args=None):
    parser = argparse.ArgumentParser(
        prog="python -m cupyflash.distributed.launch",
        description="Start one process per GPU with RANK, LOCAL_RANK, WORLD_SIZE, MASTER_ADDR "
                    "and MASTER_PORT set (for cupyflash.distributed.from_env).")
    parser.add_argument("--nproc", type=int, required=True, help="processes (GPUs) to start")
    parser.add_argument("--port", type=int, default=None, help="rendezvous port (default: a free one)")
    parser.add_argument("script", help="the Python script each process runs")
    parser.add_argument("script_args", nargs=argparse.REMAINDER, help="its arguments")
    ns = parser.parse_args(args)
    return launch(ns.nproc, [ns.script, *ns.script_args], port=ns.port)


if __name__ == "__main__":
    sys.exit(main())
