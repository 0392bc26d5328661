"""One SAO trainer step (see `sao_step`).

ALGORITHM_VERSION names what a run computes from a given config. Bump it with every change that
makes the same config and overrides train differently (a default's meaning, a loss, the targets,
what the buffer hands the trainer, a rollout's bootstrap): the paper-claims suite's run cache
(benchmarks/reproduce/runner.py) keys on it, so results computed before such a change are never
reused for a report after it.
  1: the suite's first results.
  2: issue 12: staleness_policy keep by default, vanilla `grpo` against the learner's own
     log-probs, the critic freezes embeddings/router/norms too, the truncation bootstrap reads a
     trained state, the step-level ablation keeps the adaptive lambda.
"""

ALGORITHM_VERSION = 2
