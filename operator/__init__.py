"""ddiloco.operator: the Kubernetes operator (see the module docstrings inside)."""

# This folder is meant to be imported only as `ddiloco.operator`. When the repository root
# is on sys.path (python -c / -m run from the root) a *fresh* `import operator` finds this
# folder before the standard library; torch._dynamo does exactly that
# (import_fresh_module("operator")). Then this file stands in for the standard library's
# operator module: it runs the stdlib's own source in its place, so `operator` always
# means the standard library, whatever the working directory.
if __name__ != "ddiloco.operator":
    import os as _os
    import sysconfig as _sysconfig

    _stdlib = _os.path.join(_sysconfig.get_path("stdlib"), "operator.py")
    with open(_stdlib, encoding="utf-8") as _f:
        __file__ = _stdlib
        exec(compile(_f.read(), _stdlib, "exec"))
    del _os, _sysconfig, _stdlib, _f
