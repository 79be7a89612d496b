"""The plugin's one door to vLLM: every module, class, function and variable of the vllm
package the plugin uses is imported or named here, and nowhere else in shmstore/vllm/
(tests/vllm/test_vllm_door.py checks). A change of vLLM's API is a change of this module
(and, for what the plugin reads of vLLM's configuration, of _deployment.py).

What the plugin takes from vLLM (0.32; 0.33 is the same in these places):

    cache classes      BaseMultiModalProcessorCache (API process), BaseMultiModalReceiverCache
                       (workers), MultiModalCacheMissError, CacheInfo
    item classes       MultiModalKwargsItem, MultiModalFieldElem, MultiModalFieldConfig and
                       the flat, shared and batched fields
    cache factories    processor_cache_from_config, worker_receiver_cache_from_config and
                       _get_cache_type, re-bound in every module that imported them
    request hooks      HOOK_POINTS: the methods whose calls tell the ledger a request's story,
                       and the multimodal processor's steps around the cache
    prompt updates     ResolvedPromptUpdate, PromptUpdateDetails, PromptIndexTargets,
                       UpdateMode, and the code of the closures their factories make
    images             ImageMediaIO.load_bytes (made lazy for JPEGs), MediaWithBytes,
                       open_image; MultiModalHasher for the request's processor kwargs;
                       0.33's per-request decoded_budget (charge_decoded)
    environment        VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME (the segment's name, vLLM's own)
    workers            the world group's local rank
    command line       vLLM's own `vllm` command and its `serve` parser (for `shmstore serve`)
    object shapes      SHAPES: every attribute the plugin reads or sets on a vLLM object, read
                       here by the accessors below (requests, scheduler output, processor
                       inputs, data items) or by _items.py (an item's fields and elements);
                       tests/vllm/test_vllm_door.py checks that no other module reads one and
                       that this vLLM has each

A change of vLLM's cache signatures touches this module and the cache that overrides the
method (_sender.py or _receiver.py); a change of an item's shape, this module and _items.py.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import importlib
import logging
import sys
from collections.abc import Callable
from typing import Any

from vllm.multimodal.cache import factories
from vllm.multimodal.cache.base import (
    BaseMultiModalProcessorCache,
    BaseMultiModalReceiverCache,
    MultiModalCacheMissError,
)
from vllm.multimodal.hasher import MultiModalHasher
from vllm.multimodal.image import open_image
from vllm.multimodal.inputs import (
    MultiModalBatchedField,
    MultiModalFieldConfig,
    MultiModalFieldElem,
    MultiModalFlatField,
    MultiModalKwargsItem,
    MultiModalSharedField,
)
from vllm.multimodal.media.base import MediaWithBytes
from vllm.multimodal.media.image import ImageMediaIO
from vllm.multimodal.processing.processor import (
    PromptIndexTargets,
    PromptUpdateDetails,
    ResolvedPromptUpdate,
    UpdateMode,
)
from vllm.utils.cache import CacheInfo

from ._env import LOG_NAME

__all__ = ["BaseMultiModalProcessorCache", "BaseMultiModalReceiverCache",
           "MultiModalCacheMissError", "CacheInfo", "MultiModalKwargsItem", "MultiModalFieldElem",
           "MultiModalFieldConfig", "MultiModalFlatField", "MultiModalSharedField",
           "MultiModalBatchedField", "HOOK_POINTS", "buffer_name", "world_local_rank",
           "bind_cache_factories", "install_hooks", "ResolvedPromptUpdate",
           "PromptUpdateDetails", "PromptIndexTargets", "UpdateMode", "FACTORY_CODES",
           "records_supported", "vllm_version", "kwargs_digest", "MediaWithBytes",
           "open_image", "install_image_loader", "install_hash_memo", "max_image_pixels", "charge_decoded",
           "refused_on_arrival", "run_cli",
           "serve_parser", "SHAPES", "ITEM_SHAPES", "missing_shapes", "missing_hook_points", "request_id_of",
           "feature_data", "features_with_data", "new_requests", "resolve_new_request",
           "receiver_cache", "processor_inputs", "with_cache", "items_data", "renderer_cache",
           "request_hashes", "prompt_kwargs", "prompt_uuids", "build_processor", "load_image",
           "io_settings",
           "process_items"]

log = logging.getLogger(LOG_NAME)

# (module, class, method, hook): where each of _hooks.py's wrappers goes
HOOK_POINTS = (
    ("vllm.v1.engine.output_processor", "OutputProcessor", "add_request", "add_request"),
    # DP: the client picks the engine after rendering; only its workers owe the reads
    ("vllm.v1.engine.core_client", "DPAsyncMPClient", "get_core_engine_for_request",
     "engine_for_request"),
    ("vllm.v1.engine.core_client", "DPLBAsyncMPClient", "get_core_engine_for_request",
     "engine_for_request"),
    # the OpenAI server renders first: a request refused while rendering (a prompt over
    # max_model_len once its image tokens count) never reaches process_inputs
    ("vllm.renderers.base", "BaseRenderer", "render_chat_async", "render_async"),
    ("vllm.renderers.base", "BaseRenderer", "render_cmpl_async", "render_async"),
    ("vllm.renderers.base", "BaseRenderer", "_process_tokens_async", "process_tokens_async"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "_finish_request", "finish_request"),
    # 0.33: an engine's outputs say which requests it refused on arrival (a paused engine)
    ("vllm.v1.engine.output_processor", "OutputProcessor", "process_outputs", "process_outputs"),
    ("vllm.v1.engine.output_processor", "OutputProcessor", "abort_requests", "abort_requests"),
    ("vllm.v1.engine.input_processor", "InputProcessor", "process_inputs", "process_inputs"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase", "_apply_mm_cache", "apply_mm_cache"),
    # the processor: a request's kwargs for the records; lazy images decoded for the misses
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor",
     "_cached_apply_hf_processor", "cached_apply"),
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor",
     "_get_cache_missing_items", "missing_items"),
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor",
     "_apply_hf_processor", "uncached_apply"),
)
_hooked: dict[str, bool] = {}  # hook name -> its method was found and wrapped

# (module, class) -> the attributes the plugin reads or sets on its objects. ITEM_SHAPES are
# read by _items.py (an item's fields), the others only by the accessors below.
SHAPES: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.v1.engine", "EngineCoreRequest"): ("request_id", "mm_features"),
    ("vllm.multimodal.inputs", "MultiModalFeatureSpec"): ("data",),
    ("vllm.v1.engine.output_processor", "RequestState"): ("request_id",),
    ("vllm.v1.core.sched.output", "SchedulerOutput"): ("scheduled_new_reqs",),
    ("vllm.v1.core.sched.output", "NewRequestData"): ("req_id", "mm_features"),
    ("vllm.v1.worker.worker_base", "WorkerWrapperBase"): ("mm_receiver_cache",),
    ("vllm.multimodal.processing.inputs", "ProcessorInputs"): (
        "cache", "hf_processor_mm_kwargs", "mm_data_items"),
    ("vllm.multimodal.parse", "ModalityDataItems"): ("data",),
    # the miss pool's private calls: a request's item hashes, one item's cached processing
    ("vllm.multimodal.processing.processor", "BaseMultiModalProcessor"): (
        "_get_mm_hashes", "_cached_apply_hf_processor"),
    # an item's hash, kept on a lazy image for the second time a request asks
    ("vllm.multimodal.hasher", "MultiModalHasher"): ("hash_kwargs",),
}
ITEM_SHAPES: dict[tuple[str, str], tuple[str, ...]] = {
    ("vllm.multimodal.inputs", "MultiModalFieldElem"): ("data", "field"),
    ("vllm.multimodal.inputs", "MultiModalFlatField"): ("keep_on_cpu", "slices", "dim"),
    ("vllm.multimodal.inputs", "MultiModalSharedField"): ("keep_on_cpu", "batch_size"),
    ("vllm.multimodal.inputs", "MultiModalBatchedField"): ("keep_on_cpu",),
}


def missing_hook_points() -> list[str]:
    """The methods of HOOK_POINTS this vLLM lacks, as module.Class.method."""
    missing = []
    for module_name, class_name, method, _ in HOOK_POINTS:
        try:
            getattr(getattr(importlib.import_module(module_name), class_name), method)
        except (ImportError, AttributeError):
            missing.append(f"{module_name}.{class_name}.{method}")
    return missing


def missing_shapes() -> list[str]:
    """The attributes of SHAPES and ITEM_SHAPES this vLLM's classes lack (a dataclass's or
    msgspec struct's fields, a class attribute, or `self.NAME` set in the class's code)."""
    import inspect
    import re

    missing = []
    for (module, cls_name), attrs in {**SHAPES, **ITEM_SHAPES}.items():
        cls = getattr(importlib.import_module(module), cls_name)
        known = set(getattr(cls, "__struct_fields__", ()))
        if dataclasses.is_dataclass(cls):
            known |= {f.name for f in dataclasses.fields(cls)}
        for klass in cls.__mro__:
            known |= set(vars(klass)) | set(getattr(klass, "__annotations__", {}))
            try:
                source = inspect.getsource(klass)
            except (OSError, TypeError):
                continue
            known |= {a for a in attrs if re.search(rf"self\.{a}\s*(:[^=\n]*)?=", source)}
        missing += [f"{cls_name}.{a}" for a in attrs if a not in known]
    return missing


def request_id_of(request: Any) -> str:
    """An EngineCoreRequest's or a RequestState's id."""
    return str(request.request_id)


def refused_on_arrival(engine_core_outputs: Any) -> list[str]:
    """The ids of the requests an engine's outputs say it refused on arrival, having run
    nothing (vLLM 0.33's EngineCoreOutput.error; 0.32's outputs have none)."""
    return [str(out.request_id) for out in engine_core_outputs or ()
            if getattr(out, "error", None) is not None]


def feature_data(request: Any) -> list[Any]:
    """The data of an EngineCoreRequest's multimodal features (an item, or None)."""
    return [getattr(f, "data", None) for f in (getattr(request, "mm_features", None) or [])]


