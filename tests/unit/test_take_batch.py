"""The trainer's batch wait (trainer/loop.py::take_batch): rollout.timeout_s does not run while no
rollout server is in service (rollout.server_deadline_s pending) and counts from when one is back."""

import threading
import time

from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.trainer.loop import take_batch
from tests.unit.test_buffer import traj


def test_the_wait_outlasts_the_timeout_while_a_server_is_awaited():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    awaited = threading.Event()
    awaited.set()

    def server_back():  # the restarted server serves: a batch arrives well past the timeout
        awaited.clear()
        buf.put(traj("p0"))
        buf.put(traj("p1"))
    threading.Timer(1.0, server_back).start()
    batch = take_batch(buf, 0, 0, 0.2, lambda: False, awaited.is_set)
    assert batch is not None and [t.prompt_id for t in batch] == ["p0", "p1"]


def test_the_timeout_counts_from_when_a_server_is_back():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    awaited = threading.Event()
    awaited.set()
    threading.Timer(1.0, awaited.clear).start()  # a server back in service, but no batch from it
    t0 = time.monotonic()
    assert take_batch(buf, 0, 0, 0.5, lambda: False, awaited.is_set) is None
    assert time.monotonic() - t0 >= 1.5  # 1 s without a server, then the whole 0.5 s timeout


def test_the_timeout_ends_the_wait_when_servers_are_in_service():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    t0 = time.monotonic()
    assert take_batch(buf, 0, 0, 0.2, lambda: False, lambda: False) is None
    assert time.monotonic() - t0 < 10


def test_a_stop_ends_the_wait_while_a_server_is_awaited():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    stop = threading.Event()
    threading.Timer(0.5, stop.set).start()  # the driver's deadline passed (its error), or a signal
    assert take_batch(buf, 0, 0, 0.1, stop.is_set, lambda: True) is None
    assert stop.is_set()


def test_the_timeout_is_a_liveness_bound_not_a_batch_deadline():
    """A batch that fills more slowly than rollout.timeout_s (long trajectories) is not abandoned while
    trajectories keep arriving; only rollout.timeout_s with no arrival ends the wait."""
    buf = TrajectoryBuffer(batch_size=4, max_staleness=4)
    for i in range(3):  # one trajectory every 0.4 s: the batch is complete 1.6 s in, the timeout is 0.9 s
        threading.Timer(0.4 * (i + 1), buf.put, args=(traj(f"p{i}"),)).start()
    threading.Timer(1.6, buf.put, args=(traj("p3"),)).start()
    t0 = time.monotonic()
    batch = take_batch(buf, 0, 0, 0.9, lambda: False, lambda: False)
    assert batch is not None and [t.prompt_id for t in batch] == ["p0", "p1", "p2", "p3"]
    assert time.monotonic() - t0 >= 1.5
    t0 = time.monotonic()
    assert buf.take(1, 0, timeout=0.5) is None  # no arrival: the bound holds
    assert 0.45 <= time.monotonic() - t0 < 10
