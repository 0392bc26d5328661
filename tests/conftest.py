import os

# Import hypothesis while the interpreter is in a clean state: on CPython 3.11.7 its lazy import at
# pytest's terminal summary (after tests that ran threads) can hit "SystemError: AST constructor
# recursion depth mismatch" (CPython gh-106905) while pytest rewrites its modules.
import hypothesis  # noqa: F401
import pytest

from tests.paths import REPO

# The collective-device rule (docs/architecture.md): every process this suite starts - engine
# workers, torchrun'd trainers, `sao` subprocesses - inherits this, and init_parallel then installs
# megatron_sao.distributed.collective_guard, which fails any collective a GPU job's NCCL would refuse.
os.environ.setdefault("SAO_COLLECTIVE_GUARD", "1")

# Every process this suite starts imports this checkout: the repository root first on its PYTHONPATH
# (pytest.ini's `pythonpath` covers only this process). Workers run as modules of the tests package
# (`torchrun ... -m tests.integration.megatron.workers.engine_single`), `sao` and vLLM servers import
# megatron_sao from here, not from wherever the venv's editable install points.
_paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
if _paths[:1] != [str(REPO)]:
    os.environ["PYTHONPATH"] = os.pathsep.join([str(REPO), *_paths])


@pytest.fixture(autouse=True)
def _environment_restored():
    """Whatever a test sets in os.environ (an in-process `sao bench` sets VLLM_CPU_KVCACHE_SPACE for
    its runs) is undone after it: every process a later test starts inherits this environment, and a
    1 GiB vllm-cpu KV cache there overrode gpu-check's 32 MiB."""
    before = dict(os.environ)
    yield
    if dict(os.environ) != before:
        os.environ.clear()
        os.environ.update(before)
