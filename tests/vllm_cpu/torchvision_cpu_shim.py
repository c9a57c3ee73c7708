"""Lets the registry's CUDA-only torchvision wheel import on CPU torch: the vLLM CPU test environment only.

At import, ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and
``torchvision::qnms`` whatever happens to its C++ extension. A CUDA build of the extension does not load on
CPU torch, so the two operators do not exist and ``import torchvision`` fails, and with it transformers'
torchvision-backed processors and vLLM's Qwen-VL model module. This hook defines the two operator schemas
(the extension's own signatures; no kernel, nothing here calls them) just before torchvision is first
imported. ``install.py`` puts it in the venv as a ``.pth`` hook so that it runs in every Python process of
that venv (vLLM inspects a model in a subprocess); until something imports torchvision it does nothing.
CPU users outside this test environment install torchvision's CPU build instead and need none of this.
"""

import importlib.abc
import sys

_SCHEMAS = ("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
            "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
_LIBRARY = []  # keeps the torch.library.Library alive (dropping it would undefine the operators)


def _cuda_build_on_cpu_torch(spec) -> bool:
    """Is the torchvision about to be imported a CUDA build while torch is a CPU build? (read, not imported)"""
    import re
    from pathlib import Path

    import torch

    version_py = Path(spec.origin).with_name("version.py")
    match = re.search(r"^__version__ = '[^']*\+cu\d+'", version_py.read_text(), re.M) if version_py.is_file() else None
    return match is not None and torch.version.cuda is None


def define_schemas() -> None:
    import torch

    lib = torch.library.Library("torchvision", "FRAGMENT")
    for schema in _SCHEMAS:
        lib.define(schema)
    _LIBRARY.append(lib)


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torchvision":
            sys.meta_path.remove(self)
            import importlib.util

            spec = importlib.util.find_spec(name)
            if spec is not None and spec.origin and _cuda_build_on_cpu_torch(spec):
                define_schemas()
        return None  # the normal finders import it


if not any(isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
    sys.meta_path.insert(0, _BeforeTorchvision())
