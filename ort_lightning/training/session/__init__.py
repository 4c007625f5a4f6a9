"""The ORT session of a module and the torch views of its memory.

``session_views`` (build, rebuild, what pickles), ``parameters`` (parameters and gradients as
views of ORT memory), ``step`` (one optimizer step, read top to bottom), ``finite`` (are the
trained parameters still finite).
"""
