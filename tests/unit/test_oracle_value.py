"""The oracle ceiling on a hand-built case whose explained variance is known in closed form.

One task, reference actions `<c>1+2</c>` then `=3`. Good episodes follow them (reward 1); bad ones
call `<c>1+5</c>`, get `ERR` and answer `=6` (reward 0). Each episode has 12 action tokens (one per
character). Before the bad episode's `5` nothing tells the two apart: those 6 tokens have the
oracle value 0.5 (half the episodes succeed); from the `5` on, every state says how it ends. So the
oracle explains 1 - 6/12 = 0.5 of the return variance on held-out episodes.
"""

import pytest

from megatron_sao.config import AlgorithmConfig
from megatron_sao.trainer.oracle_value import oracle_ceiling, progress_keys, significant
from megatron_sao.trajectory import Span, Trajectory

REFS = ["<c>1+2</c>", "=3"]


def _episode(i: int, good: bool) -> Trajectory:
    parts = [("prompt", "Q:"), ("action", "<c>1+2</c>" if good else "<c>1+5</c>"),
             ("observation", "3" if good else "ERR"), ("action", "=3" if good else "=6")]
    tokens, mask, spans = [], [], []
    for kind, text in parts:
        spans.append(Span(len(tokens), len(tokens) + len(text), kind))
        tokens += [ord(c) for c in text]
        mask += [kind == "action"] * len(text)
    return Trajectory(tokens=tokens, action_mask=mask, rollout_logprobs=[-0.1 if m else 0.0 for m in mask],
                      versions=[0 if m else -1 for m in mask], spans=spans, reward=float(good), status="terminated",
                      prompt_id=f"p{i}")


def _decode(ids):
    return "".join(chr(i) for i in ids)


def test_the_oracle_explains_what_the_visible_prefix_reveals():
    train = [_episode(i, i % 2 == 0) for i in range(20)]
    held = [_episode(100 + i, i % 2 == 0) for i in range(10)]
    res = oracle_ceiling(train, held, lambda t: REFS, _decode, AlgorithmConfig())
    assert res.explained_variance == pytest.approx(0.5, abs=1e-6)
    assert res.fit["ev_turn_1"] == pytest.approx(1.0)  # by the answer turn every state is decided
    assert (res.train_trajectories, res.heldout_trajectories) == (20, 10)


def test_keys_turn_off_track_at_the_first_wrong_significant_character():
    pieces = [list("<c>1+5</c>"), list("=6")]
    keys = progress_keys(pieces, REFS)
    on = [k[0] for k in keys]
    assert on == [True] * 6 + [False] * 6  # '<' '<c>' ... up to the state before '5'
    assert significant("The answer is \\boxed{518}.") == "518"


def test_a_key_without_enough_training_support_falls_back_to_a_coarser_one():
    # The bad held-out episode goes where no training episode went: its off-track keys have no support
    # (not even the coarsest, "off track") and fall back to the mean of all training tokens.
    train = [_episode(i, True) for i in range(6)]
    res = oracle_ceiling(train, [_episode(50, True), _episode(51, False)], lambda t: REFS, _decode,
                         AlgorithmConfig(), min_support=5)
    assert res.fit["value_mean"] == pytest.approx(1.0)  # every known or fallback value is a good episode's
