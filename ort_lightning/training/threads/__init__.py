"""The thread policy: ONNX Runtime's and torch's thread pools sharing the cores of a fit.

``policy`` (`ThreadPolicy`, the Lightning callback), ``trial`` (which candidate each batch
times, and which wins), ``cores`` (the cores a fit may use; the user's own torch threads).
"""
