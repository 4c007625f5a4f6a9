"""The ORT session of a module and the torch views of its memory.

``live`` (`LiveSession`: the running session, built once and changed only by its ``replace``),
``session_views`` (one build: the session, the torch views of its memory, the batch binders),
``evaluation`` (the eval graph's hooks: forward, validate, test, predict), ``parameters``
(parameters and gradients as views of ORT memory), ``step`` (one optimizer step, read top to
bottom), ``finite`` (are the trained parameters still finite).
"""
