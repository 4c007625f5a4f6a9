"""Checkpoint files of an ORT fit: what is written and read, and how.

``methods`` (the module's checkpoint methods and hooks), ``connector`` (what a module writes into
and reads from a Lightning ``.ckpt``, given what it works on), ``files`` (ORT checkpoint files and
the ORT state inside ``.ckpt`` files), ``io`` (atomic ``.ckpt`` writes), ``travel`` (a ``.ckpt``
that names its artifacts), ``trust`` (nothing named in a checkpoint runs as code), ``callback``
(`ORTCheckpoint`, Lightning's ``ModelCheckpoint`` writing ORT files).
"""
