"""Storage of the synchronizer: every file it keeps in its state directory. docs/storage.md
describes each file, its format and its version, what a crash leaves and what a restart reads.

Storage keeps bytes and reads them back; it does not know the merge. The interface, per
fragment p (the shape of a write-ahead log beside a backend):

    store = StateStore(root)                     # state.py: one per state directory
    log = store.pending(p)                       # segments.py: the pending log
    ticket = log.reserve(len(body))              # append an accepted update: its place, in
    log.fill(ticket, body, record_header(body))  #   order, then its bytes,
    log.sync(ticket)                             # durable on return (group commit)
    taken = log.seal()                           # a merge takes every record so far
    journal = MergeJournal(root, p)              # journal.py
    journal.append(MergeRecord(...))             # record a merge: durable on return
    store.save_fragment(p, state)                # the fragment's state, whole (state.py)
    journal.compact(version); log.drop(taken)    # compact: what the file now holds goes
    back = read_back(store, p)                   # statedir.py, at restart: the file's state,
                                                 #   the merge records, the logged updates,
                                                 #   each in the order written
    held = open_state_dir(root)                  # statedir.py, the process's: the lock,
                                                 #   stale .tmp files gone, formats checked

Redoing the merges `read_back` returns is the synchronizer's (replay.py). Modules:
records.py (the record files' format, the format version, the JSON files' envelope),
pending.py (one log segment), segments.py (a fragment's segments), journalfile.py and
journal.py (the merge journal), state.py (the whole files: layout, model, fragment files),
ledgerdb.py (the learner ledger in SQLite), snapshots.py (the background fragment writer),
direct_io.py (O_DIRECT whole-file writes), statedir.py (the directory as a whole).
"""
