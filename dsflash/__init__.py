"""dsflash: DeepSeek-V4.1-Flash from a PyTorch reference to ONNX / TensorRT and an embeddable runtime.

The subpackages live in top-level folders mapped by setuptools `package-dir`:
`dsflash.model` (model/), `dsflash.export` (export/), `dsflash.plugins` (plugins/),
`dsflash.runtime` (runtime/).
"""

__version__ = "0.1.0"
