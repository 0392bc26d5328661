import os

# Import hypothesis while the interpreter is in a clean state: on CPython 3.11.7 its lazy import at
# pytest's terminal summary (after tests that ran threads) can hit "SystemError: AST constructor
# recursion depth mismatch" (CPython gh-106905) while pytest rewrites its modules.
import hypothesis  # noqa: F401

# The collective-device rule (docs/architecture.md): every process this suite starts - engine
# workers, torchrun'd trainers, `sao` subprocesses - inherits this, and init_parallel then installs
# megatron_sao.distributed.collective_guard, which fails any collective a GPU job's NCCL would refuse.
os.environ.setdefault("SAO_COLLECTIVE_GUARD", "1")
