"""The launcher's output path (flodl_zmq.launch.Cluster): lines kept in order, sinks called without its lock."""

from __future__ import annotations

import threading

from flodl_zmq.launch import Cluster, raised_summary, stopped_summary


def test_the_sink_is_called_without_the_launchers_lock_so_it_may_wait_on_a_reader():
    # A test's wait_for held its condition and read output(); the sink, called under the
    # launcher's lock, waited for that condition: neither could go on (a stress run hung so).
    held: list[bool] = []
    cluster = Cluster(argv=["-c", "pass"], hosts=1, ranks_per_host=1,
                      sink=lambda line: held.append(cluster._lock.locked()))
    cluster._emit("[h0:0] one")
    cluster._emit("[h0:0] two")
    assert held == [False, False]
    assert cluster.output().splitlines() == ["[h0:0] one", "[h0:0] two"]


def test_a_sink_waiting_on_a_condition_held_by_a_reader_of_the_output_does_not_deadlock():
    seen = threading.Condition()

    def sink(line: str) -> None:
        with seen:
            seen.notify_all()

    cluster = Cluster(argv=["-c", "pass"], hosts=1, ranks_per_host=1, sink=sink)
    with seen:  # what Run.wait_for does: hold the condition, read the output
        emitter = threading.Thread(target=cluster._emit, args=("[h0:0] hello",), daemon=True)
        emitter.start()
        emitter.join(0.2)  # it is now blocked in the sink, waiting for `seen`
        free = cluster._lock.acquire(timeout=2)  # what output() takes: it would wait forever
        assert free, "the emitting thread holds the launcher's lock while it waits in the sink"
        cluster._lock.release()
        assert "hello" in cluster.output()
    emitter.join(5)
    assert not emitter.is_alive()


def test_ranks_whose_own_code_raised_are_named_together_by_their_error():
    every = raised_summary({"h0:0": "ValueError: bad", "h1:1": "ValueError: bad"}, 2)
    assert every.startswith("[launch] every rank left the run because its own code raised")
    assert "h0:0, h1:1 raised ValueError: bad;" in every
    some = raised_summary({"h0:0": "ValueError: bad", "h0:1": "MemoryError", "h1:3": "ValueError: bad"}, 4)
    assert some.startswith("[launch] 3 of 4 ranks left the run because its own code raised")
    assert "h0:0, h1:3 raised ValueError: bad; h0:1 raised MemoryError;" in some


def test_processes_that_ended_on_one_of_our_errors_are_named_together_by_it():
    line = stopped_summary({"controller": "ConfigError: bad", "h0:0": "ConfigError: bad", "h0:relay": "AuthError: no"})
    assert line == ("[launch] the run failed: controller, h0:0 raised ConfigError: bad; h0:relay raised AuthError: no; "
                    "each traceback is above, under its [label] prefix")
