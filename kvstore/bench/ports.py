"""Free TCP ports for the servers that benchmarks and test tools start."""

import contextlib
import socket
from typing import List


def free_ports(n: int, *, host: str = "127.0.0.1") -> List[int]:
    """``n`` distinct TCP ports free on ``host`` now, the kernel's picks.

    Every socket stays bound until all ``n`` are picked: a port picked and closed is
    free again, and the next pick may be the same one (a server told to listen on
    one port twice, for its API and its metrics, fails on the second after the first
    already answers).
    """
    with contextlib.ExitStack() as held:
        ports = []
        for _ in range(n):
            s = held.enter_context(socket.socket())
            s.bind((host, 0))
            ports.append(s.getsockname()[1])
        return ports
