"""Start the ranks of a test worker by forking them from one process that has imported torch, DTensor,
Dynamo and titanlite's trainer, instead of torchrun's agent starting N interpreters that import them each.

`python tests/workers/ranks.py N SCRIPT ARGS...` (`harness.launch_workers`). The suite is bound by CPU,
and a rank's imports cost about 3 CPU-seconds: a 2-rank launch of a worker spares the agent's imports and
one rank's, an 8-rank one seven ranks'. Only test workers start this way; whatever users start (a run,
an export) runs under torchrun or `run_train.sh` in the tests.

Each child gets what torchrun gives a rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RUN_ID, TORCHELASTIC_RESTART_COUNT) and runs SCRIPT as `__main__`.
As torchrun's agent does, this process hosts the rendezvous store (TORCHELASTIC_USE_AGENT_STORE): it is
created on a free port once the children exist (a store's server threads must not be forked), and each
child reads the port from a pipe. A child dies with this process (PR_SET_PDEATHSIG). When a rank fails,
the others are killed (they would wait in a collective until the group's timeout) and this process exits
with the failed rank's code.
"""

from __future__ import annotations

import ctypes
import os
import runpy
import signal
import sys
import traceback
import uuid

PR_SET_PDEATHSIG = 1


def run_rank(rank: int, nproc: int, port_pipe: int, run_id: str, script: str, args: list[str]) -> int:
    """This child's rank: wait for the store's port, then run `script` as torchrun would; its exit code."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    port = os.read(port_pipe, 16).decode()
    os.close(port_pipe)
    if not port:  # the launcher failed before it had a store
        return 1
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        ROLE_RANK=str(rank),
        GROUP_RANK="0",
        WORLD_SIZE=str(nproc),
        LOCAL_WORLD_SIZE=str(nproc),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=port,
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
    )
    sys.argv = [script, *args]
    # As torchrun puts the script's folder first; the tests' helpers (harness, builders) follow, for a test
    # module under tests/unit/ or tests/runs/ that is its own worker.
    sys.path[0:1] = [
        os.path.dirname(os.path.abspath(script)),
        os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    ]
    try:
        runpy.run_path(script, run_name="__main__")
        return 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException:
        traceback.print_exc()
        return 1


def main() -> None:
    nproc, script, args = int(sys.argv[1]), sys.argv[2], sys.argv[3:]
    import torch._dynamo  # noqa: F401  (what every rank imports: the optimizer's constructor imports Dynamo)
    import torch.distributed as dist

    import titanlite.run.trainer  # noqa: F401

    run_id = uuid.uuid4().hex
    children: set[int] = set()
    writers: list[int] = []
    for rank in range(nproc):
        read, write = os.pipe()
        pid = os.fork()
        if pid == 0:
            for w in [*writers, write]:
                os.close(w)
            code = run_rank(rank, nproc, read, run_id, script, args)
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        os.close(read)
        writers.append(write)
        children.add(pid)
    store = dist.TCPStore("127.0.0.1", 0, nproc, is_master=True, wait_for_workers=False)
    for w in writers:
        os.write(w, str(store.port).encode())
        os.close(w)
    code = 0
    while children:
        pid, status = os.wait()
        children.remove(pid)
        rc = os.waitstatus_to_exitcode(status)
        if rc != 0 and code == 0:
            code = rc if rc > 0 else 128 - rc
            for other in children:
                os.kill(other, signal.SIGKILL)
    sys.exit(code)


if __name__ == "__main__":
    main()
