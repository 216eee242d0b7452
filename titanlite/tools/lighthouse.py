"""torchft's lighthouse, in the foreground: `scripts/python.sh -m titanlite.tools.lighthouse --min_replicas N
--port P`.

The replica groups of a fault-tolerant job (`fault_tolerance.enable`) ask it each step which groups are alive;
it forms the quorum of those that asked within `--join_timeout_ms` and drops a group whose heartbeats stopped
for `--heartbeat_timeout_ms`. It prints one line with its address (the groups' `TORCHFT_LIGHTHOUSE`) and runs
until SIGINT or SIGTERM, then exits 0. Needs the `ft` extra (TITANLITE_EXTRAS=ft); without it, one line and
exit code 2. docs/fault_tolerance.md.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import socket
import sys
import threading

from titanlite.errors import Stopped, UserError, run_tool
from titanlite.fault_tolerance.rules import INSTALL


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m titanlite.tools.lighthouse", description=__doc__.split("\n\n")[0])
    p.add_argument("--min_replicas", type=int, required=True, help="the fewest replica groups a quorum forms with")
    p.add_argument("--port", type=int, default=29510, help="the port to serve on (default 29510, torchft's)")
    p.add_argument("--bind", default="[::]", help="the address to listen on (default every interface)")
    p.add_argument(
        "--join_timeout_ms",
        type=int,
        default=1000,
        help="how long a quorum waits for the groups of the previous one to ask again (default 1000)",
    )
    p.add_argument("--quorum_tick_ms", type=int, default=100, help="how often quorums are formed (default 100)")
    p.add_argument(
        "--heartbeat_timeout_ms",
        type=int,
        default=5000,
        help="a group whose heartbeats stopped this long is left out of the next quorum (default 5000)",
    )
    args = p.parse_args(argv)
    if args.min_replicas < 1:
        raise UserError(f"--min_replicas {args.min_replicas}: at least 1")
    return args


def main(argv: list[str]) -> int:
    args = parse(argv)
    if importlib.util.find_spec("torchft") is None:
        raise UserError(f"the lighthouse is torchft's, the `ft` extra: {INSTALL}")
    os.environ.setdefault("RUST_LOG", "warn")  # torchft logs each quorum tick at INFO; RUST_LOG=info shows them
    from torchft.coordination import LighthouseServer

    try:
        server = LighthouseServer(
            bind=f"{args.bind}:{args.port}",
            min_replicas=args.min_replicas,
            join_timeout_ms=args.join_timeout_ms,
            quorum_tick_ms=args.quorum_tick_ms,
            heartbeat_timeout_ms=args.heartbeat_timeout_ms,
        )
    except Exception as e:  # torchft's own error: the port taken, an address that does not parse
        raise UserError(f"lighthouse: cannot serve on {args.bind}:{args.port} ({str(e).splitlines()[0]})") from None
    address = f"http://{socket.gethostname()}:{args.port}"
    print(
        f"lighthouse: serving on {address} for at least {args.min_replicas} replica group(s); start each group "
        f"with TORCHFT_LIGHTHOUSE={address} (SIGINT or SIGTERM stops it)",
        flush=True,
    )
    try:
        threading.Event().wait()
    except Stopped:
        server.shutdown()
        print("lighthouse: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(run_tool(main))
