"""The run's wire format (flodl_zmq/wire_format.py): one object per format, chosen once, and the hops that
are told it refuse a payload of another by name."""

from __future__ import annotations

import ast
import pickle
import re
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import TensorDataset

from flodl_zmq import int8
from flodl_zmq.errors import ConfigError, FoldError, ProtocolError
from flodl_zmq.job import Job
from flodl_zmq.settings import Settings
from flodl_zmq.tensors import bf16_from_f32, f32_from_bf16
from flodl_zmq.wire_format import BF16, F32, FORMATS, INT8, Hop, describe, named, of_payload

PACKAGE = Path(__file__).resolve().parents[2] / "flodl_zmq"
N = int8.BLOCK + 17  # more than one int8 block


def payload_of(wire, x):
    return wire.resume_payload(x)


def values(n=N, seed=3):
    return np.random.default_rng(seed).standard_normal(n).astype(np.float32)


# ---------------------------------------------------------------------------- the objects


def test_each_name_of_the_setting_is_one_object_and_anything_else_is_refused_naming_the_setting():
    assert [named(n) for n in ("f32", "bf16", "int8")] == [F32, BF16, INT8]
    assert all(pickle.loads(pickle.dumps(f)) is f for f in FORMATS.values())  # one object, even pickled
    for bad in ("f16", "i8", "F32", None, 32):
        with pytest.raises(ConfigError, match=r"wire_dtype must be one of \('f32', 'bf16', 'int8'\)"):
            named(bad)
    with pytest.raises(ConfigError, match="FLODL_WIRE_DTYPE"):
        named("fp8", "FLODL_WIRE_DTYPE")


def job(**kw) -> Job:
    return Job(model=lambda: torch.nn.Linear(3, 1), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
               train_step=lambda m, b: m(b[0]).sum(), dataset=TensorDataset(torch.zeros(8, 3)), batch_size=2,
               epochs=1, **kw)


def test_the_job_validates_its_wire_dtype_into_the_object_and_refuses_an_environment_that_announces_another():
    assert job().wire is F32 and job(wire_dtype="int8").wire is INT8
    j = job(wire_dtype="bf16")
    j.check_settings(Settings())
    j.check_settings(Settings(wire_dtype="bf16"))
    with pytest.raises(ConfigError, match=r"Trainer\(wire_dtype='bf16'\).*FLODL_WIRE_DTYPE=int8"):
        j.check_settings(Settings(wire_dtype="int8"))


def test_the_run_setting_announces_the_format_and_a_bad_one_is_refused_by_its_variable():
    assert Settings().wire is None
    s = Settings.from_environ({"FLODL_WIRE_DTYPE": "bf16"})
    assert s.wire is BF16 and s.to_environ(("run",))["FLODL_WIRE_DTYPE"] == "bf16"
    with pytest.raises(ConfigError, match="FLODL_WIRE_DTYPE must be one of"):
        Settings.from_environ({"FLODL_WIRE_DTYPE": "fp16"})


# ---------------------------------------------------------------------------- what each format means


@pytest.mark.parametrize("wire", [F32, BF16, INT8], ids=lambda w: w.name)
def test_a_payload_is_of_exactly_one_format_and_widens_back_to_f32(wire):
    x = values()
    payload = payload_of(wire, x)
    assert wire.fits(payload, N) and of_payload(payload) is wire and describe(payload) == wire.name
    assert [f for f in FORMATS.values() if f.is_payload(payload)] == [wire]
    assert [(t.dtype, t.size) for t in payload] == wire.layout(N)
    got = wire.widen(payload, np.empty(N, np.float32))
    if wire is F32:
        assert np.array_equal(got, x)
    elif wire is BF16:
        assert np.array_equal(got, f32_from_bf16(bf16_from_f32(x, np.empty(N, np.uint16)), np.empty(N, np.float32)))
    else:
        assert np.allclose(got, x, atol=float(np.abs(x).max()) / 127)
    with pytest.raises(ValueError, match="does not widen"):
        wire.widen(payload, np.empty(N - 1, np.float32))


def test_payloads_of_no_format_are_named_by_their_elements():
    assert of_payload([]) is None and describe([]) == "empty"
    assert of_payload([np.zeros(3, np.float16)]) is None and describe([np.zeros(3, np.float16)]) == "f16"
    mixed = [np.zeros(3, np.float32), np.zeros(3, np.uint16)]
    assert of_payload(mixed) is None and describe(mixed) == "bf16/f32"
    assert describe([np.zeros(3, np.int8)]) == "i8"  # int8 values without their scales


def test_the_resume_payload_is_the_checkpoint_in_the_format_and_int8_is_quantized_afresh():
    x = values()
    assert np.array_equal(F32.resume_payload(x)[0], x)
    bits = bf16_from_f32(x, np.empty(N, np.uint16))
    assert np.array_equal(BF16.resume_payload(x)[0], bits)
    fresh = int8.PayloadEncoder().encode([x])
    assert all(np.array_equal(a, b) for a, b in zip(INT8.resume_payload(x), fresh, strict=True))


