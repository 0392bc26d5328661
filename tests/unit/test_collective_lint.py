"""Static half of the collective-device rule: every collective call site in megatron_sao/ names a device.

The runtime guard (megatron_sao/distributed/collective_guard.py) judges the collectives the suite
executes; this lint also covers the paths no CPU test reaches (pipeline-stage branches, multi-rank
value pre-training). Rules, per `dist.<collective>(...)` / `torch.distributed.<collective>(...)`:
  * object collectives that take `device=` pass it;
  * a tensor argument is not a torch factory call without `device=` (or `.cpu()`), nor a local
    name assigned from one in the same function.
"""

from __future__ import annotations

import ast

from tests.paths import REPO

PACKAGE = REPO / "megatron_sao"
TENSOR_COLLECTIVES = {"all_reduce", "broadcast", "reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
                      "reduce_scatter_tensor", "gather", "scatter", "all_to_all", "all_to_all_single", "send", "recv",
                      "isend", "irecv"}
DEVICE_OBJECT_COLLECTIVES = {"broadcast_object_list", "send_object_list", "recv_object_list"}
FACTORIES = {"tensor", "zeros", "ones", "empty", "full", "arange", "as_tensor", "from_numpy", "rand", "randn",
             "randint", "linspace", "eye"}
NOT_TENSORS = {"group", "op", "src", "dst", "async_op", "group_src", "group_dst", "tag"}


def _is_dist(node: ast.expr) -> bool:
    if isinstance(node, ast.Name):
        return node.id == "dist"
    return isinstance(node, ast.Attribute) and node.attr == "distributed" and isinstance(node.value, ast.Name) \
        and node.value.id == "torch"


def _host_made(node: ast.expr) -> bool:
    """A torch factory call without device=, or a .cpu() call."""
    if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute):
        return False
    f = node.func
    if f.attr == "cpu":
        return True
    if f.attr in FACTORIES and isinstance(f.value, ast.Name) and f.value.id == "torch":
        return not any(k.arg == "device" for k in node.keywords)
    # torch.tensor(...).float(), torch.zeros(...).reshape(...): the receiver decides
    return f.attr in {"float", "double", "long", "int", "reshape", "view", "contiguous", "sum", "max", "min"} \
        and _host_made(f.value)


def violations(source: str, filename: str = "<src>") -> list[str]:
    tree = ast.parse(source)
    out = []
    for fn in [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Module))]:
        assigned: dict[str, list[ast.expr]] = {}
        for n in ast.walk(fn):
            if isinstance(n, ast.Assign):
                for t in n.targets:
                    if isinstance(t, ast.Name):
                        assigned.setdefault(t.id, []).append(n.value)
        for call in ast.walk(fn):
            if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and _is_dist(call.func.value)):
                continue
            name, where = call.func.attr, f"{filename}:{call.lineno}"
            if name in DEVICE_OBJECT_COLLECTIVES and not any(k.arg == "device" for k in call.keywords):
                out.append(f"{where}: dist.{name}() without device=")
            if name not in TENSOR_COLLECTIVES:
                continue
            args = list(call.args) + [k.value for k in call.keywords if k.arg not in NOT_TENSORS]
            for a in args:
                sources = assigned.get(a.id, []) if isinstance(a, ast.Name) else [a]
                if any(_host_made(s) for s in sources):
                    out.append(f"{where}: dist.{name}() gets a tensor made on the host ({ast.unparse(a)})")
    return sorted(set(out))


def test_every_collective_call_site_in_the_package_names_its_device():
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += violations(path.read_text(), str(path.relative_to(PACKAGE.parent)))
    assert found == []


def test_the_lint_flags_the_call_sites_that_broke_on_nccl():
    """The four sites issue 10 found (before the fix), verbatim."""
    engine = '''
def train_step(self, metrics):
    bad = torch.tensor([0.0 if torch.isfinite(torch.tensor(metrics["loss"])) else 1.0])
    dist.all_reduce(bad, op=dist.ReduceOp.MAX)
'''
    freeze = '''
def check(report, group=None):
    counts = torch.tensor([report.matches_per_pattern[p] for p in patterns], dtype=torch.long)
    if torch.distributed.is_initialized():
        torch.distributed.all_reduce(counts, group=group)
'''
    optimizer = '''
def group_grad_norms(optimizer):
    for opt in sub_optimizers(optimizer):
        local = torch.zeros(len(names), dtype=torch.float64)
        dist.all_reduce(local, group=group)
'''
    loop = '''
class T:
    def _stop_agreed(self):
        flag = torch.tensor([1.0 if self._stop_requested else 0.0])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    def _broadcast(self, obj):
        dist.broadcast_object_list([obj], src=0)
'''
    assert len(violations(engine)) == 1 and len(violations(freeze)) == 1 and len(violations(optimizer)) == 1
    assert violations(loop) == ["<src>:5: dist.all_reduce() gets a tensor made on the host (flag)",
                                "<src>:7: dist.broadcast_object_list() without device="]


def test_the_lint_accepts_device_placed_tensors():
    ok = '''
def f(ctx, x):
    a = torch.tensor([1.0], device=ctx.device)
    dist.all_reduce(a)
    dist.all_reduce(torch.zeros(2).to(ctx.device))
    dist.all_reduce(x.sum().reshape(1))
    dist.broadcast_object_list([1], src=0, device=ctx.device)
'''
    assert violations(ok) == []
