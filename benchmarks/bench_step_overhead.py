"""The train step's own overhead: MegatronEngine's actor and critic steps against a minimal plain loop.

The plain loop is what a user would write by hand: the HF model with sdpa attention, the same DIS loss
(actor) or value loss (critic) in a few lines, AdamW, gradient clipping, the same micro-batches. Both
sides train the same weights on the same batch, in interleaved rounds: each round runs `--steps` steps
of every side in turn (engine actor, plain actor, engine critic, plain critic) and takes their median,
so a load change on the machine hits both sides of a round alike. `actor_ratio` / `critic_ratio` =
engine step / plain step, the median over the rounds of each round's ratio, with its min and max (the
target is <= 1.1), and the forward+backward and optimizer parts beside them. A step is the whole
`train_step` call (engine) or loop body (plain); its forward+backward part is Megatron's schedule
(engine) or the micro-batch loop (plain), its optimizer part the rest: clipping and the update, and on
the engine's side also its batch plan and metric reduction.

`--phases` then runs two more steps per side with per-phase timers (step_phases.py: embedding, norms,
attention, MLP, head, the loss and its backward, the rest of the backward, optimizer) and prints the
table of where the engine's time goes against the plain loop's.

`--clock cpu` counts the process's CPU seconds (time.process_time) instead of wall seconds: on a
machine shared with other jobs the wall clock also counts the time spent waiting for a core, which
hits the two sides unequally however they are interleaved. It needs `--threads 1` (OpenMP's idle
workers spin, and their CPU time would count). The JSON carries the machine's load average: a figure
taken at a load above the core count is a loaded machine's.

Commands (the figures in the README and docs/benchmarks.md):
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_step_overhead.py --model smollm2-shape \\
        --batch 8 --seq 140 --threads 1 --clock cpu --steps 3 --json
    OMP_NUM_THREADS=2 .venv/bin/python benchmarks/bench_step_overhead.py --model smollm2-shape \\
        --batch 8 --seq 140 --threads 2 --steps 3 --json
    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_step_overhead.py --model smollm2-shape \\
        --batch 8 --seq 140 --threads 1 --clock cpu --rounds 1 --phases

--model: `auto` (default) uses runs/smollm2/hf when it exists (make smollm2), else the tiny Llama
preset; `tiny`; `smollm2-shape` (SmolLM2-135M's config with random weights: the timing is the
weights'-shape's, so no download is needed); or a path to an HF model directory.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

EPS_LOW, EPS_HIGH, LR, CLIP = 0.3, 5.0, 1e-6, 1.0
CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}


def smollm2_shape_config():
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                       num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                       rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True, hidden_act="silu",
                       architectures=["LlamaForCausalLM"])


def resolve_model(name: str, tmp: Path) -> tuple[str, str]:
    """(description, HF directory) of the model both sides train."""
    from transformers import AutoModelForCausalLM

    from megatron_sao.models.presets import tiny_hf_config

    if name == "auto":
        name = str(ROOT / "runs/smollm2/hf") if (ROOT / "runs/smollm2/hf/config.json").is_file() else "tiny"
    if name in ("tiny", "smollm2-shape"):
        cfg = tiny_hf_config("llama") if name == "tiny" else smollm2_shape_config()
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(tmp / "hf")
        return name, str(tmp / "hf")
    if not (Path(name) / "config.json").is_file():
        raise SystemExit(f"--model {name}: not tiny / smollm2-shape / auto, and no HF directory there")
    return name, name


def make_batch(vocab: int, b: int, t: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    action = torch.ones(b, t, dtype=torch.bool)
    action[:, : t // 4] = False  # a prompt, then actions
    return dict(tokens=torch.randint(0, vocab, (b, t), generator=g), attention_mask=torch.ones(b, t, dtype=torch.bool),
                action_mask=action, advantages=torch.randn(b, t, generator=g), returns=torch.randn(b, t, generator=g))


# ---------------------------------------------------------------------------------------------- plain loop
class PlainCritic(torch.nn.Module):
    """The HF backbone with a [1, H] value head (the engine's critic: the actor's backbone, output layer
    replaced by a scalar projection)."""

    def __init__(self, causal_lm):
        super().__init__()
        self.backbone = causal_lm.model
        self.head = torch.nn.Linear(causal_lm.config.hidden_size, 1)

    def forward(self, input_ids):
        return self.head(self.backbone(input_ids=input_ids).last_hidden_state).squeeze(-1)


def plain_actor_loss(model, mb, denom):
    logits = model(input_ids=mb["tokens"]).logits
    lp = torch.log_softmax(logits.float(), -1)[:, :-1].gather(-1, mb["tokens"][:, 1:, None]).squeeze(-1)
    lp = torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)
    ratio = torch.exp(lp - mb["rollout_logprobs"])
    keep = mb["action_mask"] & (ratio.detach() > 1 - EPS_LOW) & (ratio.detach() < 1 + EPS_HIGH)
    return -torch.where(keep, ratio * mb["advantages"], 0.0).sum() / denom


def plain_critic_loss(model, mb, denom):
    v = model(mb["tokens"])
    v = torch.cat([torch.zeros_like(v[:, :1]), v[:, :-1]], dim=1)  # V(state before token t) at t
    return (0.5 * torch.where(mb["action_mask"], (v - mb["returns"]) ** 2, 0.0)).sum() / denom


def plain_step(model, opt, loss_fn, batch, micro: int, clock, timer=None) -> tuple[float, float]:
    """(fwd+bwd seconds, optimizer seconds) of one step over the batch's micro-batches."""
    t0 = clock()
    denom = batch["action_mask"].sum().clamp(min=1).float()
    opt.zero_grad(set_to_none=True)
    for i in range(0, batch["tokens"].shape[0], micro):
        loss = loss_fn(model, {k: v[i:i + micro] for k, v in batch.items()}, denom)
        if timer:
            timer.loss_done()
        loss.backward()
        if timer:
            timer.backward_done()
    t1 = clock()
    torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
    opt.step()
    return t1 - t0, clock() - t1


