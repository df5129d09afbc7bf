"""ddiloco.synchronizer: see the module docstrings inside."""

# This folder is importable only as `ddiloco.synchronizer`. Run from the repository root, the
# current directory is on sys.path, and a bare `import synchronizer` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.synchronizer":
    raise ImportError(f"import this package as ddiloco.synchronizer, not {__name__!r}")
