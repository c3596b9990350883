"""Shims: one module per third-party library whose internals (private names, monkeypatches, the
behaviour of a dependency of a dependency) this service relies on.

Each shim names the assumptions it makes in its docstring, the library is capped in
pyproject.toml at the versions they were checked on, and tests/unit/shims/ fails with a
sentence naming the assumption when an upgrade breaks one. ("Adapter" in this service means a
LoRA adapter only.)
"""
