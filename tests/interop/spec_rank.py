"""A rank written from protocol/PROTOCOL.md alone: pyzmq, msgpack, numpy, hashlib/hmac, cryptography.

It imports nothing of flodl_zmq (tests/interop/test_spec_rank.py checks), so a run it completes
against the real relay and controller proves the spec is enough to write a peer. Its model is a
flat float32 vector that every optimizer step nudges by `--nudge`; its wire behaviour is that of a
normal run: hello (9.3), plans (9.1, 9.2), deposits (10.1, 10.1.1), consensus (9.5), the control
stream's acknowledgements and resends (10.7), heartbeats (10), goodbye.

Like any rank it learns who it is from the environment its spawner gives (FLODL_KEY,
FLODL_INCARNATION, FLODL_HOST, FLODL_RANK, FLODL_WORLD) and derives its relay's endpoints (2); the
job's own settings (its model's size, batch size, seed) come as arguments, as a user's script has them.
Writes a JSON log to `--out`: the spans it trained, its deposits and the consensus it loaded.
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import json
import os
import struct
import sys
import tempfile
import time

import msgpack
import numpy as np
import zmq
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

V = 10
MAC_LABEL = b"flodl-zmq/10/mac\x00"  # 4.2
PAYLOAD_KEY_LABEL = b"flodl-zmq/10/payload-key\x00"
BLOCK = 1 << 20
CHUNK = 1 << 21  # 3.4
HEARTBEAT_S, RESEND_S, CONSENSUS_WAIT_S, CLOSE_WAIT_S = 0.5, 2.0, 2.0, 4.0  # 10, 10.7
COORDINATOR_SILENCE_S = 30.0
HOLD_EXEMPT = {"control.shutdown", "control.shutdown_with_save", "control.declare_dead"}  # 10.1.1 item 5


def model_signature(tensors: list[tuple[str, tuple[int, ...]]]) -> bytes:
    """9.3: SHA-256 of `flodl-model-v1`, then `<name>:<shape>:torch.float32;` per tensor."""
    h = hashlib.sha256(b"flodl-model-v1")
    for name, shape in tensors:
        h.update(f"{name}:{shape!r}:torch.float32;".encode())
    return h.digest()


def dataset_signature(items: list, n: int) -> bytes:
    """9.3 for a dataset of tuples of numpy arrays; `items[i]` is item i."""
    h = hashlib.sha256(f"flodl-dataset-v1:{n}".encode())

    def feed(x) -> None:
        if isinstance(x, np.ndarray):
            h.update(x.dtype.str.encode())
            h.update(repr(x.shape).encode())
            h.update(np.ascontiguousarray(x).tobytes())
        elif isinstance(x, (tuple, list)):
            h.update(f"seq{len(x)}".encode())
            for part in x:
                feed(part)
        else:
            h.update(repr(x).encode())

    for i in sorted({int(x) for x in np.linspace(0, n - 1, min(n, 16))}):
        feed(items[i])
    return h.digest()


def local_endpoints(key: bytes, incarnation: bytes, host: str) -> tuple[str, str]:
    """2: the relay's ipc:// endpoints (control, data), derived by every process of the host, never told."""
    digits = hmac.new(key, b"flodl-zmq/private-dir\x00ipc\x00" + incarnation, hashlib.sha256).hexdigest()[:24]
    base = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
    name = os.path.join(base, "flodl-" + digits, hashlib.sha256(host.encode()).hexdigest()[:12])
    return f"ipc://{name}-control", f"ipc://{name}-data"


def permutation(seed: int, epoch: int, n: int) -> np.ndarray:
    """9.1: the sample ids of epoch `epoch`, in order: a stable argsort of PCG64(seed + epoch)'s first n raw draws."""
    return np.argsort(np.random.PCG64(seed + epoch).random_raw(n), kind="stable")


