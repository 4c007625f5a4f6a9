"""What ONNX Runtime 1.19.2 reads: the newest ONNX IR version and ai.onnx opset.

No ONNX Runtime import here (onnx only): the exporter and the folder checks read these without loading ORT.

Example::

    >>> import onnx
    >>> model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [], []))
    >>> model.ir_version = 11
    >>> lower_ir_version(model), model.ir_version
    (True, 10)
"""

from __future__ import annotations

import onnx

__all__ = ["MAX_IR_VERSION", "MAX_OPSET", "lower_ir_version"]

#: The newest ONNX IR version and ai.onnx opset that ONNX Runtime 1.19.2 loads.
MAX_IR_VERSION = 10
MAX_OPSET = 21


def lower_ir_version(proto: onnx.ModelProto) -> bool:
    """Stamp IR version `MAX_IR_VERSION` on a model that claims a newer one; True if changed.

    Newer onnx packages stamp IR 11+ on everything they write, even graphs that use nothing
    newer than IR 10, and ORT 1.19.2 refuses those files.
    """
    if proto.ir_version <= MAX_IR_VERSION:
        return False
    proto.ir_version = MAX_IR_VERSION
    return True
