"""ddiloco.local: see the module docstrings inside."""

# This folder is importable only as `ddiloco.local`. Run from the repository root, the
# current directory is on sys.path, and a bare `import local` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.local":
    raise ImportError(f"import this package as ddiloco.local, not {__name__!r}")
