"""ONNX Runtime, in one place: the only package of ort-lightning that imports ``onnxruntime``.

`runtime` holds the training API (sessions, artifact generation, checkpoint files, DLPack
types); `limits` what ONNX Runtime 1.19.2 reads (IR version, opset) without importing it.
"""
