"""`sao value-pretrain` writes JSON that strict readers take: an EV over a turn no held-out trajectory
reaches is NaN, which `json.dumps` would write as the non-JSON token `NaN`. It goes through the run
directory's `jsonable`, as every line of a run's metrics.jsonl does."""

import json
import math

from megatron_sao.trainer.run_dir import jsonable


def _strict(text: str):
    return json.loads(text, parse_constant=lambda c: (_ for _ in ()).throw(ValueError(f"not JSON: {c}")))


def test_non_finite_floats_are_named_and_the_rest_is_kept():
    summary = {"ev_heldout_best": 0.145, "ceiling": {"fit": {"ev_turn_1": 0.3, "ev_turn_2": math.nan}},
               "rows": [1.0, -math.inf, "x"], "steps_run": 30, "stopped_early": False}
    text = json.dumps(jsonable(summary), allow_nan=False)
    assert _strict(text) == {"ev_heldout_best": 0.145, "ceiling": {"fit": {"ev_turn_1": 0.3, "ev_turn_2": "nan"}},
                             "rows": [1.0, "-inf", "x"], "steps_run": 30, "stopped_early": False}
