"""The deployed model as ONNX: qdebug's own QDQ export, ONNX Runtime as a compare stage, and the
import of a model ONNX Runtime quantized.

- ``model_file``: reading an ONNX file safely (no external data, bounded sizes, checked);
- ``names``: which tensor of a torch-exported graph is which engine call (torch's scope names);
- ``export``: a calibrated/QAT/quantized model -> a QDQ ONNX model named by its quant points;
- ``parity``: ONNX Runtime on an exported model against the quantized stage, in LSB of the output scale;
- ``stage``: an ONNX model run by ONNX Runtime, tapped per layer, as a stage of ``compare``;
- ``session``: ONNX Runtime sessions, made one way (checked bytes, CPU, default optimizations);
- ``qdq_source``: an ORT-quantized QDQ model -> a ``SourceModel`` the interop builder imports;
- ``qdq_check``: that import held to the file: the layers ORT runs in float, the self-check;
- ``qdq_import``: the two together, ``import_qdq``: file -> engine model, checked.

``onnx`` and ``onnxruntime`` are optional (``pip install qdebug[onnx]``): they are imported only when
an ONNX file is read or written, and a missing one is one error with the install command.
"""
