"""Developer scripts of the project (run as ``python -m tools.<name>``)."""
