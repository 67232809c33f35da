"""Test doubles for the data plane: a scripted rank and a raw-socket controller.

Both speak the real wire (Codec) over real sockets; they exist so a test can
drive one service while holding every byte on the other side of it.
"""

from __future__ import annotations

import os
import uuid
from typing import Any

import numpy as np
import zmq

from flodl_zmq.links import (
    REDUCER_SENDER,
    RELAY_ROUTE,
    TAG_BCAST,
    TAG_DATA,
    coordinator_sender,
    host_token,
    rank_identity,
    rank_sender,
)
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16
from flodl_zmq.wire import Channel, Codec, Envelope
from flodl_zmq.wire.records import Consensus, Exiting, Heartbeat, RoundFrame

ROUTE_SECRET = bytes(range(32))  # the controller's, in these tests: what each host's token derives from


def token(host: str) -> bytes:
    """`host`'s token under ROUTE_SECRET, as its relay's hello carries it (PROTOCOL.md 10.5)."""
    return host_token(ROUTE_SECRET, host)


WAIT_S = 30.0  # every wait in these tests is bounded by this: a hang guard, far above any loaded machine's delay


def endpoints(kind: str, tmp_path: Any = None) -> dict[str, str]:
    """Fresh endpoints for one controller and two relays: inproc or ipc."""
    tag = uuid.uuid4().hex[:8]
    if kind == "inproc":
        mk = lambda name: f"inproc://{tag}-{name}"  # noqa: E731
    else:
        mk = lambda name: f"ipc://{os.path.join(str(tmp_path), tag + '-' + name)}"  # noqa: E731
    names = ["control", "data", "bcast", "a-control", "a-data", "b-control", "b-data"]
    return {n: mk(n) for n in names}


def model(rank: int, round_id: int, sizes: tuple[int, ...] = (1000, 37)) -> list[np.ndarray]:
    """A rank's parameters for a round (float64, deterministic)."""
    rng = np.random.default_rng(1000 * round_id + rank)
    return [rng.standard_normal(n) * (1 + rank) for n in sizes]


def to_wire(params: list[np.ndarray], mass: float, dtype: str) -> list[np.ndarray]:
    """Pre-scale by the mass and encode in the wire dtype, as a rank does."""
    out = []
    for p in params:
        f = (p * mass).astype(np.float32)
        if dtype == "bf16":
            u = np.empty(f.shape, np.uint16)
            out.append(bf16_from_f32(f, u))
        else:
            out.append(f)
    return out


def from_wire(arrays: list[np.ndarray], dtypes: list[str]) -> list[np.ndarray]:
    out = []
    for a, dt in zip(arrays, dtypes, strict=True):
        if dt == "bf16":
            f = np.empty(a.shape, np.float32)
            out.append(f32_from_bf16(a, f).astype(np.float64))
        else:
            out.append(a.astype(np.float64))
    return out


def reference(contribs: list[tuple[list[np.ndarray], float]], dtype: str) -> list[np.ndarray]:
    """float64 weighted mean of what the ranks actually put on the wire."""
    total = sum(m for _, m in contribs)
    sums = None
    for params, mass in contribs:
        wire = from_wire(to_wire(params, mass, dtype), [dtype] * len(params))
        sums = wire if sums is None else [s + w for s, w in zip(sums, wire, strict=True)]
    return [s / total for s in sums]


def bf16_round(x: np.ndarray) -> np.ndarray:
    """float64 -> nearest bf16 (via f32, ties to even) -> float64."""
    f = x.astype(np.float32)
    return from_wire([bf16_from_f32(f, np.empty(f.shape, np.uint16))], ["bf16"])[0]


def tiered_bf16_reference(hosts: list[list[tuple[list[np.ndarray], float]]]) -> list[np.ndarray]:
    """The bf16 wire's exact-arithmetic result: each host's sum rounded once to bf16 (a fold tier
    keeps the schema), the hosts' sum divided by the mass and rounded once more."""
    total = sum(m for contribs in hosts for _, m in contribs)
    sums = None
    for contribs in hosts:
        host = None
        for params, mass in contribs:
            wire = from_wire(to_wire(params, mass, "bf16"), ["bf16"] * len(params))
            host = wire if host is None else [s + w for s, w in zip(host, wire, strict=True)]
        host = [bf16_round(h) for h in host]
        sums = host if sums is None else [s + h for s, h in zip(sums, host, strict=True)]
    return [bf16_round(s / total) for s in sums]


