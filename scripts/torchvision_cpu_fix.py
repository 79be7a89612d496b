"""Development and CI only: let PyPI's torchvision 0.28.0 (a CUDA build) import under CPU torch.

That torchvision registers fake kernels for its C++ operators at import time, and under the CPU
build of torch those operators were never defined, so `import torchvision` fails with
"operator torchvision::nms does not exist" (vLLM's LLaVA path imports it). This module is put
into the test virtualenv by scripts/setup.sh together with a .pth file that imports it at
interpreter start. It only installs an import hook: just before torchvision is first imported,
the missing operator schemas are defined (no kernels: nothing here calls them). Nothing is
imported, and nothing changes, until then; a torchvision that brings its own operators is left
alone.
"""

from __future__ import annotations

import importlib.abc
import sys
from typing import Any

_SCHEMAS = {
    "nms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms": "(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                 "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "_roi_align_backward": "(Tensor grad, Tensor rois, float spatial_scale, SymInt pooled_height, "
                           "SymInt pooled_width, SymInt batch_size, SymInt channels, SymInt height, "
                           "SymInt width, int sampling_ratio, bool aligned) -> Tensor",
    "qroi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                  "SymInt pooled_width, int sampling_ratio, bool aligned) -> Tensor",
    "ps_roi_align": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                    "SymInt pooled_width, int sampling_ratio) -> (Tensor, Tensor)",
    "_ps_roi_align_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, "
                              "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                              "int sampling_ratio, SymInt batch_size, SymInt channels, "
                              "SymInt height, SymInt width) -> Tensor",
    "roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                "SymInt pooled_width) -> (Tensor, Tensor)",
    "_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor argmax, float spatial_scale, "
                          "SymInt pooled_height, SymInt pooled_width, SymInt batch_size, "
                          "SymInt channels, SymInt height, SymInt width) -> Tensor",
    "ps_roi_pool": "(Tensor input, Tensor rois, float spatial_scale, SymInt pooled_height, "
                   "SymInt pooled_width) -> (Tensor, Tensor)",
    "_ps_roi_pool_backward": "(Tensor grad, Tensor rois, Tensor channel_mapping, "
                             "float spatial_scale, SymInt pooled_height, SymInt pooled_width, "
                             "SymInt batch_size, SymInt channels, SymInt height, SymInt width) "
                             "-> Tensor",
    "deform_conv2d": "(Tensor input, Tensor weight, Tensor offset, Tensor mask, Tensor bias, "
                     "SymInt stride_h, SymInt stride_w, SymInt pad_h, SymInt pad_w, "
                     "SymInt dilation_h, SymInt dilation_w, SymInt groups, SymInt offset_groups, "
                     "bool use_mask) -> Tensor",
    "_deform_conv2d_backward": "(Tensor grad, Tensor input, Tensor weight, Tensor offset, "
                               "Tensor mask, Tensor bias, SymInt stride_h, SymInt stride_w, "
                               "SymInt pad_h, SymInt pad_w, SymInt dilation_h, SymInt dilation_w, "
                               "SymInt groups, SymInt offset_groups, bool use_mask) "
                               "-> (Tensor, Tensor, Tensor, Tensor, Tensor)",
}
_library: Any = None


def define_missing_operators() -> None:
    """Define torchvision's operator schemas that the CPU build of torch lacks."""
    global _library
    import torch

    missing = [name for name in _SCHEMAS
               if not torch._C._dispatch_has_kernel(f"torchvision::{name}")
               and not _schema_exists(torch, name)]
    if not missing:
        return
    _library = torch.library.Library("torchvision", "FRAGMENT")
    for name in missing:
        _library.define(name + _SCHEMAS[name])


def _schema_exists(torch: Any, name: str) -> bool:
    try:
        torch._C._get_schema(f"torchvision::{name}", "")
    except RuntimeError:
        return False
    return True


class _BeforeTorchvision(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Any, target: Any = None) -> None:
        if fullname == "torchvision":
            sys.meta_path.remove(self)
            define_missing_operators()
        return None  # the normal import goes on


def install() -> None:
    if "torchvision" not in sys.modules and not any(
            isinstance(f, _BeforeTorchvision) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeTorchvision())
