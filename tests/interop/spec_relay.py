"""A per-host relay written from protocol/PROTOCOL.md alone: pyzmq, msgpack, numpy, hashlib/hmac, cryptography.

It imports nothing of flodl_zmq (tests/interop/test_spec_relay.py checks); the framing, MAC and
endpoint rules it shares with the other spec peer come from tests/interop/spec_rank.py, written from
the spec the same way. A run it serves between our real ranks and controller proves the spec is
enough to write a relay. Scope: one host, f32, a normal run: it routes control records both ways
(3.1, 7, 10.7 items 5 and 9 with a hold of zero), says `relay.hello` on both upstream sockets until
acknowledged (9.4), answers the readiness probe (10.2), folds the deposits (framed or by reference,
3.5) into one `data.host_frame` (9.5, 10.1), forwards each consensus verbatim to its live ranks, and
reports a rank that says goodbye or goes silent (`relay.rank_exit`, restated every 2 s, 10.7 item 8).

Learns its run from the environment its spawner gives (FLODL_KEY, FLODL_INCARNATION, FLODL_HOST,
FLODL_WORLD, FLODL_CONTROLLER, FLODL_HOST_TOKEN: 2, 10.5 item 3). Runs until SIGTERM, then writes a
JSON log to `--out`: each round it shipped (masses, summed values), each consensus it delivered
(mass, values) and its counters; it serves small test models, whose values fit a log.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import signal
import stat
import struct
import sys
import time
from pathlib import Path

import msgpack
import numpy as np
import zmq

sys.path.insert(0, str(Path(__file__).resolve().parent))
from spec_rank import Wire, local_endpoints, mac  # noqa: E402

REFERENCE_MAC_LABEL = b"flodl-zmq/10/by-reference\x00"  # 3.5
HELLO_S, RESTATE_S = 1.0, 2.0  # 10
RANK_SILENCE_S, RANK_FIRST_RECORD_S = 1.5, 60.0
W = 4096  # 5.1
MAX_HEADER = 1 << 20  # 6
RANK_KINDS = {"rank.hello", "timing.batch", "timing.sync_ack", "timing.exiting", "timing.lr_update",  # 9.3
              "timing.heartbeat", "timing.snapshot_ready", "timing.eval_result", "timing.checkpoint_result",
              "timing.epoch_fn_elapsed", "metrics.epoch"}


class Violation(Exception):
    """A rule of 7, 8.1 or 9.5 that a message broke: dropped, counted, logged."""


class Window:
    """5.1: the anti-replay window of one (channel, sender)."""

    def __init__(self) -> None:
        self.top, self.seen = 0, set()

    def accept(self, seq: int) -> bool:
        if seq <= self.top - W or seq in self.seen:
            return False
        self.seen.add(seq)
        self.top = max(self.top, seq)
        self.seen = {s for s in self.seen if s > self.top - W} if len(self.seen) > 2 * W else self.seen
        return True


def reference_payloads(frames: list[bytes], key: bytes, incarnation: bytes, rank: int) -> tuple[list[bytes], bytes]:
    """3.5: a by-reference deposit [b"shm", locator, header, mac] read into (payload frames, header)."""
    _, locator, header, tag = frames
    want = hmac.new(key, REFERENCE_MAC_LABEL + struct.pack("<Q", len(header)) + header
                    + struct.pack("<Q", len(locator)) + locator, hashlib.sha256).digest()
    if len(tag) != 32 or not hmac.compare_digest(want, tag):
        raise Violation("by-reference MAC")
    name, spans = msgpack.unpackb(locator, raw=False)
    prefix = f"flodl-{incarnation.hex()}-r{rank}-"
    if not (name.startswith(prefix) and name[len(prefix):].isdigit() and 1 <= len(name) - len(prefix) <= 10):
        raise Violation(f"segment name {name!r} is not rank {rank}'s")
    digits = hmac.new(key, b"flodl-zmq/private-dir\x00shm\x00" + incarnation, hashlib.sha256).hexdigest()[:24]
    fd = os.open(os.path.join("/dev/shm", "flodl-" + digits, name), os.O_RDONLY | os.O_NOFOLLOW)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o077 or st.st_size == 0:
            raise Violation(f"segment {name} is not a private regular file")
        if any(off + n > st.st_size for off, n in spans):
            raise Violation(f"a frame lies outside segment {name}")
        return [os.pread(fd, n, off) for off, n in spans], header
    finally:
        os.close(fd)


class Fold:
    """One host's open round (9.5, 5.2): deposits checked, held, summed in f32 when the barrier is full."""

    def __init__(self, round_id: int):
        self.round = round_id
        self.deposits: dict[int, tuple[float, list[bytes]]] = {}  # rank -> (mass, its f32 chunks as sent)

    def judge(self, rank: int, mass: float, chunks: list[bytes], largest: float) -> None:
        """9.5's refusals: a non-finite or huge value, a mass far above its host-mates', another layout."""
        first = next(iter(self.deposits.values()), None)
        if first is not None and [len(c) for c in chunks] != [len(c) for c in first[1]]:
            raise Violation(f"rank {rank}'s deposit has another layout than the round's first")
        if not (np.isfinite(mass) and (mass == 0 or mass >= np.finfo(np.float32).tiny)):
            raise Violation(f"rank {rank}'s mass {mass} is not finite and >= 0")
        bound = 1e6 * max(1.0, largest) * max(1.0, mass)
        for c in chunks:
            v = np.frombuffer(c, "<f4")
            if v.size and not (np.isfinite(v).all() and np.abs(v).max() <= bound):
                raise Violation(f"rank {rank}'s deposit holds a non-finite value or one above {bound:g}")
        others = [m for m, _ in self.deposits.values()]
        if others and mass > 1024 * max(1.0, float(np.median(others))):
            raise Violation(f"rank {rank}'s mass {mass} is over 1024 times its host-mates' median")
        if len(others) == 1 and others[0] > 1024 * max(1.0, mass):  # the first two are judged together
            raise Violation(f"rank {next(iter(self.deposits))}'s mass {others[0]} is over 1024 times rank {rank}'s")

    def host_frame(self) -> tuple[float, list[bytes]]:
        """The summed mass and payload; a single deposit goes byte-identical (9.5)."""
        masses, deposits = [m for m, _ in self.deposits.values()], [c for _, c in self.deposits.values()]
        if len(deposits) == 1:
            return masses[0], deposits[0]
        sums = [sum(np.frombuffer(d[i], "<f4") for d in deposits).astype("<f4").tobytes()
                for i in range(len(deposits[0]))]
        return float(sum(masses)), sums