def features_with_data(mm_features: list[Any]) -> list[Any]:
    """The MultiModalFeatureSpecs among `mm_features` that carry their data."""
    return [f for f in mm_features if f.data is not None]


def new_requests(scheduler_output: Any) -> list[Any]:
    """The requests a SchedulerOutput schedules for the first time."""
    return list(scheduler_output.scheduled_new_reqs)


def resolve_new_request(req_data: Any, resolve: Callable[[str, list[Any]], list[Any]]) -> None:
    """Replace a NewRequestData's features by `resolve(request id, features)`."""
    req_data.mm_features = resolve(req_data.req_id, req_data.mm_features)


def receiver_cache(worker: Any) -> Any:
    """A WorkerWrapperBase's multimodal receiver cache (None if it has none)."""
    return getattr(worker, "mm_receiver_cache", None)


def processor_inputs(inputs: Any) -> tuple[Any, Any, Any]:
    """A ProcessorInputs' (cache, HF processor kwargs, data items), None where missing."""
    return (getattr(inputs, "cache", None), getattr(inputs, "hf_processor_mm_kwargs", None),
            getattr(inputs, "mm_data_items", None))


def with_cache(inputs: Any, cache: Any) -> Any:
    """A copy of a ProcessorInputs whose cache is `cache` (the original is left as it is)."""
    out = copy.copy(inputs)
    out.cache = cache
    return out


