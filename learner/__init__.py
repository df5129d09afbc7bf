"""ddiloco.learner: see the module docstrings inside."""

# This folder is importable only as `ddiloco.learner`. Run from the repository root, the
# current directory is on sys.path, and a bare `import learner` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.learner":
    raise ImportError(f"import this package as ddiloco.learner, not {__name__!r}")
