"""A model in an unexpected state, refused by name before anything changes: hooks from outside dpa (global or on a
module), a forward patched on an instance, a ``torch.compile``'d module, autocast, weights that are not where dpa
reads them (offloaded by accelerate, on the meta device, inference tensors). ``guard.model_state`` runs them on
every call. ``module_state``: what the family checks depend on, compared on every call (``families.spec_for``)."""

from __future__ import annotations

import sys
import types

import torch
from torch import nn

from .errors import ModelStateError
from .files import plain_settings


# Hooks that never change a value: transformers' output capturing (records outputs) and the hook
# gradient checkpointing puts on the embeddings (marks their output as requiring grad). accelerate's
# device hooks (``_hf_hook``) move tensors between devices and are not module hooks.
_HARMLESS_HOOK_MODULES = ("transformers.utils.output_capturing",)
_HARMLESS_HOOKS = ("PreTrainedModel.enable_input_require_grads.<locals>.make_inputs_require_grads",)
_HINT = "; remove it (handle.remove()) before attributing, or attribute a copy of the model"


def check_global_hooks() -> None:
    """Refuse global module hooks (torch.nn.modules.module.register_module_*_hook): they run on every
    module and could change activations or gradients behind dpa's back."""
    from torch.nn.modules import module as torch_module

    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        if getattr(torch_module, f"_global_{kind}_hooks"):
            raise ModelStateError(f"a global module {kind.replace('_', '-')} hook is registered "
                                  f"(torch.nn.modules.module.register_module_{kind}_hook): it could change what dpa "
                                  f"attributes{_HINT}")


def check_saved_tensors_hooks() -> None:
    """Refuse a call inside ``torch.autograd.graph.saved_tensors_hooks`` whose unpack does not give back what its pack
    was given: dpa's backward reads its saved tensors (the frozen norms' scales, the gates' ratios) through them, so a
    changing unpack would change the scores behind dpa's back. Hooks that give the tensor back (``save_on_cpu``, a
    hook that measures what the graph keeps) pass: probed on a small tensor, bit for bit."""
    top = getattr(torch._C._autograd, "_top_saved_tensors_default_hooks", None)
    hooks = top(False) if top is not None else None
    if hooks is None:
        return
    pack, unpack = hooks
    probe = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float64)
    try:
        back = unpack(pack(probe))
        same = (isinstance(back, torch.Tensor) and back.dtype == probe.dtype and back.shape == probe.shape
                and torch.equal(back.detach().cpu(), probe))
    except Exception as err:  # noqa: BLE001 -- a hook that cannot round-trip a tensor cannot carry dpa's
        same, why = False, f"it raised {type(err).__name__}: {err}"
    else:
        why = "it gave back another tensor"
    if not same:
        raise ModelStateError(
            f"dpa was called inside torch.autograd.graph.saved_tensors_hooks whose unpack does not give back what its "
            f"pack was given ({why}, on a probe): dpa's backward reads its saved tensors through them, so they could "
            "change the scores; call dpa outside that context (hooks that give tensors back, as save_on_cpu, pass)")


def check_autocast(model: nn.Module) -> None:
    """Refuse a call under ``torch.autocast`` on the model's device: the forward would run in another precision than
    the model's weights, while dpa's rules, taps and scores assume the model's own arithmetic (and the completeness
    and batch identities would only hold to the autocast precision)."""
    for kind in sorted({p.device.type for p in model.parameters()} - {"meta"}):
        try:
            on = torch.is_autocast_enabled(kind)
        except (RuntimeError, ValueError):  # a device type without autocast
            continue
        if on:
            raise ModelStateError(f"dpa was called under torch.autocast ({kind}): the model would run in "
                                  f"{torch.get_autocast_dtype(kind)} while its weights are "
                                  f"{next(model.parameters()).dtype}; call dpa outside the autocast region, or cast "
                                  "the model itself (model.to(torch.bfloat16))")


def harmless(fn) -> bool:
    return (getattr(fn, "__module__", "").startswith(_HARMLESS_HOOK_MODULES)
            or getattr(fn, "__qualname__", "") in _HARMLESS_HOOKS)


def check_not_compiled(name: str, module: nn.Module) -> None:
    """Refuse a ``torch.compile``'d module (an ``OptimizedModule`` around the original): dpa runs the model's own
    modules eagerly, with its rules on them."""
    if type(module).__name__ == "OptimizedModule" and hasattr(module, "_orig_mod"):
        raise ModelStateError(f"{name or 'the model'} is a torch.compile'd module: dpa runs the model's own modules "
                              f"eagerly, with its rules on them; put the original back ({name or 'model'}._orig_mod) "
                              "before attributing")
    if getattr(module, "_compiled_call_impl", None) is not None:  # Module.compile(): compiled in place
        raise ModelStateError(f"{name or 'the model'} was compiled in place ({name or 'model'}.compile()): dpa runs "
                              "the model's own modules eagerly, with its rules on them; attribute a copy made before "
                              "compiling, or load the model again")


def check_module_hooks(name: str, module: nn.Module) -> None:
    """Refuse a module carrying hooks from outside dpa, or a forward patched on the instance: a silently
    wrong attribution otherwise. transformers' output-capturing hooks and accelerate's device hooks pass."""
    for kind in ("forward", "forward_pre", "backward", "backward_pre"):
        for fn in getattr(module, f"_{kind}_hooks").values():
            if not harmless(fn):
                raise ModelStateError(
                    f"the model has a {kind.replace('_', '-')} hook on {name or 'the model itself'} "
                    f"({getattr(fn, '__qualname__', type(fn).__name__)}): it could change what dpa attributes{_HINT}")
    check_not_compiled(name, module)
    if "forward" in module.__dict__ and not hasattr(module, "_hf_hook"):
        raise ModelStateError(f"{name or 'the model'}.forward is replaced on the instance "
                              f"({getattr(module.forward, '__qualname__', module.forward)!r}): dpa cannot vouch "
                              "for what it computes; restore the module's own forward before attributing")