def items_data(modality_items: Any) -> Any:
    """The data of one modality's ModalityDataItems (a list of media), None if there are none."""
    return getattr(modality_items, "data", None)


# -- the miss pool (vllm/_accel/_pool.py) ---------------------------------------------------------

def renderer_cache(renderer: Any) -> Any:
    """A renderer's multimodal processor cache (None if it has none)."""
    return getattr(renderer, "mm_processor_cache", None)


def request_hashes(renderer: Any, prompt: Any) -> tuple[dict[str, list[str]], Any] | None:
    """A tokens prompt's item hashes and data items, as the renderer's _process_multimodal
    makes them for its processor (None: no multimodal data)."""
    from vllm.multimodal.parse import parse_mm_uuids
    from vllm.multimodal.processing.inputs import ProcessorInputs

    mm_data = prompt.get("multi_modal_data")
    if not mm_data:
        return None
    processor = renderer.get_mm_processor()
    items = processor.info.parse_mm_data(mm_data)
    inputs = ProcessorInputs(
        list(prompt.get("prompt_token_ids") or ()), items,
        parse_mm_uuids(prompt.get("multi_modal_uuids")),
        hf_processor_mm_kwargs=prompt.get("mm_processor_kwargs") or {},
        media_io_kwargs=prompt.get("media_io_kwargs") or {})
    return processor._get_mm_hashes(inputs), items


