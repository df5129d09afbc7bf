"""Storage of the synchronizer: everything it keeps on disk."""
