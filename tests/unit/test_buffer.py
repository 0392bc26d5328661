"""TrajectoryBuffer: oldest-first batches, staleness policies, groups, persistence across a crash."""

import threading
import time

import pytest

from megatron_sao.buffer import TrajectoryBuffer
from megatron_sao.trajectory import TrajectoryBuilder


def traj(pid, version=0, status="terminated", n_actions=2):
    b = TrajectoryBuilder(prompt_id=pid)
    b.add_prompt([1, 2])
    b.add_action(list(range(3, 3 + n_actions)), [-0.5] * n_actions, version)
    t = b.finish(status, reward=1.0 if status == "terminated" else 0.0,
                 error="boom" if status == "failed" else None)
    t.info["data_pos"] = int(pid.split("@")[-1]) if "@" in pid else 0
    return t


def test_oldest_first_and_blocking_take():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    for i in range(3):
        buf.put(traj(f"p{i}"))
    assert [t.prompt_id for t in buf.take(step=0, current_version=0)] == ["p0", "p1"]
    assert buf.take(step=1, current_version=0, timeout=0.05) is None  # only one left
    threading.Timer(0.05, lambda: buf.put(traj("p3"))).start()
    assert [t.prompt_id for t in buf.take(step=1, current_version=0, timeout=5)] == ["p2", "p3"]


def test_take_stops_when_should_stop_turns_true_without_a_trajectory_arriving():
    """A dead rollout driver or a signal does not notify the buffer: take polls should_stop instead of
    sleeping out its whole timeout (the run would stop only after rollout.timeout_s)."""
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    buf.put(traj("p0"))
    stop = threading.Event()
    threading.Timer(0.2, stop.set).start()
    t0 = time.monotonic()
    assert buf.take(step=0, current_version=0, timeout=60, should_stop=stop.is_set) is None
    assert time.monotonic() - t0 < 30  # polled: about 0.2 s + STOP_POLL_S; before, the full 60 s


def test_take_timeout_counts_from_the_last_arrival():
    """rollout.timeout_s bounds a wait without progress: an arrival that does not complete the batch
    restarts it, and polling should_stop does not shorten it."""
    buf = TrajectoryBuffer(batch_size=3, max_staleness=4)
    buf.put(traj("p0"))
    threading.Timer(1.3, lambda: buf.put(traj("p1"))).start()
    threading.Timer(2.6, lambda: buf.put(traj("p2"))).start()
    batch = buf.take(step=0, current_version=0, timeout=2.0, should_stop=lambda: False)
    assert [t.prompt_id for t in batch] == ["p0", "p1", "p2"]  # 2.6 s in all, never 2 s without one


def test_failed_trajectories_are_counted_not_trained():
    buf = TrajectoryBuffer(batch_size=1, max_staleness=4)
    buf.put(traj("bad", status="failed"))
    buf.put(traj("good"))
    assert buf.stats.failed == 1 and buf.stats.received == 2
    assert [t.prompt_id for t in buf.take(0, 0)] == ["good"]


def test_drop_policy_counts_and_hands_back_stale_trajectories():
    dropped = []
    buf = TrajectoryBuffer(batch_size=1, max_staleness=2, staleness_policy="drop", on_drop=dropped.append)
    buf.put(traj("old", version=0))
    buf.put(traj("new", version=3))
    batch = buf.take(step=0, current_version=3)
    assert [t.prompt_id for t in batch] == ["new"]  # lag 3 > 2: dropped
    assert buf.stats.dropped_stale == 1 and [t.prompt_id for t in dropped] == ["old"]
    assert buf.stats.last_lag_histogram == {0: 1}


def test_keep_policy_trains_stale_trajectories():
    buf = TrajectoryBuffer(batch_size=2, max_staleness=1, staleness_policy="keep")
    buf.put(traj("old", version=0))
    buf.put(traj("new", version=5))
    batch = buf.take(step=0, current_version=5)
    assert [t.prompt_id for t in batch] == ["old", "new"] and buf.stats.dropped_stale == 0
    assert buf.stats.last_lag_histogram == {0: 1, 5: 1}