def prompt_uuids(prompt: Any, modality: str) -> list[Any]:
    """A tokens prompt's uuids of its `modality` items, one per item (None: unnamed), as vLLM
    parses them; [] where it gives none."""
    from vllm.multimodal.parse import parse_mm_uuids

    found = parse_mm_uuids(prompt.get("multi_modal_uuids"))
    named = found.get(modality) if isinstance(found, dict) else None
    return list(named) if isinstance(named, (list, tuple)) else []


def prompt_kwargs(prompt: Any) -> tuple[Any, Any]:
    """A tokens prompt's (mm_processor_kwargs, media_io_kwargs), {} where unset."""
    return prompt.get("mm_processor_kwargs") or {}, prompt.get("media_io_kwargs") or {}


def build_processor(model_config: Any) -> Any:
    """vLLM's multimodal processor of `model_config`, as its renderer builds it."""
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.utils.torch_utils import set_default_torch_num_threads

    with set_default_torch_num_threads():
        return MULTIMODAL_REGISTRY.create_processor(model_config)


def load_image(data: bytes, image_mode: str | None, io_kwargs: dict[str, Any]) -> Any:
    """vLLM's own load_bytes of an image (its decode, conversion and errors)."""
    load = ImageMediaIO.load_bytes
    load = getattr(load, "__wrapped__", load)  # never the lazy loader: the pixels are wanted
    return load(ImageMediaIO(image_mode=image_mode, **io_kwargs), data)


def io_settings(media_io: Any) -> tuple[str | None, dict[str, Any]]:
    """An ImageMediaIO's (image_mode, kwargs): what load_image needs to load alike."""
    return media_io.image_mode, dict(media_io.kwargs)


def process_items(processor: Any, media: list[Any], hf_kwargs: Any, media_io_kwargs: Any,
                  cache: Any) -> None:
    """Run the processor's cached path on `media` (images) with `cache`: each item processed
    is given to cache.get_and_update_item, as vLLM's own cache gets its missing items."""
    from vllm.multimodal.processing.context import TimingContext
    from vllm.multimodal.processing.inputs import ProcessorInputs
    from vllm.utils.torch_utils import set_default_torch_num_threads

    inputs = ProcessorInputs([], processor.info.parse_mm_data({"image": media}), None,
                             hf_processor_mm_kwargs=hf_kwargs, media_io_kwargs=media_io_kwargs,
                             cache=cache)
    with set_default_torch_num_threads():
        processor._cached_apply_hf_processor(inputs, TimingContext(enabled=False))
# the hooks without which images stay eager (a lazy image must be decoded by vLLM's own code)
IMAGE_HOOKS = ("cached_apply", "missing_items", "uncached_apply")

# the code objects of the closures vLLM's factories make: a resolved prompt update whose
# closures have these codes was made by these factories, and calling them again rebuilds it
FACTORY_CODES: dict[str, tuple[Any, ...]] = {
    name: tuple(f.__code__ for f in functions) for name, functions in {
        "start": (PromptIndexTargets.start().get_match_index,
                  PromptIndexTargets.start().get_text_match_index),
        "end": (PromptIndexTargets.end().get_match_index,
                PromptIndexTargets.end().get_text_match_index),
        "prefix": (PromptIndexTargets.prefix([0]).get_match_index,
                   PromptIndexTargets.prefix([0]).get_text_match_index),
        "select_token_id": (PromptUpdateDetails.select_token_id([0], 0).is_embed,),
        "select_token_ids": (PromptUpdateDetails.select_token_ids([0], [0]).is_embed,),
    }.items()}
_RECORD_FIELDS = (("modality", "item_idx", "mode", "target", "content"), ("full", "is_embed"))


