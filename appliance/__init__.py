"""appliance: offline on-prem training and edge deployment in one verified bundle."""

__version__ = "0.1.0"


def beside_venv(name: str, env: str | None = None) -> list:
    """Where the install keeps `name` next to the running venv (PREFIX/releases/REL/name: weights/,
    tuning/, wheelhouse/...), after $env when that is set: the directories to search, in order."""
    import os
    import sys
    from pathlib import Path

    first = [Path(os.environ[env])] if env and os.environ.get(env) else []
    return first + [Path(sys.prefix).parent / name]
