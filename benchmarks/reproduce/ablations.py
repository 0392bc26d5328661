"""SAO ablations on the toy task: K=1, attention not frozen, running-mean baseline instead of a
critic, no value pretraining, step-level GAE (turn average / turn last token).

Every variant changes one thing of the SAO reference (which is the same run as the main
comparison's SAO, reused from the cache). The critic's gradient norm is logged split into attention
and MoE parameters: the paper freezes the critic's attention because its gradients dominate.
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from benchmarks.reproduce.experiment import Settings, finish, rl_run, run_and_load
from benchmarks.reproduce.report import band_plot, header, md_table, save_fig
from benchmarks.reproduce.starts import toy_start
from benchmarks.reproduce.summary import paired_delta, stat


def variants(start) -> dict[str, tuple[str, tuple[str, ...]]]:
    """label -> (method, overrides on top of it)."""
    return {
        "sao": ("sao", ()),
        "k1": ("sao", ("algorithm.critic_steps=1",)),
        # Only attention changes: the rest of the paper's frozen set (embeddings, router, norms) stays frozen.
        "attention_trained": ("sao", ("critic.freeze=[embeddings,router,norms]",)),
        "running_mean": ("running_mean", ()),
        # The critic starts from the SFT policy's weights with a fresh value head.
        "no_value_pretrain": ("sao", (f"critic.init={start.sft_model}",)),
        "step_gae_avg": ("sao", ("algorithm.advantage=step_avg",)),
        "step_gae_last": ("sao", ("algorithm.advantage=step_last",)),
    }


def run(s: Settings) -> int:
    b = s.budget
    start = toy_start(s.quick, s.work, s.log)
    sft = start.evaluate_sft(b.eval_size, s.log)
    v = variants(start)
    runs = [rl_run(s, start, label, seed, method, extra) for label, (method, extra) in v.items() for seed in s.seeds]
    results, groups = run_and_load(s, runs, b.batch, sft["accuracy"])

    rows, data = [], {}
    for label, cs in groups.items():
        final = stat([c.final_eval() for c in cs])
        ev = stat([c.last_fraction_mean("critic/explained_variance") for c in cs])
        attn = stat([c.last_fraction_mean("critic/grad_norm/attention", 1.0) for c in cs])
        moe = stat([c.last_fraction_mean("critic/grad_norm/moe", 1.0) for c in cs])
        delta = paired_delta(cs, groups.get("sao", []))
        method, extra = v[label]
        change = " ".join(extra).replace(str(start.dir), "<start>") or (
            "(reference)" if method == "sao" else f"algorithm.name={method}")
        rows.append([label, change, str(len(cs)), final.fmt(), delta.fmt(),
                     stat([c.last_fraction_mean("reward") for c in cs]).fmt(), ev.fmt(2), attn.fmt(3), moe.fmt(3)])
        data[label] = {"overrides": v[label], "final_eval": final.values, "paired_delta_vs_sao": delta.values,
                       "explained_variance": ev.values,
                       "critic_grad_norm_attention": attn.values, "critic_grad_norm_moe": moe.values,
                       "eval_points": [c.eval_points for c in cs], "reward": [c.reward for c in cs],
                       "grad_norm_attention_per_step": [c.series["critic/grad_norm/attention"] for c in cs],
                       "grad_norm_moe_per_step": [c.series["critic/grad_norm/moe"] for c in cs]}

    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    ax = axes[0]
    labels = list(groups)
    for i, label in enumerate(labels):
        vals = [c.final_eval() for c in groups[label]]
        ax.bar(i, sum(vals) / len(vals) if vals else 0, alpha=0.5)
        ax.scatter([i] * len(vals), vals, color="k", s=10, zorder=3)
    ax.axhline(sft["accuracy"], color="gray", linestyle="--", linewidth=1, label="SFT start")
    finals = [c.final_eval() for cs in groups.values() for c in cs if not math.isnan(c.final_eval())]
    if finals:  # zoom on the data: a bar axis from 0 would hide differences of a few points
        ax.set_ylim(max(0.0, min(finals + [sft["accuracy"]]) - 0.05), min(1.0, max(finals) + 0.05))
    ax.set_xticks(range(len(labels)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("final eval accuracy")
    ax.set_title("final eval (bar: mean, dots: seeds)")
    ax.legend(fontsize=7)
    band_plot(axes[1], {k: ([[p[0] for p in c.eval_points] for c in cs], [[p[2] for p in c.eval_points] for c in cs])
                        for k, cs in groups.items()}, "trajectories consumed", "eval accuracy", "eval vs trajectories",
              sft["accuracy"], "SFT start")
    gn = {}
    for label in ("sao", "attention_trained"):
        for key, part in (("critic/grad_norm/attention", "attention"), ("critic/grad_norm/moe", "MoE")):
            cs = groups.get(label, [])
            gn[f"{label}: {part}"] = ([c.steps for c in cs], [c.series[key] for c in cs])
    band_plot(axes[2], gn, "trainer step", "critic grad norm (before clipping)", "critic gradient: attention vs MoE")
    axes[2].set_yscale("symlog", linthresh=1e-3)
    png = save_fig(fig, s.out / "ablations.png")

    md = header("SAO ablations (toy multi-turn calculator)", s.command, s.seeds, s.elapsed_s,
                f"- budget: {b.trajectories} trajectories per run, eval on {b.eval_size} held-out tasks; SFT start "
                f"accuracy {sft['accuracy']:.3f}; every variant changes one setting of the SAO reference")
    md += md_table(["variant", "change", "seeds", "final eval: mean ± std (per seed)", "Δ vs sao, paired by seed",
                    "train reward, last quarter", "critic EV, last quarter", "critic |g| attention (mean)",
                    "critic |g| MoE (mean)"], rows)
    md += ("\n\nCritic gradient norms are of the reduced gradient before clipping, averaged over all steps; with "
           "frozen attention (the reference) the attention gradient is 0 by construction, so the "
           "`attention_trained` row is the one that shows how large it would be.\n\n"
           f"![ablations]({png})\n")
    code = finish(s, md, results, start.rl_overrides(b.eval_size), {"sft": sft, "budget": vars(b), "variants": data})
    return code
