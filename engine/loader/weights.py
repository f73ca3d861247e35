"""Build a model on the meta device and fill it from safetensors files (never pickle) or
a GGUF file (gguf_tensors.py), one tensor at a time - after every file's header has been
checked against the model (tensor_plan.py), so a checkpoint that does not fit is refused
before a weight is read."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from tokenmill.engine.loader.gguf_tensors import GGUFTensors, gguf_source
from tokenmill.engine.loader.model_files import weight_files
from tokenmill.engine.loader.safetensors_files import (
    TensorEntry,
    iter_tensors,
    map_tensors,
    read_header,
)
from tokenmill.engine.loader.tensor_plan import (
    Target,
    TensorSource,
    build_on_meta,
    plan_tensors,
    shard_dim,
    shard_sizes,
)
from tokenmill.engine.models import ModelConfig

# (model on the meta device, every checkpoint tensor) -> the tensors another reader takes:
# a quantized checkpoint's layers, swapped out of the model by the callable itself
# (quant/checkpoint/loading.py), which checks their headers and reads them later.
HoldOut = Callable[[nn.Module, list[TensorSource]], frozenset[str]]
# Called with (the model, a module's qualified name) the moment the last of that module's
# own parameters is complete, while the load goes on: the caller may replace those
# parameters or the module itself (a mixture of experts' layer packs its float stacks into
# the kernel's layout, a quantization mode swaps a linear layer for its own), so that the
# float copies of all layers are never alive at once (worker/build.py).
OnFilled = Callable[[nn.Module, str], None]


def load_model(
    model_dir: Path,
    config: ModelConfig,
    *,
    dtype: torch.dtype,
    device: torch.device,
    hold_out: HoldOut | None = None,
    on_filled: OnFilled | None = None,
) -> nn.Module:
    """Instantiate the architecture and load every parameter from the checkpoint (but the
    tensors `hold_out` takes for layers it swapped out), calling `on_filled` with the
    model and the name of each module whose own parameters are all filled (a tied
    lm_head is the embedding, never filled: it is not called with it).

    Raises:
        ValueError: before any weight is read - a tensor the model has no place for, a
            quantized (integer or fp8) weight, a parameter missing from the checkpoint,
            or a shape that does not fit (tensor_plan.plan_tensors).
    """
    # Built on the meta device and cast there, then given memory of the final dtype once:
    # nothing is initialised or allocated twice (every parameter is loaded below).
    model = build_on_meta(config, dtype)
    gguf_path = gguf_source(model_dir)
    if gguf_path is not None:
        gguf = GGUFTensors.open_dir(model_dir)
        return _load_gguf(model, gguf, config, device, hold_out, on_filled)
    headers = {path: read_header(path) for path in weight_files(model_dir)}
    sources = [TensorSource(e.name, e.dtype, e.shape) for h in headers.values() for e in h]
    if hold_out is not None:
        held = hold_out(model, sources)
        sources = [s for s in sources if s.name not in held]
    plan = plan_tensors(model, config, sources, where=str(model_dir))
    params = dict(model.named_parameters())
    in_place = {
        path: [e for e in entries if _usable_in_place(e, plan.targets.get(e.name), params, device)]
        for path, entries in headers.items()
    }
    del params  # a parameter the callback replaces must not stay referenced here
    filling = _Filling(model, plan.targets, on_filled)
    # The parameters the checkpoint fills get memory as their first tensor is read (those
    # that are the file's bytes get none of their own), so what `on_filled` frees is never
    # held beside the parameters still to come; the others (buffers, a held-out layer's
    # parameters) get it now.
    _materialize(model, device, skip={t.param for t in plan.targets.values()})
    for path, entries in in_place.items():
        file_tensors = map_tensors(path, entries)
        for name in list(file_tensors):  # popped: a stack the callback frees is unmapped
            _set_parameter(model, plan.targets[name].param, file_tensors.pop(name))
            filling.filled(plan.targets[name])
    for path, entries in headers.items():
        mapped = {e.name for e in in_place[path]}
        wanted = {e.name for e in entries if e.name in plan.targets and e.name not in mapped}
        for name, tensor in iter_tensors(path, wanted):
            target = plan.targets[name]
            param = _parameter_to_fill(model, target.param, device)
            _copy_checked(_part(param.data, target, config), tensor, name)
            del param, tensor
            filling.filled(target)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


def _load_gguf(
    model: nn.Module,
    gguf: GGUFTensors,
    config: ModelConfig,
    device: torch.device,
    hold_out: HoldOut | None,
    on_filled: OnFilled | None,
) -> nn.Module:
    """`load_model` from a GGUF file: each tensor read from the mapped file and converted
    (to fp32, then the parameter's dtype as it is copied; blocks for a bf16 parameter
    straight to bf16, natively) as it is consumed."""
    sources = gguf.sources()
    if hold_out is not None:
        held = hold_out(model, sources)
        sources = [s for s in sources if s.name not in held]
    plan = plan_tensors(model, config, sources, where=str(gguf.path))
    filling = _Filling(model, plan.targets, on_filled)
    _materialize(model, device, skip={t.param for t in plan.targets.values()})
    params = dict(model.named_parameters())
    # A bf16 parameter takes its blocks decoded straight to bf16: no fp32 copy.
    bf16_names = frozenset(
        name for name, t in plan.targets.items() if params[t.param].dtype == torch.bfloat16
    )
    for name, tensor in gguf.iter_float(set(plan.targets), bf16_names):
        target = plan.targets[name]
        entry = TensorEntry(name, tensor.dtype, tuple(tensor.shape), 0, tensor.nbytes)
        if _usable_in_place(entry, target, params, device):
            # The fp32 tensor just read is memory of its own: it becomes the parameter.
            _set_parameter(model, target.param, tensor)
        else:
            param = _parameter_to_fill(model, target.param, device)
            _copy_checked(_part(param.data, target, config), tensor, name)
            del param
        del tensor
        filling.filled(target)
    del params
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model.eval()


class _Filling:
    """Counts down the checkpoint tensors each parameter still waits for, and calls
    `on_filled` with a module once none of its own parameters waits for any."""

    def __init__(
        self, model: nn.Module, targets: dict[str, Target], on_filled: OnFilled | None
    ) -> None:
        self.model = model
        self.on_filled = on_filled
        self.tensors_left = Counter(t.param for t in targets.values())
        self.owner: dict[str, str] = {}  # parameter -> the module that holds it
        self.params_left: dict[str, int] = {}  # module -> its parameters not yet complete
        for module_name, module in model.named_modules():
            prefix = f"{module_name}." if module_name else ""
            own = [prefix + n for n, p in module._parameters.items() if p is not None]
            # A parameter no tensor fills (a tied lm_head) leaves its module never complete.
            if own and all(self.tensors_left[n] for n in own):
                self.params_left[module_name] = len(own)
                self.owner.update(dict.fromkeys(own, module_name))

    def filled(self, target: Target) -> None:
        self.tensors_left[target.param] -= 1
        if self.on_filled is None or self.tensors_left[target.param]:
            return
        module_name = self.owner.get(target.param)
        if module_name is None:  # its module holds a parameter no tensor fills
            return
        self.params_left[module_name] -= 1
        if not self.params_left[module_name]:
            self.on_filled(self.model, module_name)


def _usable_in_place(
    entry: TensorEntry, target: Target | None, params: dict, device: torch.device
) -> bool:
    """Whether a checkpoint tensor can be its parameter as it lies in the file: the
    whole parameter (not a shard of a fused one or one expert of a stack), in the
    parameter's dtype, on the CPU, aligned for that dtype."""
    if target is None or target.shard is not None or target.expert is not None:
        return False
    param = params[target.param]
    return (
        device.type == "cpu"
        and entry.dtype == param.dtype
        and entry.shape == tuple(param.shape)
        and entry.nbytes > 0
        and entry.offset % entry.dtype.itemsize == 0
    )


