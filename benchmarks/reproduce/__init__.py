"""Small-scale reproduction of the SAO paper's claims (issue: ablations, staleness, online learning).

    sao bench main          # SFT vs GRPO vs GRPO+DIS vs SAO at equal trajectory budget
    sao bench main --model smollm2 [--task arith|chain] [--max-runs N]
                            # on SmolLM2-135M-Instruct: + SAO sync, running mean; budgets A and B
    sao bench ablations     # K=1, attention trained, running mean, no value pretraining, step-level GAE
    sao bench staleness     # imposed policy lag 1/4/16: vanilla GRPO vs GRPO+DIS vs SAO
    sao bench online        # style shift: critic vs running-mean baseline, recovery after switches
    sao bench online --model smollm2 [--max-runs N]   # the same on SmolLM2-135M-Instruct
    sao bench online ... --switch-every N --actor-lr X  # another schedule, in a results folder of its own
    sao bench throughput    # async vs sync on heavy-tailed tool latency
    sao bench dynamics [--stress] [--max-runs N]   # 500 async steps (--stress: lag 8, 4x the LR, 100 steps)
    sao bench all           # all five, in that order (the two starting points first, side by side)
    ... --quick             # tiny budgets: checks the pipeline end to end (CI), numbers mean nothing

Results (results.md, summary.json, PNG plots) go to results/reproduce/<experiment>/ (--out); run
directories and the shared starting points to runs/reproduce/ (--work), reused when re-run.
`--model smollm2` and `dynamics` also keep one result file per finished run (results/reproduce/<folder>/runs/,
run_results.py) and skip the runs already there, so their runs (30-60 min each on SmolLM2) can be spread
over sessions with `--max-runs N`.
"""