def test_grouped_take_waits_for_whole_groups():
    buf = TrajectoryBuffer(batch_size=4, max_staleness=9, group_size=2)
    for pid in ["a", "b", "a", "c"]:
        buf.put(traj(pid))
    assert buf.take(0, 0, timeout=0.05) is None  # only group a is complete
    buf.put(traj("b"))
    assert sorted(t.prompt_id for t in buf.take(0, 0)) == ["a", "a", "b", "b"]
    with pytest.raises(ValueError, match="multiple of group_size"):
        TrajectoryBuffer(batch_size=3, max_staleness=1, group_size=2)


def test_persistence_replays_exactly_what_no_checkpoint_covers(tmp_path):
    buf = TrajectoryBuffer(batch_size=2, max_staleness=9, directory=tmp_path)
    ts = [traj(f"p{i}") for i in range(6)]
    for t in ts:
        buf.put(t)
    buf.take(step=0, current_version=0)  # p0, p1
    buf.release_consumed(0)  # a checkpoint after step 0 covers p0, p1
    buf.take(step=1, current_version=0)  # p2, p3 trained, but the run "crashes" before a checkpoint
    buf.put(traj("failed", status="failed"))
    # A new process restores from the same directory.
    again = TrajectoryBuffer(batch_size=2, max_staleness=9, directory=tmp_path)
    restored = again.restore()
    assert [t.prompt_id for t in restored] == ["p2", "p3", "p4", "p5"]
    assert [t.traj_id for t in again.take(0, 0)] == [ts[2].traj_id, ts[3].traj_id]
    again.put(traj("p6"))  # new files never collide with the restored ones
    assert len(list(tmp_path.glob("*.safetensors"))) == 5


def test_drop_policy_trains_a_prompt_after_max_stale_drops():
    """An episode longer than the staleness bound is stale on every try: after `max_stale_drops`
    drops of one prompt, its next trajectory is trained on."""
    dropped = []
    buf = TrajectoryBuffer(batch_size=1, max_staleness=2, staleness_policy="drop", on_drop=dropped.append,
                           max_stale_drops=2)
    for attempt in range(3):
        buf.put(traj("slow@0", version=0))
        got = buf.take(step=attempt, current_version=10, timeout=0.05)
        assert (got is None) == (attempt < 2), attempt
    assert [t.prompt_id for t in got] == ["slow@0"] and buf.stats.last_lag_histogram == {10: 1}
    assert buf.stats.dropped_stale == 2 and len(dropped) == 2 and buf.stats.kept_after_drops == 1
    buf.put(traj("slow@0", version=0))  # the count was spent on the trained trajectory: a new one starts over
    assert buf.take(step=3, current_version=10, timeout=0.05) is None and buf.stats.dropped_stale == 3


def test_a_failed_member_does_not_strand_its_group():
    buf = TrajectoryBuffer(batch_size=4, max_staleness=9, group_size=2)
    buf.put(traj("a"))
    buf.put(traj("a", status="failed"))  # a's other member failed: the group is complete without it
    buf.put(traj("b"))
    assert buf.take(0, 0, timeout=0.05) is None  # b still waits for its second member
    buf.put(traj("b"))
    batch = buf.take(0, 0, timeout=5)
    assert sorted(t.prompt_id for t in batch) == ["a", "b", "b"]
    assert buf.stats.groups_with_failures == 1 and buf.stats.failed == 1
    buf.put(traj("c", status="failed"))
    buf.put(traj("c", status="failed"))  # a group with no survivor leaves nothing behind
    assert buf._failed_members == {}


def test_failed_group_members_are_known_after_a_restore(tmp_path):
    buf = TrajectoryBuffer(batch_size=2, max_staleness=9, group_size=2, directory=tmp_path)
    buf.put(traj("a", status="failed"))
    buf.put(traj("a"))
    again = TrajectoryBuffer(batch_size=2, max_staleness=9, group_size=2, directory=tmp_path)
    again.restore()
    again.put(traj("b"))
    again.put(traj("b"))
    assert [t.prompt_id for t in again.take(0, 0, timeout=5)] == ["a"]  # groups complete in finish order