def mac(key: bytes, header: bytes, payloads: list[bytes]) -> bytes:
    """4.2: HMAC over the header and the per-block GMAC tags of each payload frame."""
    tag = b""
    if payloads:
        one_time = AESGCM(hmac.new(key, PAYLOAD_KEY_LABEL + header, hashlib.sha256).digest())
        for i, frame in enumerate(payloads, start=1):
            tag += struct.pack("<Q", len(frame))
            for j in range(0, len(frame), BLOCK):
                tag += one_time.encrypt(struct.pack("<IQ", i, j // BLOCK), b"", bytes(frame[j:j + BLOCK]))
    msg = MAC_LABEL + struct.pack("<IQ", len(payloads), len(header)) + header + tag
    return hmac.new(key, msg, hashlib.sha256).digest()


class Wire:
    """Encode under one sender name and salt (3.2, 5.1); decode and verify (7)."""

    def __init__(self, key: bytes, run: bytes, sender: str):
        self.key, self.run, self.sender, self.salt = key, run, sender, os.urandom(16)
        self.seq = {"control": 0, "data": 0}

    def encode(self, kind: str, ch: str, fields: dict, payloads: list[bytes] = ()) -> list[bytes]:
        self.seq[ch] += 1
        p = [["f32", [len(f) // 4], len(f)] for f in payloads]
        header = msgpack.packb({"v": V, "k": kind, "run": self.run, "ch": ch, "from": self.sender,
                                "salt": self.salt, "seq": self.seq[ch], "f": fields, "p": p}, use_bin_type=True)
        return [header, *payloads, mac(self.key, header, list(payloads))]

    def decode(self, frames: list[bytes], signer: str) -> tuple[dict, list[np.ndarray]]:
        """The header and f32 payloads of an authentic message from `signer`, else ValueError."""
        if len(frames) < 2 or len(frames[-1]) != 32:
            raise ValueError("framing")
        header, payloads = frames[0], frames[1:-1]
        if not hmac.compare_digest(mac(self.key, header, payloads), frames[-1]):
            raise ValueError("MAC")
        h = msgpack.unpackb(header, raw=False)
        if h["v"] != V or h["run"] != self.run or h["from"] != signer:
            raise ValueError(f"version, incarnation or signer: {h['v']} {h['from']}")
        if any(d[0] != "f32" for d in h["p"]):
            raise ValueError("this rank's run is f32")
        return h, [np.frombuffer(f, "<f4") for f in payloads]


class SpecRank:
    """One rank's state machine and its two sockets, on one thread: a poll loop with deadlines."""

    def __init__(self, a: argparse.Namespace):
        env = os.environ  # what the agent (or launcher) that spawns a rank tells it
        key, incarnation = bytes.fromhex(env["FLODL_KEY"]), bytes.fromhex(env["FLODL_INCARNATION"])
        self.a, self.rank, self.host = a, int(env["FLODL_RANK"]), env["FLODL_HOST"]
        # 9.3: the rank space, the highest rank of the world + 1 (vacancies included)
        self.world_size = 1 + max(int(r) for part in env["FLODL_WORLD"].split(";") for r in part.split("=")[1].split(","))
        self.me = f"coordinator:{self.rank}"
        ctx = zmq.Context()
        self.ctl, self.data = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
        for s, ep in zip((self.ctl, self.data), local_endpoints(key, incarnation, self.host), strict=True):
            s.setsockopt(zmq.IDENTITY, str(self.rank).encode())  # 3.1: ASCII decimal
            s.setsockopt(zmq.LINGER, 0)
            s.connect(ep)
        self.wire = Wire(key, incarnation, f"rank:{self.rank}")
        self.theta = np.zeros(a.values, np.float32)
        self.consensus = self.theta.copy()  # the last consensus loaded: what a final evaluation scores
        self.kept: dict[int, tuple[list[bytes], float]] = {}  # 10.7 item 2: my stream, until acked
        self.accepted: set[int] = set()
        self.ack = 0  # highest n with every 1..n of the coordinator's stream accepted
        self.inbox: dict[int, dict] = {}  # accepted above ack + 1: handed on in order (10.7 item 4)
        self.held: list[dict] = []  # control records behind a pending consensus (10.1.1 item 5)
        self.spans: list[dict] = []  # plans to train, in order
        self.step_count = self.steps_since_snapshot = 0
        self.deposited: set[int] = set()
        self.pending: int | None = None  # the round deposited in whose consensus is not loaded
        self.snapshot: np.ndarray | None = None
        self.last_frame: tuple[int, float] | None = None
        self.throttled = self.done = False
        self.heard = self.last_beat = self.consensus_asked = time.monotonic()
        self.log: dict = {"spans": [], "deposits": [], "consensus": [], "evals": [], "checkpoints": [], "rejected": 0}

    # -- sending ---------------------------------------------------------------------------------
    def send(self, kind: str, fields: dict) -> None:
        frames = self.wire.encode(kind, "control", fields)
        seq = self.wire.seq["control"]
        self.kept[seq] = (frames, time.monotonic())
        if seq != self.a.lose_seq:  # a record lost in a reset: only its resend (10.7 item 2) carries it
            self.ctl.send_multipart(frames)

    def heartbeat(self) -> None:
        self.send("timing.heartbeat", {"rank": self.rank, "step_count": self.step_count, "ack": self.ack})

    def deposit(self, round_id: int) -> None:
        """10.1 item 2: snapshot, report it, send the frame pre-multiplied by the mass."""
        self.deposited.add(round_id)
        self.pending, self.snapshot = round_id, self.theta.copy()
        mass = float(self.steps_since_snapshot)  # 9.5: the steps since the previous snapshot
        self.steps_since_snapshot = 0
        self.send("timing.snapshot_ready", {"rank": self.rank, "round": round_id})
        self.last_frame = (round_id, mass)
        self.send_frame()
        self.log["deposits"].append({"round": round_id, "mass": mass, "theta": self.snapshot.tolist()})
        self.consensus_asked = time.monotonic()  # 10.6 item 1: asked again only after a wait

    def send_frame(self) -> None:
        round_id, mass = self.last_frame
        flat = (self.snapshot * np.float32(mass)).astype("<f4")
        chunks = [flat[i:i + CHUNK].tobytes() for i in range(0, len(flat), CHUNK)]
        self.data.send_multipart(self.wire.encode(
            "data.round_frame", "data", {"round": round_id, "rank": self.rank, "mass": mass}, chunks))

    # -- receiving -------------------------------------------------------------------------------
    def on_control(self, frames: list[bytes]) -> None:
        try:
            h, _ = self.wire.decode(frames, self.me)
        except (ValueError, KeyError, msgpack.UnpackException):
            self.log["rejected"] += 1
            return
        self.heard = time.monotonic()
        if h["k"] == "control.coord_heartbeat":  # acknowledgements are read at once (10.7 item 4)
            for n in [n for n in self.kept if n <= h["f"]["ack"]]:
                del self.kept[n]
        seq = h["seq"]
        if seq in self.accepted or seq <= self.ack:
            return  # a resend of one already accepted (5.1)
        self.accepted.add(seq)
        self.inbox[seq] = h
        while self.ack + 1 in self.inbox:
            self.ack += 1
            self.accepted.discard(self.ack)
            self.dispatch(self.inbox.pop(self.ack))

    def dispatch(self, h: dict) -> None:
        if self.pending is not None and h["k"] not in HOLD_EXEMPT and (self.held or h["k"] in self.HOLD):
            self.held.append(h)
        else:
            self.handle(h["k"], h["f"])

    # Records a pending consensus holds back: the update and what follows it (10.1.1 item 5).
    HOLD = {"control.update", "control.set_global_step", "control.start_epoch", "control.execute_eval",
            "control.checkpoint", "control.extend_partition", "control.request_params", "control.throttle"}

    def handle(self, kind: str, f: dict) -> None:
        if kind == "control.start_epoch":  # work, but no release of a throttle (9.2)
            self.spans.append(dict(f["plan"]))
        elif kind == "control.update":
            if f["next_plan"] is not None:
                self.spans.append(dict(f["next_plan"]))
            self.throttled = False
        elif kind == "control.extend_partition":
            self.spans.append({"epoch": f["epoch"], "offset": f["offset"], "size": f["size"], "deposit": None})
        elif kind == "control.request_params":
            if f["round"] not in self.deposited:
                self.deposit(f["round"])
        elif kind == "control.throttle":
            self.throttled = True
        elif kind in ("control.shutdown", "control.shutdown_with_save"):
            self.done = True
        elif kind == "control.declare_dead" and f["rank"] == self.rank:
            raise SystemExit(f"rank {self.rank} declared dead by the coordinator")
        elif kind == "control.execute_eval" and f["target_rank"] == self.rank:  # its metric: the model's mean
            scored = self.consensus if f["adopt_consensus"] else self.theta
            self.send("timing.eval_result", {"rank": self.rank, "schedule_id": f["schedule_id"], "epoch": f["epoch"],
                                             "metric": float(scored.mean()), "elapsed_ms": 0.0, "error": None})
            self.log["evals"].append([f["schedule_id"], float(scored.mean())])
        elif kind == "control.checkpoint" and f["target_rank"] == self.rank:
            self.log["checkpoints"].append(f["version"])
            self.send("timing.checkpoint_result", {"rank": self.rank, "version": f["version"], "elapsed_ms": 0.0,
                                                   "error": None})

    def on_data(self, frames: list[bytes]) -> None:
        try:
            h = msgpack.unpackb(frames[0], raw=False)
            signer = "reducer" if h["k"] == "data.consensus" else f"relay:{self.host}"
            h, tensors = self.wire.decode(frames, signer)
        except (ValueError, KeyError, TypeError, msgpack.UnpackException):
            self.log["rejected"] += 1
            return
        if h["k"] == "data.frame_request" and self.last_frame and h["f"]["round"] == self.last_frame[0]:
            self.send_frame()  # 10.6: re-signed, a fresh seq
        elif h["k"] == "data.consensus" and h["f"]["round"] == self.pending:  # 5.2: only the awaited round
            self.load(h["f"], np.concatenate(tensors) if tensors else self.theta)

    def load(self, f: dict, consensus: np.ndarray) -> None:
        pre = self.snapshot
        if f["mass"] > 0:
            self.theta = consensus.astype(np.float32).copy()  # cadence: overwrite (9.5)
            self.consensus = self.theta.copy()
        post = self.theta
        post_norm, pre_norm = float(np.linalg.norm(post)), float(np.linalg.norm(pre))
        div = 0.0 if post_norm <= 1e-10 else float(np.linalg.norm(pre - post)) / post_norm
        self.log["consensus"].append({"round": f["round"], "mass": f["mass"], "theta": self.theta.tolist()})
        self.send("timing.sync_ack", {"rank": self.rank, "round": f["round"], "step_count": self.step_count,
                                      "divergence": div, "post_norm": post_norm, "pre_norm": pre_norm})
        self.pending = None
        held, self.held = self.held, []
        for h in held:
            self.dispatch(h)

    # -- training --------------------------------------------------------------------------------
    def train_span(self) -> None:
        """Train the first queued span one batch at a time; at its end deposit if it names a round."""
        span = self.spans[0]
        take = min(self.a.batch_size, span["size"] - span.get("trained", 0))
        if take > 0:
            t0 = time.perf_counter()
            self.theta += np.float32(self.a.nudge)
            batch_ms = (time.perf_counter() - t0) * 1000
            self.step_count += 1
            self.steps_since_snapshot += 1
            span["trained"] = span.get("trained", 0) + take
            self.throttled = self.a.sync  # 10.1: a Sync rank holds after each step until its update
            self.send("timing.batch", {"rank": self.rank, "step_count": self.step_count, "batch_ms": [batch_ms],
                                       "data_ms": [0.0], "batch_loss": [float(self.theta.mean())]})
        if span.get("trained", 0) < span["size"]:
            return
        self.spans.pop(0)
        ids = permutation(self.a.seed, span["epoch"], self.a.samples)[span["offset"]:span["offset"] + span["size"]]
        self.log["spans"].append({"epoch": span["epoch"], "ids": ids.tolist()})
        if span["deposit"] is not None and span["deposit"] not in self.deposited:
            self.deposit(span["deposit"])
        batches = -(-span["size"] // self.a.batch_size)
        self.send("metrics.epoch", {"rank": self.rank, "epoch": span["epoch"], "avg_loss": float(self.theta.mean()),
                                    "batches_processed": batches, "samples_processed": span["size"],
                                    "epoch_ms": 1.0, "compute_only_ms": 1.0, "data_starve_ms": 0.0,
                                    "scalar_sums": {}, "scalar_counts": {}})

    def resend(self, now: float) -> None:
        """10.7 item 2: every kept record unacknowledged for RESEND_S goes again, byte-identical."""
        for n, (frames, sent) in list(self.kept.items()):
            if now - sent >= RESEND_S:
                self.kept[n] = (frames, now)
                self.ctl.send_multipart(frames)

    def timers(self, now: float) -> None:
        if now - self.last_beat >= HEARTBEAT_S:
            self.last_beat = now
            self.heartbeat()
        self.resend(now)
        if self.pending is not None and now - self.consensus_asked >= CONSENSUS_WAIT_S:
            self.consensus_asked = now
            self.data.send_multipart(self.wire.encode("data.consensus_request", "data", {"round": self.pending}))
        if now - self.heard > COORDINATOR_SILENCE_S:
            raise SystemExit("the coordinator went silent")

    def run(self) -> None:
        sig = bytes.fromhex(self.a.dataset_sig)
        self.send("rank.hello", {"rank": self.rank, "world_size": self.world_size, "host": self.host,
                                 "model_sig": model_signature([("weight", (1, self.a.values - 1)), ("bias", (1,))]),
                                 "dataset_sig": sig})
        self.send("timing.lr_update", {"rank": self.rank, "lr": 0.1})
        poller = zmq.Poller()
        poller.register(self.ctl, zmq.POLLIN)
        poller.register(self.data, zmq.POLLIN)
        while not self.done:
            busy = self.spans and self.pending is None and not self.throttled
            for s, _ in poller.poll(0 if busy else 50):
                (self.on_control if s is self.ctl else self.on_data)(s.recv_multipart())
            self.timers(time.monotonic())
            if busy and not self.done:
                self.train_span()
        self.goodbye()

    def goodbye(self) -> None:
        """10.7 item 7: `timing.exiting`, then wait up to 4 s for it and the rest to be acknowledged."""
        self.send("timing.exiting", {"rank": self.rank})
        deadline = time.monotonic() + CLOSE_WAIT_S
        while self.kept and time.monotonic() < deadline:
            if self.ctl.poll(50):
                self.on_control(self.ctl.recv_multipart())
            self.resend(time.monotonic())
        self.log["theta"] = self.theta.tolist()
        self.log["unacked"] = sorted(self.kept)


def main() -> int:
    p = argparse.ArgumentParser()
    for name in ("dataset-sig", "out"):
        p.add_argument(f"--{name}", required=True)
    for name in ("values", "batch-size", "samples", "seed"):
        p.add_argument(f"--{name}", type=int, required=True)
    p.add_argument("--nudge", type=float, default=0.01)
    p.add_argument("--sync", action="store_true", help="the job's mode is cpu-sync")
    p.add_argument("--lose-seq", type=int, default=0, help="never send this control record's first copy")
    a = p.parse_args()
    rank = SpecRank(a)
    try:
        rank.run()
    finally:
        with open(a.out, "w") as f:
            json.dump(rank.log, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
