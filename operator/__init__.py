"""ddiloco.operator: see the module docstrings inside."""

# This folder is importable only as `ddiloco.operator`. Run from the repository root, the
# current directory is on sys.path, and a bare `import operator` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.operator":
    raise ImportError(f"import this package as ddiloco.operator, not {__name__!r}")