_SUPPORTED = tuple(tuple(f.name for f in dataclasses.fields(cls))
                   for cls in (ResolvedPromptUpdate, PromptUpdateDetails)) == _RECORD_FIELDS


def records_supported() -> bool:
    """Whether this vLLM's resolved prompt updates have exactly the fields a record keeps."""
    return _SUPPORTED


DECODED_BYTES_PER_PIXEL = 4  # what vLLM 0.33's load_bytes charges per pixel, whatever the mode


def charge_decoded(media_io: Any, width: int, height: int) -> Any:
    """Charge an image's decoded size to `media_io`'s per-request budget as vLLM 0.33's
    load_bytes does before it decodes (width x height x 4, VLLM_MAX_MEDIA_REQUEST_DECODE_BYTES;
    its ValueError raised as it is), and return an ImageMediaIO that decodes the same way
    without charging again. vLLM 0.32 has no budget: `media_io` itself comes back."""
    budget = getattr(media_io, "decoded_budget", None)
    if budget is None:
        return media_io
    budget.charge(width * height * DECODED_BYTES_PER_PIXEL)
    uncharged = copy.copy(media_io)
    uncharged.decoded_budget = None
    return uncharged


def max_image_pixels() -> int:
    """VLLM_MAX_IMAGE_PIXELS, read as vLLM's load_bytes reads it (0: no limit)."""
    import vllm.envs as envs

    return int(envs.VLLM_MAX_IMAGE_PIXELS)


def run_cli(argv: list[str]) -> None:
    """vLLM's own command line, `vllm ARGV...`, in this process."""
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *argv]
    main()


