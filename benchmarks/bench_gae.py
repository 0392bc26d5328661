"""Benchmark: vectorized skip-observation GAE vs a plain per-token Python loop.

Command (CPU, the default workload of 256 rows x 8192 tokens, float32):

    OMP_NUM_THREADS=1 PYTHONPATH=. .venv/bin/python benchmarks/bench_gae.py

Options: --rows, --tokens, --device cuda, --dtype float64, --threads, --repeats, --ref-rows N and
--slow-rows M (the reference loops run on the first N / M rows only and their times are scaled
by rows / N and rows / M; the output says so).

The workload mimics agent trajectories: a prompt, then alternating action segments (50-800 tokens)
and observation segments (20-400 tokens), then padding; the reward is on each row's last action
token; lambda is the length-adaptive per-row lambda (alpha = 1.5). The reference loop walks the
action tokens of a row backwards with Python floats (already faster than indexing tensors per
token) and, separately, the same loop indexing torch tensors per token (a direct port of the
formula); the list loop's time is also shown with the tensor <-> list conversions it needs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from megatron_sao.algorithms.advantages import adaptive_lambda, skip_observation_gae


def make_batch(rows: int, tokens: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(rewards, values, action_mask) float64/float64/bool on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, tokens, dtype=torch.bool)
    rewards = torch.zeros(rows, tokens, dtype=torch.float64)
    for b in range(rows):
        t = int(torch.randint(64, 1024, (1,), generator=gen))  # prompt
        end = int(torch.randint(tokens // 2, tokens + 1, (1,), generator=gen))  # padding after `end`
        last = -1
        while t < end:
            span = min(int(torch.randint(50, 801, (1,), generator=gen)), end - t)
            mask[b, t : t + span] = True
            last = t + span - 1
            t += span + int(torch.randint(20, 401, (1,), generator=gen))
        if last >= 0:
            rewards[b, last] = float(torch.randint(0, 2, (1,), generator=gen))
    values = torch.randn(rows, tokens, generator=gen, dtype=torch.float64) * 0.1
    return rewards, values, mask


def reference_gae(rewards: list, values: list, mask: list, gamma: float, lams: list) -> list:
    """Per-token loop over each row's action tokens (lists of Python floats / bools)."""
    out = []
    for r_row, v_row, m_row, lam in zip(rewards, values, mask, lams):
        adv = [0.0] * len(r_row)
        next_adv, next_value = 0.0, 0.0
        for t in range(len(r_row) - 1, -1, -1):
            if not m_row[t]:
                continue
            delta = r_row[t] + gamma * next_value - v_row[t]
            next_adv = delta + gamma * lam * next_adv
            adv[t] = next_adv
            next_value = v_row[t]
        out.append(adv)
    return out


def reference_gae_tensors(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float,
                          lams: torch.Tensor) -> torch.Tensor:
    """The same loop indexing torch tensors per token (what a direct port of the formula does)."""
    adv = torch.zeros_like(values)
    for b in range(rewards.shape[0]):
        next_adv = torch.zeros((), dtype=values.dtype)
        next_value = torch.zeros((), dtype=values.dtype)
        for t in range(rewards.shape[1] - 1, -1, -1):
            if not mask[b, t]:
                continue
            delta = rewards[b, t] + gamma * next_value - values[b, t]
            next_adv = delta + gamma * lams[b] * next_adv
            adv[b, t] = next_adv
            next_value = values[b, t]
    return adv


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rows", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "float64"])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--ref-rows", type=int, default=16)
    parser.add_argument("--slow-rows", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    gamma = 1.0

    rewards, values, mask = make_batch(args.rows, args.tokens)
    lam = adaptive_lambda(mask.sum(1), alpha=1.5, dtype=torch.float64)
    r_dev, v_dev = rewards.to(device, dtype), values.to(device, dtype)
    m_dev, lam_dev = mask.to(device), lam.to(device, dtype)
    print(f"workload: {args.rows} x {args.tokens} tokens, {mask.float().mean().item():.1%} action tokens, "
          f"{args.dtype} on {device}, torch threads {torch.get_num_threads()}")

    skip_observation_gae(r_dev, v_dev, m_dev, gamma, lam_dev)  # warm-up (allocator, kernels)
    times = []
    for _ in range(args.repeats):
        sync(device)
        start = time.perf_counter()
        adv, _ = skip_observation_gae(r_dev, v_dev, m_dev, gamma, lam_dev)
        sync(device)
        times.append(time.perf_counter() - start)
    vec = statistics.median(times)

    n_ref = min(args.ref_rows, args.rows)
    scale = args.rows / n_ref
    start = time.perf_counter()
    ref_inputs = (rewards[:n_ref].tolist(), values[:n_ref].tolist(), mask[:n_ref].tolist())
    converted = time.perf_counter()
    ref_adv = reference_gae(*ref_inputs, gamma, lam[:n_ref].tolist())
    looped = time.perf_counter()
    ref_tensor = torch.tensor(ref_adv, dtype=torch.float64)
    done = time.perf_counter()
    loop_time = (looped - converted) * scale
    total_time = (done - start) * scale
    max_diff = (adv[:n_ref].double().cpu() - ref_tensor).abs().max().item()

    n_slow = min(args.slow_rows, args.rows)
    start = time.perf_counter()
    reference_gae_tensors(rewards[:n_slow], values[:n_slow], mask[:n_slow], gamma, lam[:n_slow])
    slow_time = (time.perf_counter() - start) * args.rows / n_slow

    note = "" if n_ref == args.rows else f"  (measured on {n_ref} rows, scaled by {args.rows}/{n_ref})"
    print(f"vectorized skip_observation_gae:          {vec * 1e3:9.1f} ms  (median of {args.repeats})")
    print(f"per-token Python loop alone:              {loop_time * 1e3:9.1f} ms{note}")
    print(f"  + tensor <-> list conversion it needs:  {total_time * 1e3:9.1f} ms")
    print(f"per-token loop indexing tensors:          {slow_time * 1e3:9.1f} ms  "
          f"(measured on {n_slow} row(s), scaled by {args.rows}/{n_slow})")
    print(f"speed-up: {loop_time / vec:.1f}x over the loop alone, {total_time / vec:.1f}x with conversion; "
          f"{slow_time / vec:.0f}x over the tensor-indexing loop; max |adv - reference| = {max_diff:.2e}")


if __name__ == "__main__":
    main()
