"""Storage: how the package writes files, below both `export` and `training`.

``atomic`` (write beside, fsync, rename; digests), ``space`` (free space before a write, and the
`StorageError` a failed write raises), ``temps`` (the package's own temporary names and their
clean-up). Every file the package writes goes through these, whichever stage writes it.
"""