def serve_parser() -> argparse.ArgumentParser:
    """The parser of `vllm serve`, as vLLM builds it."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser: argparse.ArgumentParser = ServeSubcommand().subparser_init(
        FlexibleArgumentParser(prog="vllm").add_subparsers())
    return parser


def vllm_version() -> str:
    import vllm

    return str(vllm.__version__)


def kwargs_digest(kwargs: Any) -> bytes:
    """A request's processor kwargs digested by vLLM's own hasher (the framing its item
    hashes use: any value it can hash, in the same way in every process)."""
    return bytes.fromhex(MultiModalHasher.hash_kwargs("blake3", kwargs=dict(kwargs)))


def install_image_loader(make: Callable[[Callable[..., Any]], Callable[..., Any]]) -> bool:
    """Replace ImageMediaIO.load_bytes with `make(vLLM's own load_bytes)`, once; False (and
    nothing replaced) where this vLLM lacks a hook that decodes a lazy image with vLLM's code
    before its processor runs."""
    wrapped = {hook for _, _, _, hook in HOOK_POINTS if _hooked.get(hook)}
    if not set(IMAGE_HOOKS) <= wrapped:
        log.warning("shmstore vLLM plugin: images are decoded eagerly (vLLM's processor "
                    "is not hooked at %s)",
                    ", ".join(sorted(set(IMAGE_HOOKS) - wrapped)))
        return False
    original = ImageMediaIO.load_bytes
    if not getattr(original, "_shmstore_hook", False):
        loader = make(original)
        loader._shmstore_hook = True  # type: ignore[attr-defined]
        ImageMediaIO.load_bytes = loader
    return True

def install_hash_memo(memo_of: Callable[[Any], dict[Any, str] | None]) -> None:
    """Replace MultiModalHasher.hash_kwargs, once, by one that answers a call hashing one item
    alone (the model's id and the item, no other factor) from `memo_of(item)` after the first
    (a dict kept on the item, whose bytes never change; None: not kept, hashed as vLLM does).
    The miss pool's sender hashes a request's items before vLLM's processor hashes them again."""
    original = MultiModalHasher.hash_kwargs.__func__
    if getattr(original, "_shmstore_hook", False):
        return

    def hash_kwargs(cls: Any, algorithm: Any, /, **kwargs: Any) -> str:
        if len(kwargs) == 2 and "model_id" in kwargs:
            ((name, item),) = ((k, v) for k, v in kwargs.items() if k != "model_id")
            memo = memo_of(item)
            if memo is not None:
                key = (algorithm, kwargs["model_id"], name)
                found = memo.get(key)
                if found is None:
                    found = memo[key] = original(cls, algorithm, **kwargs)
                return found
        return original(cls, algorithm, **kwargs)  # type: ignore[no-any-return]

    hash_kwargs._shmstore_hook = True  # type: ignore[attr-defined]
    hash_kwargs.__wrapped__ = original  # type: ignore[attr-defined]
    MultiModalHasher.hash_kwargs = classmethod(hash_kwargs)


# modules that import the cache factories by name: each gets the plugin's
FACTORY_IMPORTERS = ("vllm.multimodal.cache.factories", "vllm.multimodal.cache",
                     "vllm.renderers.base", "vllm.v1.worker.worker_base")


def buffer_name() -> str:
    """vLLM's name for the shared-memory segment: the variable if set, else a fresh name per
    process tree (vLLM sets it in the environment, so the processes it starts share it)."""
    import vllm.envs as envs

    return str(envs.VLLM_OBJECT_STORAGE_SHM_BUFFER_NAME)


def world_local_rank() -> int | None:
    """This worker's rank on its node from vLLM's world group; None before the group exists."""
    try:
        from vllm.distributed.parallel_state import get_world_group

        return int(get_world_group().local_rank)
    except (ImportError, AssertionError, AttributeError):
        return None


def bind_cache_factories(make_sender: Callable[[Any], Any],
                         make_receiver: Callable[[Any, Any], Any],
                         keeps_shm: Callable[[Any], bool]) -> None:
    """Make vLLM's `shm` cache type the plugin's: `make_sender(vllm_config)` in the API
    process, `make_receiver(vllm_config, lock)` in workers. Where vLLM would turn IPC caching
    off (several API servers, DP behind its internal load balancer), the type stays `shm`
    when `keeps_shm(vllm_config)` says so (the user asked for `shm`, and one store can serve
    the deployment). Idempotent."""
    original_sender = factories.processor_cache_from_config
    original_receiver = factories.worker_receiver_cache_from_config
    original_type = factories._get_cache_type

    def get_cache_type(vllm_config: Any) -> Any:
        cache_type = original_type(vllm_config)
        if cache_type == "processor_only" and keeps_shm(vllm_config):
            return "shm"
        return cache_type

    if not getattr(original_type, "_shmstore_hook", False):  # install() may run again
        get_cache_type._shmstore_hook = True  # type: ignore[attr-defined]
        factories._get_cache_type = get_cache_type

    def processor_cache_from_config(vllm_config: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return make_sender(vllm_config)
        return original_sender(vllm_config)

    def worker_receiver_cache_from_config(vllm_config: Any, shared_worker_lock: Any) -> Any:
        if factories._get_cache_type(vllm_config) == "shm":
            return make_receiver(vllm_config, shared_worker_lock)
        return original_receiver(vllm_config, shared_worker_lock)

    patches = {"processor_cache_from_config": processor_cache_from_config,
               "worker_receiver_cache_from_config": worker_receiver_cache_from_config}
    for module_name in FACTORY_IMPORTERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:  # another vLLM layout: say so, patch what exists
            log.warning("shmstore vLLM plugin: cannot import %s (%s)", module_name, exc)
            continue
        for attr, replacement in patches.items():
            if hasattr(module, attr):
                setattr(module, attr, replacement)


def install_hooks(wrappers: dict[str, Callable[[Any], Any]], missing: str) -> None:
    """Wrap each method of HOOK_POINTS with `wrappers[hook](original)` (once: a method
    wrapped already is left alone). A method this vLLM lacks is logged with `missing`."""
    for module_name, class_name, method, hook in HOOK_POINTS:
        try:
            cls = getattr(importlib.import_module(module_name), class_name)
            original = getattr(cls, method)
        except (ImportError, AttributeError) as exc:
            log.warning("shmstore vLLM plugin: no %s.%s.%s in this vLLM (%s); %s", module_name,
                        class_name, method, exc, missing)
            continue
        if not getattr(original, "_shmstore_hook", False):
            wrapped = wrappers[hook](original)
            wrapped._shmstore_hook = True
            setattr(cls, method, wrapped)
        _hooked[hook] = True