def _parameter_to_fill(model: nn.Module, name: str, device: torch.device) -> nn.Parameter:
    """The parameter `name`, given uninitialised memory on `device` if it has none yet."""
    param = model.get_parameter(name)
    if param.is_meta:
        _set_parameter(model, name, torch.empty(param.shape, dtype=param.dtype, device=device))
        param = model.get_parameter(name)
    return param


def _set_parameter(model: nn.Module, name: str, tensor: torch.Tensor) -> None:
    module_name, _, leaf = name.rpartition(".")
    module = model.get_submodule(module_name)
    module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


def _materialize(model: nn.Module, device: torch.device, skip: set[str] = frozenset()) -> None:
    """Give every meta parameter (but those named in `skip`) and buffer uninitialised
    memory on `device`.

    What `Module.to_empty` does, without its first call's cost: it routes through the meta
    dispatcher, which imports torch's symbolic-shape machinery (a third of a second).
    """
    for module_name, module in model.named_modules():
        prefix = f"{module_name}." if module_name else ""
        for name, param in module._parameters.items():
            if param is not None and param.is_meta and prefix + name not in skip:
                empty = torch.empty(param.shape, dtype=param.dtype, device=device)
                module._parameters[name] = nn.Parameter(empty, requires_grad=False)
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.is_meta:
                module._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device=device)


def _copy_checked(dst: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dst.shape != src.shape:
        raise ValueError(f"weight {name} has shape {tuple(src.shape)}, expected {tuple(dst.shape)}")
    dst.copy_(src)


def _part(param: torch.Tensor, target: Target, config: ModelConfig) -> torch.Tensor:
    """The view of a parameter a Target fills: one expert's slice, then a shard's rows
    (of every expert, for a stack filled whole)."""
    if target.expert is not None:
        param = param[target.expert]
    if target.shard is None:
        return param
    dim = shard_dim(target)
    sizes = shard_sizes(target.param, config, param.shape[dim])
    return param.narrow(dim, sum(sizes[: target.shard]), sizes[target.shard])