# ---------------------------------------------------------------------------------------------- the engine
class ScheduleClock:
    """Times Megatron's forward-backward schedule inside `train_step` (the engine calls it as
    `forward.run_schedule`), so the engine's step splits like the plain loop's on either clock."""

    def __init__(self, clock) -> None:
        from megatron_sao.megatron import forward

        self.clock, self.seconds, self._run = clock, 0.0, forward.run_schedule
        forward.run_schedule = self

    def __call__(self, *args, **kwargs):
        t0 = self.clock()
        try:
            return self._run(*args, **kwargs)
        finally:
            self.seconds = self.clock() - t0


def engine_step(engine, loss_fn, batch, schedule: ScheduleClock) -> tuple[float, float]:
    t0 = schedule.clock()
    engine.train_step(batch, loss_fn)
    total = schedule.clock() - t0
    return schedule.seconds, total - schedule.seconds


def phase_hooks(timer):
    """Route the engine's loss and backward through `timer` (step_phases.PhaseTimer): the loss closure
    reports when a micro-batch's loss is computed, Megatron's `backward_step` when its backward returns.
    Returns the function that undoes both."""
    from megatron.core.pipeline_parallel import schedules

    from megatron_sao.megatron import forward

    make, backward_step = forward.make_train_loss_func, schedules.backward_step

    def make_timed(*args, **kwargs):
        inner = make(*args, **kwargs)

        def make_loss_func(mb):
            loss_func = inner(mb)

            def timed(output):
                result = loss_func(output)
                timer.loss_done()
                return result
            return timed
        return make_loss_func

    def backward_timed(*args, **kwargs):
        try:
            return backward_step(*args, **kwargs)
        finally:
            timer.backward_done()

    forward.make_train_loss_func, schedules.backward_step = make_timed, backward_timed

    def undo():
        forward.make_train_loss_func, schedules.backward_step = make, backward_step
    return undo