def test_int8_encodes_with_its_senders_error_feedback_and_f32_into_itself_is_nothing_to_do():
    x = values()
    fb = INT8.feedback(N)
    assert fb is not None and F32.feedback(N) is None and BF16.feedback(N) is None
    out = [np.empty(n, dt) for dt, n in INT8.layout(N)]
    INT8.encode_into(x, out, fb)
    np.testing.assert_allclose(fb.residual, x - INT8.widen(out, np.empty(N, np.float32)), atol=1e-6)
    with pytest.raises(ValueError, match="error feedback"):
        INT8.encode_into(x, out)
    F32.encode_into(x, [x])  # the f32 deposit is the snapshot itself


# ---------------------------------------------------------------------------- a hop told the format


@pytest.mark.parametrize("error", [FoldError, ProtocolError], ids=["relay", "reducer"])
@pytest.mark.parametrize("told", [F32, BF16, INT8], ids=lambda w: w.name)
@pytest.mark.parametrize("sent", [F32, BF16, INT8], ids=lambda w: w.name)
def test_a_hop_told_one_format_refuses_a_frame_of_another_by_name_at_the_first(told, sent, error):
    hop = Hop("relay h" if error is FoldError else "reducer", told, error)
    payload = payload_of(sent, values(64))
    if sent is told:
        got = hop.take("rank 0", payload)
        assert [t.dtype for t in got] == ([np.dtype(np.float32)] if told.packed else [told.element.dtype])
        return
    with pytest.raises(error, match=re.escape(f"from rank 0 is {sent.name}, but the run's wire_dtype is {told.name}")):
        hop.take("rank 0", payload)


def test_a_hop_not_told_holds_the_run_to_its_first_payloads_format():
    hop = Hop("relay h", None, FoldError)
    hop.take("rank 0", payload_of(BF16, values(8)))
    assert hop.wire is BF16 and not hop.announced
    with pytest.raises(FoldError, match="is int8, but the run's first payload was bf16 .*not told"):
        hop.take("rank 1", payload_of(INT8, values(8)))
    with pytest.raises(FoldError, match="is f16, not one of a wire_dtype"):
        Hop("relay h", None, FoldError).take("rank 0", [np.zeros(4, np.float16)])


def test_a_hop_widens_int8_into_reused_buffers_per_sender_and_sends_on_in_int8_with_its_own_feedback():
    hop = Hop("reducer", INT8, ProtocolError)
    a, b = payload_of(INT8, values(10, 1)), payload_of(INT8, values(10, 2))
    wa = hop.take("host a", a)[0]
    assert hop.take("host b", b)[0] is not wa and hop.take("host a", a)[0] is wa
    out = hop.send_on([values(10, 1)])
    assert INT8.is_payload(out)
    plain = Hop("reducer", BF16, ProtocolError)
    tensors = payload_of(BF16, values(10))
    assert plain.take("host a", tensors) is tensors and plain.send_on(tensors) is tensors


# ---------------------------------------------------------------------------- nobody else compares names

FORMAT_NAMES = re.compile(r"""(==|!=|\bin\b|\bnot in\b)\s*\(?\s*["'](f32|bf16|int8|f16|i8)["']|["'](f32|bf16|int8|f16|i8)["']\s*(==|!=)""")


def test_no_module_compares_a_dtype_name_outside_the_tables():
    hits = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for lineno, line in enumerate(path.read_text().splitlines(), 1):
            if FORMAT_NAMES.search(line.split("#", 1)[0]):
                hits.append(f"{path.relative_to(PACKAGE)}:{lineno}: {line.strip()}")
    assert not hits, "compare WireFormat objects (wire_format.py) or look elements up in tensors.ELEMENTS:\n" + \
        "\n".join(hits)


def test_the_base_layer_format_never_imports_torch():
    tree = ast.parse((PACKAGE / "wire_format.py").read_text())
    imported = {a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}
    imported |= {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) and n.module}
    assert not any(i.split(".")[0] == "torch" for i in imported)


@pytest.mark.parametrize("wire", [F32, BF16, INT8], ids=lambda w: w.name)
def test_the_largest_frame_of_a_format_is_the_longest_frame_its_payload_carries(wire):
    # A data socket that knows the model refuses anything longer (PROTOCOL.md 6.1): it must never be shorter.
    for n in (3, N, 10 * int8.BLOCK):
        assert wire.largest_frame_bytes(n) == max(t.nbytes for t in payload_of(wire, np.ones(n, np.float32)))
    assert INT8.largest_frame_bytes(1) == 4  # one value, one f32 scale: the scales frame is the longer
