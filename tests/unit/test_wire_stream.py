"""Control streams (PROTOCOL.md 10.7): kept until acknowledged, resent byte-identical, handed on in order."""

from __future__ import annotations

import pytest

from flodl_zmq.errors import AttributionError, ReplayError, SchemaError
from flodl_zmq.links import coordinator_sender
from flodl_zmq.wire import Attribution, Channel, Codec, new_key
from flodl_zmq.wire import records as rec
from flodl_zmq.wire.stream import RESEND_AFTER_S, InOrder, Outage, Outstream

KEY, RUN = new_key(), bytes(range(16))
TO_RANK_0 = Attribution.signed_by(coordinator_sender(0), "test")


def test_a_lost_record_is_resent_byte_identical_until_acknowledged_and_accepted_once_in_order():
    out, rx, order = Outstream(Codec(KEY, RUN, coordinator_sender(0))), Codec(KEY, RUN, "rank:0"), InOrder()
    sent = [out.send(rec.SetGlobalStep(global_step=n), now=0.0) for n in (1, 2, 3)]
    handed = []
    for frames in (sent[0], sent[2]):  # the second is lost in a reset
        env = rx.decode_from(frames, Channel.CONTROL, TO_RANK_0)
        handed += order.accept(env.seq, env.record)
    assert handed == [rec.SetGlobalStep(global_step=1)] and order.acked == 1  # the third waits for the gap
    out.ack(order.acked)
    assert out.due_at() == RESEND_AFTER_S and out.due(RESEND_AFTER_S - 0.01) == []
    again = out.due(RESEND_AFTER_S)
    assert again == [[bytes(f) for f in sent[1]], [bytes(f) for f in sent[2]]]
    env = rx.decode_from(again[0], Channel.CONTROL, TO_RANK_0)
    assert order.accept(env.seq, env.record) == [rec.SetGlobalStep(global_step=2), rec.SetGlobalStep(global_step=3)]
    with pytest.raises(ReplayError):  # the copy of one that did arrive: refused by the window, never handed on twice
        rx.decode_from(again[1], Channel.CONTROL, TO_RANK_0)
    out.ack(order.acked)
    assert len(out) == 0 and out.due(10.0) == []


def test_a_record_to_one_rank_is_never_accepted_by_another():
    frames = Outstream(Codec(KEY, RUN, coordinator_sender(1))).send(rec.Shutdown(), now=0.0)
    with pytest.raises(AttributionError, match="coordinator:1"):
        Codec(KEY, RUN, "rank:0").decode_from(frames, Channel.CONTROL, TO_RANK_0)


def test_a_forgotten_stream_never_resends():
    out = Outstream(Codec(KEY, RUN, coordinator_sender(0)))
    out.send(rec.Shutdown(), now=0.0)
    out.forget()
    assert out.due(100.0) == [] and len(out) == 0


def test_an_outage_is_opened_once_and_summed_up_when_its_last_stream_is_acknowledged():
    outage = Outage()
    assert outage.resent_on(2, 3, now=10.0)  # the first resend opens it: the caller warns once
    assert not outage.resent_on(3, 1, now=10.0)
    assert not outage.resent_on(2, 4, now=12.0)  # later passes only count
    assert outage.settled(7, now=12.5) is None  # a stream that needed no resend says nothing
    assert outage.settled(2, now=13.0) is None  # rank 3 still waits
    assert outage.settled(3, now=14.0) == (8, 4.0)
    assert outage.settled(3, now=15.0) is None  # over: said once
    assert outage.resent_on(3, 1, now=20.0)  # the next outage is a new one


def test_records_merged_by_a_relay_are_handed_on_in_order_once_even_when_merged_twice():
    # A rank's resend after a reset is merged again (PROTOCOL.md 10.7 item 9): the copy must not be handed on twice.
    first = rec.HostReports.merge([(1, rec.Batch(0, 1, [1.0], [0.0], [0.5])), (3, rec.Heartbeat(0, 1, ack=4))])
    again = rec.HostReports.merge([(2, rec.Batch(0, 2, [2.0], [0.0], [0.4])), (3, rec.Heartbeat(0, 1, ack=4))])
    order, handed = InOrder(), []
    for merged in (first, again):
        for seq, record in merged.unmerge():
            handed += order.accept(seq, record)
    assert [type(r).__name__ for r in handed] == ["Batch", "Batch", "Heartbeat"] and order.acked == 3
    assert order.accept(9999, rec.Shutdown()) == [] and order.accept(3 + 4097, rec.Shutdown()) == []


def test_merged_records_come_back_with_their_sequence_numbers_and_a_count_that_disagrees_is_refused():
    items = [(5, rec.Batch(2, 7, [1.0, 2.0], [0.1, 0.2], [0.9, 0.8])), (6, rec.Heartbeat(2, 7, ack=1)),
             (2, rec.SyncAck(3, 4, 9, 0.01, 1.0, 1.01)), (3, rec.SnapshotReady(3, 5))]
    merged = rec.HostReports.merge(items)
    assert sorted(merged.unmerge(), key=lambda i: i[0]) == sorted(items, key=lambda i: i[0])
    with pytest.raises(SchemaError, match="one"):
        rec.HostReports([1, 2], [rec.Heartbeat(0, 1)], [], [], [])
