"""One module per third-party library whose internals (private names, monkeypatches, the
behaviour of a dependency of a dependency) this service relies on.

Each adapter names the assumptions it makes in its docstring, the library is capped in
pyproject.toml at the versions they were checked on, and tests/unit/adapters/ fails with a
sentence naming the assumption when an upgrade breaks one.
"""
