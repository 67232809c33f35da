"""When the controller takes a host shard's silence for its loss (flodl_zmq/controller_shards.py `SilentShards`):
only a link down past the host silence limit once the world formed, never a reset re-dialled in time."""

from __future__ import annotations

import math

from flodl_zmq.controller_shards import SilentShards


def formed(*connected: int, shards: int = 2, limit_s: float = 10.0, now: float = 0.0) -> SilentShards:
    """A watch of `shards` host shards whose `connected` ones made their handshake before the world formed at `now`."""
    watch = SilentShards(range(1, shards + 1), limit_s)
    for k in connected:
        watch.up(k)
    watch.judge_from(now)
    return watch


def test_a_link_down_past_the_limit_is_silent_just_after_it_and_not_before():
    watch = formed(1, 2)
    assert watch.due_at() == math.inf and watch.silent(1e9) is None  # both up: nothing to wake for
    watch.down(2, now=5.0)
    assert 15.0 < watch.due_at() < 15.001  # the controller's loop wakes then, with nothing else due
    assert watch.silent(15.0) is None
    assert watch.silent(15.001) == 2
    assert watch.silent(15.002) is None and watch.due_at() == math.inf  # named once: the loop no longer wakes for it


def test_a_reset_re_dialled_within_the_limit_costs_nothing_and_a_later_drop_counts_afresh():
    watch = formed(1, shards=1)
    watch.down(1, now=0.0)
    watch.down(1, now=4.0)  # a second event of the same outage moves nothing
    watch.up(1)  # the handshake made again at 9 s
    assert watch.silent(100.0) is None and watch.due_at() == math.inf
    watch.down(1, now=100.0)
    assert watch.silent(109.0) is None and watch.silent(110.5) == 1


def test_a_shard_not_connected_when_the_world_formed_is_down_from_then_and_nothing_is_judged_before():
    watch = SilentShards([1, 2], limit_s=10.0)
    watch.up(1)
    watch.down(1, now=1.0)  # a drop before the world formed, its relay's ranks still to come: not judged
    assert watch.due_at() == math.inf and watch.silent(1000.0) is None
    watch.up(1)
    watch.judge_from(50.0)  # shard 2 never connected: its relay was stopped before the controller's SUB got in
    watch.judge_from(70.0)  # only the first call counts
    assert watch.silent(60.0) is None and watch.silent(60.5) == 2
    assert watch.reached == {1}  # so shard 2 is named as never reached, not as fallen silent


def test_a_shard_connected_late_but_within_the_limit_is_not_silent():
    watch = formed(1)  # shard 2 not connected when the world formed, at 0 s
    watch.up(2)  # in at, say, 9 s
    assert watch.silent(1000.0) is None and watch.due_at() == math.inf and watch.reached == {1, 2}


def test_a_shard_whose_address_took_a_tcp_connection_but_made_no_handshake_was_reached():
    # A relay stopped just after the world formed, before the controller's SUB made its handshake: the kernel
    # still accepts the connection, so it is named as fallen silent, not as an address behind a firewall.
    watch = formed(1)
    watch.connected(2)
    assert watch.silent(10.5) == 2 and watch.reached == {1, 2}


def test_of_two_shards_down_the_longest_down_is_named_first_and_each_once():
    watch = formed(1, 2, limit_s=1.0)
    watch.down(2, now=0.0)
    watch.down(1, now=0.5)
    assert watch.silent(1.2) == 2
    assert watch.silent(1.6) == 1