def _accelerate_hooks(module: nn.Module) -> list:
    """The accelerate hooks on ``module`` (``module._hf_hook``, a ``SequentialHook`` opened into its parts)."""
    hook = getattr(module, "_hf_hook", None)
    if hook is None:
        return []
    from accelerate.hooks import SequentialHook

    out, todo = [], [hook]
    while todo:
        h = todo.pop(0)
        if type(h) is SequentialHook:
            todo[:0] = h.hooks
        else:
            out.append(h)
    return out


def _align_devices_hook() -> type:
    from accelerate.hooks import AlignDevicesHook

    return AlignDevicesHook


def check_loaded(model: nn.Module) -> None:
    """Every weight where dpa reads it: no module offloaded by accelerate (its weights kept on the meta device,
    loaded into the module for each forward and dropped after), no parameter or buffer on the meta device. dpa
    reads weights directly (norms' gains, projections, the unembedding, a circuit's writes) and runs blocks of the
    model on their own, so an offloaded module would give meta-tensor errors or wrong numbers; refused by name,
    before anything runs (so nothing offloaded is ever loaded into memory by dpa)."""
    for name, m in model.named_modules():
        hooks = _accelerate_hooks(m)
        # AlignDevicesHook(offload=True): cpu_offload, disk_offload, "cpu"/"disk" in a device_map beside an accelerator
        if any(getattr(h, "offload", False) for h in hooks):
            raise ModelStateError(
                f"{name or 'the model'} is offloaded (weights on the meta device, loaded by accelerate at forward "
                "time); dpa reads weights directly and does not read offloaded weights: load the model without "
                "offload (no \"cpu\" or \"disk\" in device_map beside an accelerator, no accelerate.cpu_offload or "
                "disk_offload), or with a device_map on devices that hold all the weights")
        # only accelerate's own device hook, exactly (a subclass, a user's ModelHook, CpuOffload moving the whole model
        # at forward time could change what dpa attributes)
        foreign = next((h for h in hooks if type(h) is not _align_devices_hook()), None)
        if foreign is not None:
            raise ModelStateError(
                f"{name or 'the model'} carries an accelerate hook dpa does not know ({type(foreign).__qualname__}; "
                "accelerate's device hooks, AlignDevicesHook, are the ones that pass): it could change what the module "
                "returns or move the model during the call; remove it (accelerate.hooks.remove_hook_from_module) "
                "before attributing")
        params = getattr(m, "parametrizations", None)
        if isinstance(params, nn.ModuleDict) and any(p.training and any(True for _ in p.buffers(recurse=False))
                                                     for p in params.modules()):
            raise ModelStateError(  # spectral_norm's power iteration: each read of the weight changes its buffers
                f"{name or 'the model'} has a parametrization ({', '.join(params)}) with state (buffers) in train "
                "mode, where reading the weight may update that state (spectral_norm's power iteration), and dpa "
                "reads weights before it switches the model to eval: call model.eval() before attributing")
        for kind, tensors in (("parameter", m._parameters), ("buffer", m._buffers)):
            for key, t in tensors.items():
                if t is not None and t.device.type == "meta":
                    raise ModelStateError(f"{name + '.' if name else ''}{key} (a {kind}) is on the meta device (not "
                                          "loaded); load the model's weights before attributing")
                if t is not None and t.is_inference():  # autograd cannot save them for the backward
                    raise ModelStateError(f"{name + '.' if name else ''}{key} (a {kind}) is an inference tensor (the "
                                          "model was built or loaded inside torch.inference_mode()); dpa runs a "
                                          "backward through the model: load it outside inference_mode")


def module_state(model: nn.Module) -> list:
    """What the checks and the modules dpa looks up depend on, besides the config, walked from ``model``: each
    module's class, its parameters (name, identity, dtype, shape), its plain settings and its children (name and the object itself,
    kept alive by the list, so that no other module can take its place unseen; a parameter's identity matters
    only where dpa keeps the object, which then stays alive too: GPT-OSS's sinks). Equal lists: the same modules
    at the same places, the same parameters. Each class's forward and the functions of the modules that define
    the classes (a class or a modelling file patched after a first call: ``Lfm2ShortConv.forward``,
    ``modeling_lfm2.causal_conv1d_fn``) are part of it too, so the checks that probe forwards run again. About 1 ms
    per call on a 135M-parameter model."""
    state: list = []
    add = state.append
    seen, stack = {id(model)}, [model]
    files: dict[str, None] = {}
    while stack:
        m = stack.pop()
        add(type(m)), add(type(m).forward)
        files[type(m).__module__] = None
        params, children = m._parameters, m._modules
        add(len(params))
        for name, p in params.items():
            add(name)
            if p is None:
                add(None)
            else:
                add(id(p)), add(p.dtype), add(p.shape)
        for k, v in plain_settings(m):  # an attention's head_dim, soft-cap or scaling
            add(k), add(v)
        add(len(children))
        for name, child in children.items():
            add(name), add(child)
            if child is not None and id(child) not in seen:
                seen.add(id(child))
                stack.append(child)
    for name in files:  # the functions each modelling file's classes call (its module-level names)
        namespace = vars(sys.modules[name]) if name in sys.modules else {}
        state.extend(v for v in namespace.values() if isinstance(v, types.FunctionType))
    return state
