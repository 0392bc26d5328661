# Import hypothesis while the interpreter is in a clean state: on CPython 3.11.7 its lazy import at
# pytest's terminal summary (after tests that ran threads) can hit "SystemError: AST constructor
# recursion depth mismatch" (CPython gh-106905) while pytest rewrites its modules.
import hypothesis  # noqa: F401
