"""ONNX Runtime, in one place: the only package of ort-lightning that imports ``onnxruntime``.

`runtime` holds the training API (sessions, artifact generation, checkpoint files, DLPack
types); `limits` what ONNX Runtime 1.19.2 reads (IR version, opset) and `graph_files` how its graph
files are read and which inputs it adds, both without importing it.
"""
