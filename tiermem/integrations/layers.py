"""The decoder layers of a Hugging Face model, found without user code.

Note [decoder layers]: activation offload needs the model's repeated blocks in execution order
(:func:`tiermem.offload.offload_activations` puts forward pre-hooks on them). A transformers
model keeps them in one ``nn.ModuleList`` (``model.model.layers`` for Llama, Qwen, Mistral,
Gemma; ``transformer.h`` for GPT-2; ``gpt_neox.layers``; under ``base_model.model`` once PEFT
wraps it). A list qualifies when every entry is a decoder layer by one of two marks that
transformers itself sets: the layer class derives from ``GradientCheckpointingLayer`` (the
base of every layer that ``activation_checkpointing`` checkpoints) or its name is in the
model's ``_no_split_modules`` (the classes ``device_map="auto"`` never splits). Exactly one
qualifying list is used; none, or several with no path given (encoder-decoder models, a vision
tower beside the language model), is refused naming what was found and the fix: pass the path
(``"model.language_model.layers"``). A list nested inside a qualifying layer is not a
candidate (the layers are the outermost repeat).
"""

from __future__ import annotations

from torch import nn

_LAYER_BASE = "GradientCheckpointingLayer"


def _split_names(model: nn.Module) -> set[str]:
    """Class names in ``_no_split_modules`` of ``model`` and any PreTrainedModel inside it."""
    names: set[str] = set()
    for module in model.modules():
        found = getattr(module, "_no_split_modules", None)
        if isinstance(found, (list, tuple, set)):
            names.update(n for n in found if isinstance(n, str))
    return names


def _is_layer(module: nn.Module, split_names: set[str]) -> bool:
    return (any(c.__name__ == _LAYER_BASE for c in type(module).__mro__)
            or type(module).__name__ in split_names)


def _resolve(model: nn.Module, path: str) -> nn.Module:
    """``model``'s submodule at dotted ``path`` (PEFT and other wrappers: through attributes).

    Raises:
        ValueError: no module at ``path``, naming the first missing part.
    """
    module = model
    for part in path.split("."):
        child = getattr(module, part, None)
        if not isinstance(child, nn.Module):
            raise ValueError(f"decoder layers: {type(module).__name__} has no submodule "
                             f"{part!r} (path {path!r}); give the dotted path of the "
                             f"nn.ModuleList of decoder layers, e.g. 'model.layers'")
        module = child
    return module


def find_decoder_layers(model: nn.Module, path: str | None = None) -> nn.ModuleList:
    """The ``nn.ModuleList`` of ``model``'s decoder layers (Note [decoder layers]).

    Args:
        model: a transformers model (or one wrapped by PEFT, DDP's ``.module``, ...).
        path: dotted path of the list (``"model.layers"``); ``None`` finds it.

    Returns:
        the list, in execution order.

    Raises:
        ValueError: ``path`` leads nowhere or not to a non-empty ModuleList; no list of
            decoder layers is found; several are found and no ``path`` picks one.
        TypeError: ``model`` is not an ``nn.Module`` or ``path`` not a string.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"decoder layers: model must be an nn.Module, got "
                        f"{type(model).__name__}")
    if path is not None:
        if not isinstance(path, str):
            raise TypeError(f"decoder layers: path must be a dotted string like 'model.layers', "
                            f"got {type(path).__name__}")
        found = _resolve(model, path)
        if not isinstance(found, nn.ModuleList) or len(found) == 0:
            raise ValueError(f"decoder layers: {path!r} is a {type(found).__name__}"
                             f"{'' if len(list(found.children())) else ' without children'}, "
                             f"not a non-empty nn.ModuleList of layers; give the path of the "
                             f"list itself (e.g. 'model.layers')")
        return found
    split_names = _split_names(model)
    found: list[tuple[str, nn.ModuleList]] = []
    inside: list[str] = []  # prefixes of qualifying lists: lists under them are not layers
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if any(name.startswith(p + ".") for p in inside):
            continue
        if all(_is_layer(m, split_names) for m in module):
            found.append((name, module))
            inside.append(name)
    if len(found) == 1:
        return found[0][1]
    if not found:
        raise ValueError(f"decoder layers: no nn.ModuleList of decoder layers found in "
                         f"{type(model).__name__} (looked for layers deriving from "
                         f"transformers' {_LAYER_BASE} or named in _no_split_modules "
                         f"{sorted(split_names)}); pass the path of the list of blocks, e.g. "
                         f"activation_offload={{'blocks': 'model.layers'}}")
    listed = ", ".join(f"{name!r} ({len(m)} x {type(m[0]).__name__})" for name, m in found)
    raise ValueError(f"decoder layers: {type(model).__name__} has several lists of layers: "
                     f"{listed}; pick the one to offload, e.g. activation_offload={{'blocks': "
                     f"{found[-1][0]!r}}}")