def test_files_a_checkpoint_covers_are_never_trained_again_whatever_the_release_did(tmp_path):
    """A kill between the checkpoint commit and the release of the trained files: the checkpoint's
    `covered` list, not the files on disk, decides what resume trains."""
    buf = TrajectoryBuffer(batch_size=2, max_staleness=9, directory=tmp_path)
    ts = [traj(f"p{i}") for i in range(6)]
    for t in ts:
        buf.put(t)
    buf.take(step=0, current_version=0)
    buf.take(step=1, current_version=0)
    covered = {tid: step for tid, step in buf.covered()}  # what a checkpoint after step 1 records
    assert covered == {ts[0].traj_id: 0, ts[1].traj_id: 0, ts[2].traj_id: 1, ts[3].traj_id: 1}
    # ... and the process dies before release_consumed: all six files are still there.
    (tmp_path / "000000099-deadbeef.safetensors.tmp-1-ab").write_bytes(b"half")  # killed mid-write
    again = TrajectoryBuffer(batch_size=2, max_staleness=9, directory=tmp_path)
    assert not list(tmp_path.glob("*.tmp-*"))
    assert [t.prompt_id for t in again.restore(covered)] == ["p4", "p5"]
    assert [t.prompt_id for t in again.restore()] == ["p4", "p5"]  # idempotent
    # The covered files are consumed, released once an older kept checkpoint covers their step.
    assert again.release_consumed(0) == 2
    assert len(list(tmp_path.glob("*.safetensors"))) == 4
    assert sorted(tid for tid, _ in again.covered()) == sorted([ts[2].traj_id, ts[3].traj_id])


def test_a_stop_request_ends_the_wait_though_no_trajectory_wakes_it():
    """A stop signal or a restarted server to readmit arrives with no trajectory (no server in
    service): the wait must see it within a poll, not after the whole timeout."""
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    stop = threading.Event()
    threading.Timer(0.1, stop.set).start()
    t0 = time.monotonic()
    assert buf.take(step=0, current_version=0, timeout=60, should_stop=stop.is_set) is None
    assert time.monotonic() - t0 < 10  # not the 60 s timeout


def segments(pid, n, version=0, episode=None):
    """A harness episode of n segments (rollout/agent_endpoint/session.py), in the order they arrive."""
    out = []
    for k in range(n):
        t = traj(pid, version=version)
        t.info.update(episode=episode or pid, segment=k, segments=n)
        out.append(t)
    return out


def test_a_batch_is_whole_episodes_and_an_episode_waits_for_its_end():
    """batch_size counts episodes: a harness episode's segments are taken together, and not before its
    last one arrived; a synchronous run then trains each batch at one version."""
    buf = TrajectoryBuffer(batch_size=2, max_staleness=4)
    a, b = segments("a@0", 3), segments("b@1", 2)
    buf.put(a[0])
    buf.put(a[1])
    buf.put(traj("c@2"))
    buf.put(b[0])
    assert buf.take(0, 0, timeout=0.05) is None  # a has no end yet: one whole episode (c) only
    buf.put(a[2])
    batch = buf.take(0, 0, timeout=1)  # episodes in the order they began arriving: a, then c
    assert [t.traj_id for t in batch[:3]] == [t.traj_id for t in a] and len(batch) == 4
    assert batch[3].prompt_id == "c@2"
    buf.put(b[1])
    buf.put(traj("d@3"))
    assert [t.traj_id for t in buf.take(1, 0, timeout=1)][:2] == [t.traj_id for t in b]


def test_a_stale_episode_is_dropped_whole_and_requeued_once():
    dropped = []
    buf = TrajectoryBuffer(batch_size=1, max_staleness=0, staleness_policy="drop", on_drop=dropped.append)
    old = segments("a@0", 2, version=0)
    for t in old:
        buf.put(t)
    buf.put(traj("b@1", version=1))
    assert [t.prompt_id for t in buf.take(1, current_version=1)] == ["b@1"]
    assert [t.traj_id for t in dropped] == [old[-1].traj_id] and buf.stats.dropped_stale == 2


def test_resume_reruns_an_episode_whose_end_was_not_written():
    from megatron_sao.rollout.prompts import complete_units

    whole, cut = segments("a@0", 2), segments("b@1", 3)[:2]
    single = traj("c@2")
    for t, pos in ((whole, 0), (cut, 1)):
        for s in t:
            s.info["data_pos"] = pos
    single.info["data_pos"] = 2
    units, partial = complete_units(whole + cut + [single])
    assert units == {(0, 0), (2, 0)} and partial == [t.traj_id for t in cut]
