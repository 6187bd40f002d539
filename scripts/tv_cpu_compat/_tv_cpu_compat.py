"""Let a CUDA torchvision wheel import beside a CPU-only torch.

PyPI's torchvision wheels are CUDA builds; their C extension (_C.so) needs
libtorch_cuda.so, so it fails to load next to torch+cpu and
torchvision.extension._has_ops() is False. torchvision still imports its
pure-Python parts (transforms, transforms.v2.functional, io), except that
torchvision/_meta_registrations.py calls torch.library.register_fake() for
"torchvision::nms" and "torchvision::qnms" without checking _has_ops(), which
raises "operator torchvision::nms does not exist".

This hook runs just before torchvision._meta_registrations is executed and,
only when the C extension did not load, defines those two operator schemas
(no kernels) so the import succeeds. Calling nms would raise, as it should.
Loaded by _tv_cpu_compat.pth; it imports nothing until torchvision is imported.
"""
import importlib.abc
import sys

_TARGET = "torchvision._meta_registrations"
_LIB = None


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname != _TARGET:
            return None
        global _LIB
        sys.meta_path.remove(self)
        try:
            import torch
            import torchvision.extension as ext

            if not ext._has_ops() and _LIB is None:
                _LIB = torch.library.Library("torchvision", "DEF")
                _LIB.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
                _LIB.define("qnms(Tensor qdets, Tensor scores, float iou_threshold) -> Tensor")
        except Exception:  # never break the import because of this hook
            pass
        return None  # let the normal finders load the module


sys.meta_path.insert(0, _Finder())
