"""ddiloco.simulator: see the module docstrings inside."""

# This folder is importable only as `ddiloco.simulator`. Run from the repository root, the
# current directory is on sys.path, and a bare `import simulator` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.simulator":
    raise ImportError(f"import this package as ddiloco.simulator, not {__name__!r}")
