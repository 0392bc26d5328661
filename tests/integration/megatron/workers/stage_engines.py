"""Run one `sao` stage (the real CLI) and record every MegatronEngine it builds.

Usage: python -m tests.integration.megatron.workers.stage_engines RECORD.jsonl STAGE CONFIG [overrides ...]

The engine's constructor is wrapped (after it ran) to append, per engine, what its built
TransformerConfig and parameters say: recompute settings, params dtype, the attention kernel, the
dtypes of the model parameters and of the optimizer's main parameters; for a critic also its value
head (fresh or loaded, its largest weight, the LR of its param group against an MLP weight's). A
`set_value_head_bias` call appends the bias it left in the model and in the optimizer's main copy.
"""

from __future__ import annotations

import json
import sys

from megatron_sao.megatron import engine as E
from megatron_sao.megatron.optimizer import model_main_param_pairs, sub_optimizers

RECORD = sys.argv[1]
_init = E.MegatronEngine.__init__


def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    c = self.config
    pairs = [pair for opt in sub_optimizers(self.optimizer) for pair in model_main_param_pairs(opt)]
    row = {"role": self.role, "recompute_granularity": c.recompute_granularity,
           "recompute_method": c.recompute_method, "recompute_num_layers": c.recompute_num_layers,
           "params_dtype": str(c.params_dtype), "bf16": c.bf16, "attention_backend": c.attention_backend.name,
           "model_param_dtypes": sorted({str(p.dtype) for p in self.module.parameters()}),
           "main_param_dtypes": sorted({str(main.dtype) for _, main in pairs})}
    with open(RECORD, "a") as f:
        f.write(json.dumps(row) + "\n")


def _param(engine, name):
    return next(p for p in engine.module.parameters() if engine._param_names.get(id(p)) == name)


def _lr_of(engine, name) -> float:
    """The LR of the optimizer param group that holds the named parameter (its main copy)."""
    target = _param(engine, name)
    for opt in sub_optimizers(engine.optimizer):
        mains = {id(model): main for model, main in model_main_param_pairs(opt)}
        for group in opt.optimizer.param_groups:
            if any(p is mains.get(id(target)) for p in group["params"]):
                return group["lr"]
    raise KeyError(name)


def _recording_init_with_head(self, *args, **kwargs):
    _recording_init(self, *args, **kwargs)
    if self.role == "critic":
        row = {"role": "critic_head", "fresh_value_head": self.fresh_value_head,
               "head_weight_absmax": float(_param(self, "value_head.weight").abs().max()),
               "head_lr": _lr_of(self, "value_head.weight"), "bias_lr": _lr_of(self, "value_head.bias"),
               "mlp_lr": _lr_of(self, next(self._param_names[id(p)] for p in self.module.parameters()
                                           if p.requires_grad and "linear_fc1" in self._param_names[id(p)]))}
        with open(RECORD, "a") as f:
            f.write(json.dumps(row) + "\n")


_set_bias = E.MegatronEngine.set_value_head_bias


def _recording_set_bias(self, value):
    _set_bias(self, value)
    bias = _param(self, "value_head.bias")
    mains = [float(main) for opt in sub_optimizers(self.optimizer) for model, main in model_main_param_pairs(opt)
             if model is bias]
    with open(RECORD, "a") as f:
        f.write(json.dumps({"role": "bias_set", "value": value, "model": float(bias), "main": mains}) + "\n")


E.MegatronEngine.__init__ = _recording_init_with_head
E.MegatronEngine.set_value_head_bias = _recording_set_bias

from megatron_sao.cli import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