def spread(values: list[float]) -> dict[str, float]:
    return {"min": min(values), "median": statistics.median(values), "max": max(values)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="auto")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=140)
    ap.add_argument("--micro-batch-size", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds (after one warm-up round)")
    ap.add_argument("--steps", type=int, default=1, help="steps per side in each round (the round takes their median)")
    ap.add_argument("--phases", action="store_true",
                    help="then two more rounds with per-phase timers (step_phases.py): where the time goes")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--clock", choices=sorted(CLOCKS), default="wall",
                    help="wall seconds, or the process's CPU seconds (needs --threads 1; see the docstring)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.clock == "cpu" and args.threads != 1:
        ap.error(f"--clock cpu needs --threads 1 (got {args.threads}): idle OpenMP workers spin and their "
                 f"CPU seconds would count")
    if args.rounds < 1 or args.steps < 1:
        ap.error("--rounds and --steps must be >= 1")
    torch.set_num_threads(args.threads)
    clock = CLOCKS[args.clock]

    from megatron_sao.megatron.cpu_compat import ensure_cpu_compat

    ensure_cpu_compat()
    from transformers import AutoModelForCausalLM

    from benchmarks.step_phases import PHASES, PhaseTimer
    from megatron_sao.config import AlgorithmConfig
    from megatron_sao.megatron.engine import InitSource, MegatronEngine
    from megatron_sao.megatron.optimizer import OptimConfig
    from megatron_sao.models.hf_config import model_spec_from_hf
    from megatron_sao.models.parallel_sizes import ParallelSizes
    from megatron_sao.trainer.losses import critic_loss_fn, policy_loss_fn

    with tempfile.TemporaryDirectory() as tmp:
        desc, hf_dir = resolve_model(args.model, Path(tmp))
        hf_actor = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32, attn_implementation="sdpa")
        hf_critic = PlainCritic(AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32,
                                                                     attn_implementation="sdpa"))
        spec = model_spec_from_hf(hf_actor.config)
        sizes = ParallelSizes()
        optim = OptimConfig(lr=LR, clip_grad=CLIP)
        actor = MegatronEngine(spec, sizes, optim, role="actor", init=InitSource.from_hf(hf_dir),
                               micro_batch_size=args.micro_batch_size)
        critic = MegatronEngine(spec, sizes, optim, role="critic", init=InitSource.from_hf(hf_dir),
                                micro_batch_size=args.micro_batch_size, ctx=actor.ctx)
    batch = make_batch(spec.vocab_size, args.batch, args.seq)
    batch["rollout_logprobs"] = actor.logprobs(batch)  # the sampler's log-probs = the policy's: DIS keeps them
    adamw = dict(lr=LR, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    opt_actor = torch.optim.AdamW(hf_actor.parameters(), **adamw)
    opt_critic = torch.optim.AdamW(hf_critic.parameters(), **adamw)
    policy_loss, value_loss = policy_loss_fn(AlgorithmConfig(name="sao")), critic_loss_fn()
    mb = args.micro_batch_size
    schedule = ScheduleClock(clock)
    sides = {
        "engine_actor": lambda timer=None: engine_step(actor, policy_loss, batch, schedule),
        "plain_actor": lambda timer=None: plain_step(hf_actor, opt_actor, plain_actor_loss, batch, mb, clock, timer),
        "engine_critic": lambda timer=None: engine_step(critic, value_loss, batch, schedule),
        "plain_critic": lambda timer=None: plain_step(hf_critic, opt_critic, plain_critic_loss, batch, mb, clock,
                                                      timer),
    }
    # rounds[side] = one (fwd+bwd, optimizer) per round: the median of the round's steps of that side
    rounds: dict[str, list[tuple[float, float]]] = {k: [] for k in sides}
    for rep in range(args.rounds + 1):  # interleaved; round 0 is the warm-up
        for name, fn in sides.items():
            steps = [fn() for _ in range(args.steps)]
            part = (statistics.median(s[0] for s in steps), statistics.median(s[1] for s in steps))
            if rep:
                rounds[name].append(part)
            print(f"round {rep} {name}: fwd+bwd {part[0]:.3f} s, optimizer {part[1]:.3f} s", file=sys.stderr,
                  flush=True)

    out = {"model": desc, "params": sum(p.numel() for p in hf_actor.parameters()), "batch": args.batch,
           "seq": args.seq, "micro_batch_size": mb, "threads": args.threads, "clock": args.clock,
           "rounds": args.rounds, "steps": args.steps, "load_avg": list(os.getloadavg())}
    for role in ("actor", "critic"):
        e, p = rounds[f"engine_{role}"], rounds[f"plain_{role}"]
        totals = {"": [sum(a) / sum(b) for a, b in zip(e, p)], "_fwd_bwd": [a[0] / b[0] for a, b in zip(e, p)],
                  "_optimizer": [a[1] / b[1] for a, b in zip(e, p)]}
        for suffix, ratios in totals.items():  # per-round ratios: a load change hits both sides of a round
            sp = spread(ratios)
            out[f"{role}{suffix}_ratio"] = sp["median"]
            out[f"{role}{suffix}_ratio_min"], out[f"{role}{suffix}_ratio_max"] = sp["min"], sp["max"]
        out[f"{role}_ratio_rounds"] = totals[""]
        out[f"engine_{role}_s"] = spread([sum(a) for a in e])
        out[f"plain_{role}_s"] = spread([sum(b) for b in p])
    if args.phases:
        out["phases"] = {}
        for role, engine in (("actor", actor), ("critic", critic)):
            table = {}
            plain = hf_actor if role == "actor" else hf_critic
            for side, model in ((f"engine_{role}", engine.chunks[0]), (f"plain_{role}", plain)):
                timer = PhaseTimer(model, clock)
                undo = phase_hooks(timer) if side.startswith("engine") else (lambda: None)
                try:
                    parts = [sides[side](timer) for _ in range(2)]
                finally:
                    undo()
                    timer.remove()
                fwd_bwd = sum(x[0] for x in parts) / 2
                sec = {k: v / 2 for k, v in timer.seconds.items()}
                sec["optimizer"] = sum(x[1] for x in parts) / 2
                sec["forward other"] = fwd_bwd - sum(v for k, v in sec.items() if k != "optimizer")
                table[side] = sec
            out["phases"][role] = {k: [table[f"engine_{role}"][k], table[f"plain_{role}"][k]]
                                   for k in (*PHASES, "forward other")}
    if args.json:
        print(json.dumps(out))
        return
    print(f"model {desc} ({out['params']:,} params), batch {args.batch} x {args.seq}, micro-batch {mb}, "
          f"threads {args.threads}, {args.clock} clock, {args.rounds} interleaved rounds of {args.steps} step(s) "
          f"per side, load {out['load_avg'][0]:.1f}")
    for role in ("actor", "critic"):
        e, p = out[f"engine_{role}_s"], out[f"plain_{role}_s"]
        print(f"{role:6s}: engine {e['median']:.3f} s, plain {p['median']:.3f} s; ratio median "
              f"{out[f'{role}_ratio']:.3f} (min {out[f'{role}_ratio_min']:.3f}, max {out[f'{role}_ratio_max']:.3f}); "
              f"fwd+bwd {out[f'{role}_fwd_bwd_ratio']:.3f}, optimizer {out[f'{role}_optimizer_ratio']:.3f}")
    for role, table in out.get("phases", {}).items():
        print(f"\n{role} phases (s per step): engine / plain / difference")
        for k, (a, b) in table.items():
            print(f"  {k:15s} {a:8.3f} {b:8.3f} {a - b:+8.3f}")


if __name__ == "__main__":
    main()
