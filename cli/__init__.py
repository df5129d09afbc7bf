"""ddiloco.cli: see the module docstrings inside."""

# This folder is importable only as `ddiloco.cli`. Run from the repository root, the
# current directory is on sys.path, and a bare `import cli` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.cli":
    raise ImportError(f"import this package as ddiloco.cli, not {__name__!r}")
