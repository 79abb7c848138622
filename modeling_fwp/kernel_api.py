"""The fast-weight kernels that the model code calls.

Model modules import kernels only through this shim, never from ``fwp_kernels`` directly: ``save_pretrained``
writes a flat copy of the pure-PyTorch ``fwp_kernels`` package into the saved folder (its ``__init__`` as
``fwp_kernels.py``, next to ``dispatch.py``, ``recurrent.py``, ...), so that the folder loads with
``trust_remote_code=True`` in an environment where the package is not installed.

Resolution order: the copy that sits next to this file (inside a saved folder: the exact kernels the checkpoint
was written with), else the installed ``fwp_kernels`` (inside the ``modeling_fwp`` package). Accelerated kernels
(Triton, C++) are optional imports inside ``fwp_kernels`` itself.
"""
try:
    from .fwp_kernels import *  # noqa: F401,F403
    from .fwp_kernels import __all__  # noqa: F401
except ModuleNotFoundError as error:
    if error.name != f"{__package__}.fwp_kernels":
        raise
    from fwp_kernels import *  # noqa: F401,F403
    from fwp_kernels import __all__  # noqa: F401