class SpecRelay:
    """The relay's sockets and state, one thread: a poll loop whose timers run every pass."""

    def __init__(self, out: str):
        env = os.environ
        self.key, self.inc = bytes.fromhex(env["FLODL_KEY"]), bytes.fromhex(env["FLODL_INCARNATION"])
        self.host, self.token, self.out = env["FLODL_HOST"], bytes.fromhex(env["FLODL_HOST_TOKEN"]), out
        world = dict(part.split("=") for part in env["FLODL_WORLD"].split(";"))
        self.ranks = sorted(int(r) for r in world[self.host].split(","))
        self.wire = Wire(self.key, self.inc, f"relay:{self.host}")
        self.wire.seq["bcast"] = 0
        host, port = env["FLODL_CONTROLLER"].rsplit(":", 1)
        ctx = zmq.Context()
        ctx.setsockopt(zmq.LINGER, 0)  # what is unsent at SIGTERM is dropped: the run is over
        identity = f"relay:{self.host.encode()[:200].decode(errors='ignore')}:{os.urandom(8).hex()}".encode()
        self.up_ctl, self.up_data = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s, offset in ((self.up_ctl, 0), (self.up_data, 1)):
            s.setsockopt(zmq.IDENTITY, identity)  # 10.5 item 1
            s.setsockopt(zmq.HEARTBEAT_IVL, 1000)
            s.setsockopt(zmq.HEARTBEAT_TIMEOUT, 8000)
            s.connect(f"tcp://{host}:{int(port) + offset}")
        self.up_ctl.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER)  # 6.1
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.sub.connect(f"tcp://{host}:{int(port) + 2}")
        control_ep, data_ep = local_endpoints(self.key, self.inc, self.host)
        os.makedirs(os.path.dirname(control_ep[len("ipc://"):]), mode=0o700, exist_ok=True)
        self.ctl, self.data = ctx.socket(zmq.ROUTER), ctx.socket(zmq.ROUTER)
        self.ctl.setsockopt(zmq.MAXMSGSIZE, MAX_HEADER)
        for s, ep in ((self.ctl, control_ep), (self.data, data_ep)):
            s.bind(ep)
        self.acked = {"control": False, "data": False}
        self.queued: dict[str, list[list[bytes]]] = {"control": [], "data": []}  # until relay.hello_ack
        self.live, self.gone = set(self.ranks), set()  # gone: reported by relay.rank_exit, restated
        self.heard: dict[int, float] = {}
        self.windows: dict[tuple[str, str], Window] = {}
        self.fold: Fold | None = None
        self.shipped: set[int] = set()
        self.delivered: dict[int, list[bytes]] = {}  # round -> the consensus as received (for a rank's request)
        self.largest = 0.0  # 9.5's M: the largest magnitude of the last consensus delivered with mass > 0
        self.counts: dict[str, int] = {}
        self.log: dict = {"shipped": [], "delivered": [], "violations": []}
        self.started = self.last_hello = self.last_restate = time.monotonic()

    # -- helpers ------------------------------------------------------------------------------
    def count(self, name: str) -> None:
        self.counts[name] = self.counts.get(name, 0) + 1

    def violation(self, where: str, exc: Exception) -> None:
        self.count(f"violation.{where}")
        self.log["violations"].append(f"{where}: {exc}")
        print(f"spec relay {self.host}: protocol violation on {where}: {exc}", file=sys.stderr, flush=True)

    def fresh(self, ch: str, sender: str, seq: int) -> bool:
        return self.windows.setdefault((ch, sender), Window()).accept(seq)

    def upstream(self, ch: str, frames: list[bytes]) -> None:
        """Send on the upstream socket of `ch`, queued until that socket's hello is acknowledged."""
        if not self.acked[ch]:
            self.queued[ch].append(frames)
        else:
            self.send(self.up_ctl if ch == "control" else self.up_data, frames)

    def send(self, s: zmq.Socket, frames: list[bytes]) -> None:
        """Never wait on a send: a DEALER whose peer is gone would block the loop (and every timer) for good."""
        try:
            s.send_multipart(frames, zmq.NOBLOCK)
        except zmq.Again:
            self.count("dropped_send")

    def own(self, ch: str, kind: str, fields: dict, payloads: list[bytes] = ()) -> None:
        """One of the relay's own records: route b"" on control (3.1), none on data."""
        frames = self.wire.encode(kind, ch, fields, list(payloads))
        self.upstream(ch, [b"", *frames] if ch == "control" else frames)

    def hello(self) -> None:
        for ch in ("control", "data"):
            if not self.acked[ch]:
                frames = self.wire.encode("relay.hello", ch, {"host": self.host, "ranks": self.ranks,
                                                               "model_sigs": [], "token": self.token})
                self.send(self.up_ctl if ch == "control" else self.up_data,
                          [b"", *frames] if ch == "control" else frames)

    def lose(self, rank: int, why: str) -> None:
        """9.4: a rank said goodbye or went silent: out of the barrier, reported on both channels."""
        if rank in self.gone:
            return
        self.live.discard(rank)
        self.gone.add(rank)
        self.log.setdefault("lost", []).append([rank, why])
        for ch in ("control", "data"):
            self.own(ch, "relay.rank_exit", {"rank": rank})
        self.try_ship()

    # -- upstream -----------------------------------------------------------------------------
    def on_up_control(self, frames: list[bytes]) -> None:
        route, msg = frames[0], frames[1:]
        rank = int(route) if route.isdigit() else None
        signer = "coordinator" if route == b"" else f"coordinator:{rank}"
        if route != b"" and rank not in self.ranks:
            return self.count("unknown_rank.upstream_control")
        h, _ = self.wire.decode(msg, signer)
        if h["ch"] != "control":
            raise Violation(f"{h['k']} on channel {h['ch']} at the upstream control socket")
        if route != b"":  # 10.7 item 5: MAC and attribution checked, the sequence left to the rank
            self.send(self.ctl, [route, *msg])
        elif h["k"] == "relay.hello_ack" and self.fresh("control", signer, h["seq"]):
            self.ack("control")
        else:
            self.count("unexpected.upstream_control")

    def ack(self, ch: str) -> None:
        if not self.acked[ch]:
            self.acked[ch] = True
            for frames in self.queued[ch]:
                self.upstream(ch, frames)
            self.queued[ch] = []

    def on_up_data(self, frames: list[bytes]) -> None:
        tag, msg = frames[0], frames[1:]
        if tag not in (b"data", b"bcast"):
            return self.count("bad_tag.upstream_data")
        h, _ = self.wire.decode(msg, "reducer")
        if h["ch"] != tag.decode():
            raise Violation(f"tag {tag!r} but channel {h['ch']}")
        if h["k"] == "data.consensus":
            return self.consensus(h, msg)  # refused by round, not by sequence (5.2)
        if not self.fresh(h["ch"], "reducer", h["seq"]):
            return self.count("replay.upstream_data")
        if h["k"] == "relay.hello_ack":
            self.ack("data")
        elif h["k"] == "relay.declare_dead":
            rank = h["f"]["rank"]
            if rank in self.live:
                self.live.discard(rank)
                self.try_ship()
            else:
                self.count("restated_death")
        else:
            self.count(f"unhandled.{h['k']}")  # recovery (10.3, 10.6) is out of this relay's scope

    def on_sub(self, frames: list[bytes]) -> None:
        h, _ = self.wire.decode(frames, "reducer")
        if h["ch"] != "bcast":
            raise Violation(f"{h['k']} on channel {h['ch']} at the SUB")
        if h["k"] == "bcast.probe":
            self.own("data", "data.subscriber_ready", {"host": self.host, "nonce": h["f"]["nonce"]})
        elif h["k"] == "data.consensus":
            self.consensus(h, frames)

    def consensus(self, h: dict, msg: list[bytes]) -> None:
        """5.2: deliver a round shipped and not delivered, or one above every round shipped or delivered."""
        r = h["f"]["round"]
        if r in self.delivered or not (r in self.shipped or r > max(self.shipped | set(self.delivered), default=0)):
            return self.count("late_consensus")
        self.delivered = {r: msg}  # only the newest is ever asked for again
        self.log["delivered"].append({"round": r, "mass": h["f"]["mass"],
                                      "theta": np.frombuffer(b"".join(msg[1:-1]), "<f4").tolist()})
        if h["f"]["mass"] > 0:
            self.largest = max((float(np.abs(np.frombuffer(f, "<f4")).max(initial=0)) for f in msg[1:-1]), default=0)
        for rank in sorted(self.live):
            self.send(self.data, [str(rank).encode(), *msg])

    # -- towards the ranks ---------------------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        ident, msg = frames[0], frames[1:]
        rank = int(ident) if ident.isdigit() else None
        if rank not in self.ranks:
            return self.count("unknown_rank.local_control")
        h, _ = self.wire.decode(msg, f"rank:{rank}")
        if h["ch"] != "control" or h["f"].get("rank", rank) != rank:
            raise Violation(f"rank {rank}'s {h['k']} on {h['ch']} names rank {h['f'].get('rank')}")
        if h["k"] not in RANK_KINDS:  # 7: a rank may only speak as a rank
            self.lose(rank, f"sent {h['k']}")
            raise Violation(f"rank {rank} sent {h['k']}, a kind only the coordinator or a relay sends")
        self.heard[rank] = time.monotonic()
        self.upstream("control", [ident, *msg])  # verbatim, its sequence left to the coordinator
        if h["k"] == "timing.exiting":
            self.lose(rank, "goodbye")

    def on_data(self, frames: list[bytes]) -> None:
        ident, msg = frames[0], frames[1:]
        rank = int(ident) if ident.isdigit() else None
        if rank not in self.ranks:
            return self.count("unknown_rank.local_data")
        if len(msg) == 4 and msg[0] == b"shm":
            payloads, header = reference_payloads(msg, self.key, self.inc, rank)
            self.count("by_reference")
            h, _ = self.wire.decode([header, *payloads, mac(self.key, header, payloads)], f"rank:{rank}")
        else:
            h, _ = self.wire.decode(msg, f"rank:{rank}")
            payloads = msg[1:-1]
        if h["ch"] != "data" or h["f"].get("rank", rank) != rank:
            raise Violation(f"rank {rank}'s {h['k']} on {h['ch']} names rank {h['f'].get('rank')}")
        if not self.fresh("data", f"rank:{rank}", h["seq"]):
            return self.count("replay.local_data")
        if h["k"] == "data.round_frame":
            self.deposit(rank, h["f"], payloads)
        elif h["k"] == "data.consensus_request" and h["f"]["round"] in self.delivered:
            self.send(self.data, [ident, *self.delivered[h["f"]["round"]]])
        else:
            self.count(f"unhandled.{h['k']}")

    def deposit(self, rank: int, f: dict, chunks: list[bytes]) -> None:
        r = f["round"]
        if r <= max(self.shipped, default=0):  # 5.2: a round below the last shipped shipped or was published
            return self.count("late_frame")
        if self.fold is not None and r != self.fold.round:
            open_round, self.fold = self.fold.round, None  # 5.2: the polluted round is never shipped
            self.lose(rank, "desynced deposit")  # 8.2: its signer leaves; the relay serves on
            raise Violation(f"rank {rank} deposited in round {r} while round {open_round} is open")
        self.fold = self.fold or Fold(r)
        if rank in self.fold.deposits:
            return self.count("duplicate_frame")
        try:
            self.fold.judge(rank, float(f["mass"]), chunks, self.largest)
        except Violation:
            self.lose(rank, "poisoned deposit")
            raise
        self.fold.deposits[rank] = (float(f["mass"]), chunks)
        self.try_ship()

    def try_ship(self) -> None:
        """10.1 item 3: ship when every live local rank has deposited; nobody deposited, nothing ships."""
        fold = self.fold
        if fold is None or not fold.deposits or not self.live <= set(fold.deposits):
            return
        mass, payload = fold.host_frame()
        self.own("data", "data.host_frame", {"round": fold.round, "host": self.host,
                                            "ranks": sorted(fold.deposits), "mass": mass}, payload)
        self.shipped.add(fold.round)
        self.log["shipped"].append({"round": fold.round, "masses": {r: m for r, (m, _) in fold.deposits.items()},
                                    "sum": np.frombuffer(b"".join(payload), "<f4").tolist()})
        self.fold = None

    # -- the loop ------------------------------------------------------------------------------
    def timers(self, now: float) -> None:
        if now - self.last_hello >= HELLO_S:
            self.last_hello = now
            self.hello()
        if now - self.last_restate >= RESTATE_S:  # 10.7 item 8
            self.last_restate = now
            for rank in sorted(self.gone):
                for ch in ("control", "data"):
                    self.own(ch, "relay.rank_exit", {"rank": rank})
        for rank in sorted(self.live):
            limit = RANK_SILENCE_S if rank in self.heard else RANK_FIRST_RECORD_S
            if now - self.heard.get(rank, self.started) > limit:
                self.lose(rank, "silent")

    def run(self) -> None:
        handlers = {self.up_ctl: ("upstream_control", self.on_up_control), self.up_data: ("upstream_data", self.on_up_data),
                    self.sub: ("sub", self.on_sub), self.ctl: ("local_control", self.on_control),
                    self.data: ("local_data", self.on_data)}
        poller = zmq.Poller()
        for s in handlers:
            poller.register(s, zmq.POLLIN)
        stop: list[int] = []
        signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
        self.hello()
        while not stop:
            for s, _ in poller.poll(50):
                where, handle = handlers[s]
                try:  # 8: no message ends the service
                    handle(s.recv_multipart())
                except (Violation, ValueError, KeyError, TypeError, OSError, msgpack.UnpackException) as exc:
                    self.violation(where, exc)
            self.timers(time.monotonic())
        self.log["counts"] = self.counts
        with open(self.out, "w") as f:
            json.dump(self.log, f)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    SpecRelay(p.parse_args().out).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
