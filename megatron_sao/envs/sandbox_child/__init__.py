"""Child-side pieces of the Python sandbox (run inside the sandbox before the untrusted code).

Standard library only and no imports between these modules: `sandbox_bootstrap.py` loads them in
the child as top-level modules (the package itself is not importable there), the parent and the
tests import them through the package.
"""