def rel_error(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    num = sum(float(np.sum((g - w) ** 2)) for g, w in zip(got, want, strict=True))
    den = sum(float(np.sum(w**2)) for w in want)
    return (num / den) ** 0.5


class FakeRank:
    """One rank's two DEALERs on its relay, driven step by step from the test thread."""

    def __init__(self, ctx: zmq.Context, rank: int, key: bytes, run_id: bytes, local_control: str, local_data: str):
        self.rank = rank
        self.codec = Codec(key, run_id, rank_sender(rank))
        self.control = ctx.socket(zmq.DEALER)
        self.data = ctx.socket(zmq.DEALER)
        for s, ep in ((self.control, local_control), (self.data, local_data)):
            s.setsockopt(zmq.IDENTITY, rank_identity(rank))
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)

    def heartbeat(self) -> None:
        self.control.send_multipart(self.codec.encode(Heartbeat(self.rank, 0)))

    def goodbye(self) -> None:
        self.control.send_multipart(self.codec.encode(Exiting(self.rank)))

    def deposit(self, round_id: int, mass: float, tensors: list[np.ndarray], dtype: str = "f32") -> list[Any]:
        frames = self.codec.encode(RoundFrame(round_id, self.rank, mass), tensors, dtypes=[dtype] * len(tensors))
        self.data.send_multipart(frames)
        return frames

    def consensus(self, timeout: float = WAIT_S, heartbeat: bool = False) -> Envelope:
        """The next consensus delivered to this rank (heartbeating while it waits if asked)."""
        decoder = Codec(self.codec.key, self.codec.incarnation, "test")
        waited = 0.0
        while waited < timeout:
            if heartbeat:
                self.heartbeat()
            if self.data.poll(100):
                env = decoder.decode(self.data.recv_multipart(), Channel.BROADCAST, replay=False)
                assert isinstance(env.record, Consensus)
                return env
            waited += 0.1
        raise TimeoutError(f"rank {self.rank}: no consensus within {timeout} s")

    def nothing_within(self, seconds: float) -> bool:
        return not self.data.poll(int(seconds * 1000))

    def close(self) -> None:
        self.control.close(0)
        self.data.close(0)


class FakeController:
    """The controller's three sockets as raw sockets: a test plays coordinator and reducer by hand.

    `data_rcvhwm`: the data socket's receive queue, in records (a reducer that stops reading
    backs a relay's sends up once it is full).
    """

    def __init__(self, ctx: zmq.Context, key: bytes, run_id: bytes, eps: dict[str, str], data_rcvhwm: int = 1000):
        self.codec = Codec(key, run_id, REDUCER_SENDER)
        self.key, self.run_id = key, run_id
        self.decoder = Codec(key, run_id, "test")
        self.control = ctx.socket(zmq.ROUTER)
        self.data = ctx.socket(zmq.ROUTER)
        self.pub = ctx.socket(zmq.PUB)
        self.data.setsockopt(zmq.RCVHWM, data_rcvhwm)  # before bind: it sizes each connection's queue
        for s, ep in ((self.control, eps["control"]), (self.data, eps["data"]), (self.pub, eps["bcast"])):
            s.setsockopt(zmq.LINGER, 0)
            s.bind(ep)
        self.data_route: bytes | None = None
        self.control_route: bytes | None = None

    def recv(self, sock: zmq.Socket, timeout: float = WAIT_S) -> list[bytes]:
        if not sock.poll(int(timeout * 1000)):
            raise TimeoutError("the relay sent nothing")
        return sock.recv_multipart()

    def data_record(self, timeout: float = WAIT_S, skip: tuple[str, ...] = ("data.subscriber_ready",)) -> Envelope:
        """The next data-channel record from the relay (its route remembered)."""
        while True:
            msg = self.recv(self.data, timeout)
            self.data_route = msg[0]
            env = self.decoder.decode(msg[1:], Channel.DATA)
            if env.kind not in skip:
                return env

    def control_message(self, timeout: float = WAIT_S) -> tuple[bytes, Envelope]:
        """(route frame, decoded record) of the next upstream control message."""
        msg = self.recv(self.control, timeout)
        self.control_route = msg[0]
        return msg[1], self.decoder.decode(msg[2:], Channel.CONTROL, replay=False)

    def coordinator(self, rank: int) -> Codec:
        """A codec signing as the coordinator's stream to `rank` (a fresh counter each time)."""
        return Codec(self.key, self.run_id, coordinator_sender(rank))

    def to_relay(self, rec: Any) -> None:
        self.data.send_multipart([self.data_route, TAG_DATA, *self.codec.encode(rec, channel=Channel.DATA)])

    def to_rank(self, rank: int, frames: list[Any]) -> None:
        self.control.send_multipart([self.control_route, rank_identity(rank), *frames])

    def publish(self, round_id: int, mass: float, tensors: list[np.ndarray], dtype: str = "f32") -> list[Any]:
        frames = self.codec.encode(Consensus(round_id, mass), tensors, channel=Channel.BROADCAST,
                                   dtypes=[dtype] * len(tensors))
        self.pub.send_multipart(frames)
        return frames

    def resend(self, frames: list[Any]) -> None:
        self.data.send_multipart([self.data_route, TAG_BCAST, *frames])

    def close(self) -> None:
        for s in (self.control, self.data, self.pub):
            s.close(0)


__all__ = ["RELAY_ROUTE", "FakeController", "FakeRank"]
