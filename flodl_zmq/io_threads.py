"""The controller process's ZeroMQ context, and which of its I/O threads each socket may use.

Each relay's host frame in and each consensus copy out should run on an I/O
thread of its own, on a core of its own, instead of queueing behind the others
on one. ZeroMQ puts every new connection (and listener) on the least-loaded
I/O thread its socket's ZMQ_AFFINITY mask allows, and a socket with no mask
may take any. So the data ROUTER and the PUB each get their own threads, and
every other socket of the context (the coordinator's control ROUTER, the join
ROUTER) is kept on threads of its own: left free, their connections made both
relays' data links share one thread in three runs out of four.
"""

from __future__ import annotations

from typing import NamedTuple

import zmq

# Two threads for the data ROUTER, two for the PUB, one for everything else.
CONTROLLER_IO_THREADS = 5


class Affinity(NamedTuple):
    """ZMQ_AFFINITY masks; 0 means any thread."""

    data: int  # the reducer's data ROUTER
    pub: int  # the reducer's PUB
    other: int  # every other socket on the context


def controller_context() -> zmq.Context:
    """The controller process's shared ZeroMQ context (the coordinator's inproc links need the reducer's)."""
    return zmq.Context.instance(io_threads=CONTROLLER_IO_THREADS)


def io_affinity(ctx: zmq.Context) -> Affinity:
    """Disjoint masks over ``ctx``'s I/O threads: as many for the data ROUTER as for the PUB, the rest for others.

    A mask naming no thread would drop connections, so a context with fewer
    than three I/O threads gets masks of 0: any.
    """
    n = ctx.get(zmq.IO_THREADS)
    if n < 3:
        return Affinity(0, 0, 0)
    share = (n - 1) // 2
    data = (1 << share) - 1
    pub = data << share
    return Affinity(data, pub, ((1 << n) - 1) ^ data ^ pub)


def keep_off_the_data_plane(sock: zmq.Socket) -> None:
    """Pin ``sock`` (before it binds or connects) to its context's I/O threads that carry no model bytes."""
    sock.setsockopt(zmq.AFFINITY, io_affinity(sock.context).other)
