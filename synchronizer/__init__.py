"""ddiloco.synchronizer: the server learners post updates to and download merges from.

Who owns which state:
- service.py `Synchronizer`: the job as a whole: the layout and model spec, the fragments this
  shard owns, the learners, the rounds, the budget, evaluations, checkpoints, metrics; the
  calls routes and the upload port make (join, heartbeat, submit, merge, status).
- fragment.py `Fragment`: one fragment: Theta, outer momentum and version, its open round and
  the round's running sum (stream.py), its pending log and merge journal (storage/), its served
  copy (served_versions.py, served_buffers.py), its locks (locks.py).
- learners.py `Learners`: every learner slot's record, the job's totals (ledger.py, the rules
  of a record; storage/ledgerdb.py keeps them).
- storage/: every file on disk, versioned (docs/storage.md); replay.py redoes journaled merges.

The method: admission.py (the guards an update passes), rounds.py (quorum and grace),
merge.py, stream.py and outer.py (the fast merge), reference_merge.py (the same merge written
as the paper's equations), budget.py, spares.py. Serving: app.py and routes.py (HTTP API),
upload_port.py (bodies both ways without Python copies), server.py (`ddiloco synchronizer`),
shards.py (S processes). Performance parts: update_passes.py, parallel_passes.py, buffers.py,
prefault.py, config.py `TuningSettings`. What both sides speak is ddiloco.wire.
"""

# This folder is importable only as `ddiloco.synchronizer`. Run from the repository root, the
# current directory is on sys.path, and a bare `import synchronizer` would otherwise load this
# folder as a top-level package (for `operator`, shadowing the standard library's).
if __name__ != "ddiloco.synchronizer":
    raise ImportError(f"import this package as ddiloco.synchronizer, not {__name__!r}")
