"""Developer scripts of the repository, run as ``python -m tools.<name>`` (not part of the installed package)."""
