"""Export-time verification: one training step of new artifacts in a child process vs torch autograd.

``verifier`` runs it, ``child`` is the child process, ``reference`` the torch side, ``compare``
the tolerances and messages.
"""

from ort_lightning.export.verify.verifier import verify_export

__all__ = ["verify_export"]
