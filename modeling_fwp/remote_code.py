"""Self-contained checkpoints: the code a saved folder needs for ``trust_remote_code``, and weight-file checks.

``FastWeightHubMixin.save_pretrained`` (``pretrained.py``) calls :func:`save_remote_code`, which writes the modeling
code and an ``auto_map`` into ``config.json``. transformers' own mechanism (``register_for_auto_class`` +
``custom_object_save``) copies a class's module and, recursively, every sibling module named in a relative import,
resolved next to the module. That cannot include the kernels: the model code imports what it uses from
``fwp_kernels``, a separate package (``from fwp_kernels import delta_rule``). So it collects the same closure itself
(with transformers' ``get_relative_imports``, i.e. the way loading will see it), counting each ``from fwp_kernels
import ...`` as the sibling import it writes in its place (``from .fwp_kernels import ...``: a saved folder is flat
and uses sibling imports only), maps the name ``fwp_kernels`` to the installed package's ``__init__`` (its own
sibling imports are resolved inside ``kernels/``), writes the files flat into a staging folder, checks that every
module there imports only what a plain ``transformers`` install has, and copies them into the folder.

Accelerated kernels travel as optional imports: a kernel module that imports ``.<stem>_csrc`` inside a ``try`` block
and has its C++ source in ``csrc/<stem>.cpp`` gets that source written next to the code twice, as ``<stem>.cpp`` (to
read) and as ``<stem>_csrc.py`` holding it in a string ``CPP_SOURCE`` (transformers copies only Python modules into
its module cache), from which the loaded model builds the C++ ops on first use; without a compiler or ninja, or with
``FWP_KERNELS_NO_BUILD=1``, it runs the pure-PyTorch kernels.

A config that nests one of our families (an FWL head on a Delta Net: ``text_config``) also gets the code of that
family and a generated ``register_nested_families.py`` as its ``AutoConfig`` entry, which registers the nested family
with the Auto classes before transformers parses the sub-config by its ``model_type``.

``FastWeightHubMixin.from_pretrained`` checks safetensors files with :func:`check_weight_files` before loading.

This module is itself part of every export, so it imports only the standard library, torch's ecosystem and
``transformers`` / ``huggingface_hub`` / ``safetensors``.
"""
from __future__ import annotations

import ast
import hashlib
import importlib.util
import json
import os
import re
import shutil
import struct
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Mapping, Optional, Tuple, Union

import transformers
from transformers.dynamic_module_utils import get_imports, get_relative_imports

KERNELS_MODULE = "fwp_kernels"
# Top-level packages that exported modules may import outside a ``try`` block: what loading with
# ``trust_remote_code`` can count on (transformers checks every module's imports when it downloads them).
REMOTE_CODE_DEPENDENCIES = frozenset({"torch", "transformers", "huggingface_hub", "safetensors", "tokenizers", "numpy"})
AUTO_MODEL_CLASSES = ("AutoModel", "AutoModelForCausalLM", "AutoModelForSeq2SeqLM")
WEIGHTS_PATTERN = "*.safetensors"
# `from .<stem>_csrc import CPP_SOURCE`: the C++ source csrc/<stem>.cpp of a kernel module, generated on export.
EMBEDDED_SOURCE_SUFFIX = "_csrc"
CPP_SOURCE_NAME = "CPP_SOURCE"
NESTED_REGISTRATION_MODULE = "register_nested_families"  # generated for configs that nest our families


# ---------------------------------------------------------------------------------------------------------------
# Code export
# ---------------------------------------------------------------------------------------------------------------


def _module_file(cls: type) -> Path:
    return Path(sys.modules[cls.__module__].__file__)


def _class_reference(cls: type) -> str:
    """``"<module file stem>.<class name>"``: how ``auto_map`` names a class of a flat code folder."""
    return f"{_module_file(cls).stem}.{cls.__name__}"


def remote_code_auto_map(model: transformers.PreTrainedModel) -> Dict[str, str]:
    """The ``auto_map`` of a saved folder: the config class and the model classes registered for it.

    ``AutoModel`` / ``AutoModelForCausalLM`` entries come from the Auto registries (filled by ``modeling_fwp``'s
    import, or by transformers when it loads remote code), restricted to classes defined next to the model's own
    module; the model's own class is always included.
    """
    config_cls = type(model.config)
    code_dir = _module_file(type(model)).parent
    auto_map = {"AutoConfig": _class_reference(config_cls)}
    for auto_name in AUTO_MODEL_CLASSES:
        mapping = getattr(transformers, auto_name)._model_mapping
        if config_cls in mapping:
            registered = mapping[config_cls]
            if _module_file(registered).parent == code_dir:
                auto_map[auto_name] = _class_reference(registered)
    if _class_reference(type(model)) not in auto_map.values():
        auto_map[getattr(model, "_auto_class", None) or "AutoModelForCausalLM"] = _class_reference(type(model))
    return auto_map


def _kernels_init_file() -> Path:
    spec = importlib.util.find_spec(KERNELS_MODULE)
    if spec is None or spec.origin is None:
        raise ModuleNotFoundError(
            f"Saving a fast-weight model needs the `{KERNELS_MODULE}` package (or a folder saved with it): the "
            "kernels are copied into the saved folder",
            name=KERNELS_MODULE,
        )
    return Path(spec.origin)


def _kernel_imports(text: str) -> List[ast.ImportFrom]:
    """The ``from fwp_kernels import ...`` statements of a module's source (absolute imports of the package itself)."""
    return [
        node for node in ast.walk(ast.parse(text))
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module == KERNELS_MODULE
    ]


def exported_module_text(path: Path) -> str:
    """The text of the module at ``path`` as a saved folder holds it: each ``from fwp_kernels import ...`` becomes
    ``from .fwp_kernels import ...``, the import of the folder's sibling copy of the kernels' ``__init__``. Every
    other line is kept as it is (``import fwp_kernels`` or ``from fwp_kernels.<module> import ...`` are not
    rewritten, and :func:`check_remote_code_imports` refuses them)."""
    text = path.read_text(encoding="utf-8")
    lines = text.splitlines(keepends=True)
    for node in _kernel_imports(text):
        line = lines[node.lineno - 1].encode("utf-8")  # ast's col_offset counts UTF-8 bytes
        head, tail = line[: node.col_offset].decode("utf-8"), line[node.col_offset:].decode("utf-8")
        lines[node.lineno - 1] = head + re.sub(rf"^from\s+{KERNELS_MODULE}\b", f"from .{KERNELS_MODULE}", tail)
    return "".join(lines)


def _sibling_imports(path: Path, rewrite_kernel_imports: bool) -> List[str]:
    """The sibling modules ``path`` imports, as loading sees them (after the rewrite, when asked for)."""
    modules = get_relative_imports(path)
    if rewrite_kernel_imports and path.suffix == ".py" and _kernel_imports(path.read_text(encoding="utf-8")):
        modules = sorted(set(modules) | {KERNELS_MODULE})
    return modules


def remote_code_sources(entry_files: List[Path], rewrite_kernel_imports: bool = False) -> Dict[str, Path]:
    """Maps each file name of a code folder to its source, for ``entry_files`` and everything they import.

    Follows sibling imports as transformers does when loading (``get_relative_imports``); with
    ``rewrite_kernel_imports`` (what :func:`save_remote_code` does) also each ``from fwp_kernels import ...``, as the
    sibling import :func:`exported_module_text` turns it into. A sibling that does not exist next to the importing
    module and is named ``fwp_kernels`` is the kernels package: its ``__init__`` becomes ``fwp_kernels.py`` and its
    own siblings are resolved in its folder. A missing sibling ``<stem>_csrc`` with a ``csrc/<stem>.cpp`` next to
    the importing module is that C++ source, mapped to the ``.cpp`` file (:func:`save_remote_code` writes it as a
    Python module, see :func:`embedded_source_module`).
    """
    sources: Dict[str, Path] = {}
    pending = [(path.name, path) for path in entry_files]
    while pending:
        name, path = pending.pop()
        if name in sources:
            if sources[name].resolve() != path.resolve():
                raise ValueError(
                    f"Two modules would be saved as {name}: {sources[name]} and {path}. Exported code is flat (one "
                    "folder): rename one of them"
                )
            continue
        sources[name] = path
        for module in _sibling_imports(path, rewrite_kernel_imports):
            candidate = path.parent / f"{module}.py"
            if candidate.is_file():
                pending.append((candidate.name, candidate))
            elif module == KERNELS_MODULE:
                pending.append((f"{KERNELS_MODULE}.py", _kernels_init_file()))
            elif module.endswith(EMBEDDED_SOURCE_SUFFIX) and _embedded_cpp_file(path, module).is_file():
                pending.append((f"{module}.py", _embedded_cpp_file(path, module)))
            else:
                raise FileNotFoundError(
                    f"{path} imports `.{module}`, but {candidate} does not exist. Exported code can only use flat "
                    "sibling imports (`from .module import name`)"
                )
    return sources


def check_remote_code_imports(sources: Dict[str, Path], origins: Optional[Mapping[str, Path]] = None) -> None:
    """Raises ``ImportError`` when a module imports, outside a ``try`` block, a package a plain transformers
    install may lack (transformers refuses to load such remote code). ``origins``: where each module comes from,
    for the message (default: ``sources``)."""
    origins = sources if origins is None else origins
    allowed = REMOTE_CODE_DEPENDENCIES | set(sys.stdlib_module_names)
    problems = {
        name: sorted(set(get_imports(path)) - allowed) for name, path in sorted(sources.items()) if path.suffix == ".py"
    }
    problems = {name: bad for name, bad in problems.items() if bad}
    if problems:
        listing = "; ".join(f"{name} ({origins[name]}) imports {', '.join(bad)}" for name, bad in problems.items())
        raise ImportError(
            f"The model code cannot be exported for trust_remote_code: {listing}. Exported modules may import only "
            f"{sorted(REMOTE_CODE_DEPENDENCIES)} and the standard library outside a `try` block, and the kernels "
            f"as `from {KERNELS_MODULE} import name` (save_pretrained writes it as a sibling import); optional "
            f"accelerators inside `try`"
        )


def _embedded_cpp_file(importer: Path, module: str) -> Path:
    """``csrc/<stem>.cpp`` next to ``importer``: the C++ source that the sibling module ``<stem>_csrc`` carries."""
    return importer.parent / "csrc" / f"{module[: -len(EMBEDDED_SOURCE_SUFFIX)]}.cpp"


def embedded_source_module(cpp_file: Path) -> str:
    """The text of ``<stem>_csrc.py``: ``cpp_file``'s source in the string ``CPP_SOURCE`` (read back exactly)."""
    source = cpp_file.read_text(encoding="utf-8")
    literal = f'r"""{source}"""' if '"""' not in source and not source.endswith("\\") else repr(source)
    if ast.literal_eval(literal) != source:  # a raw string cannot hold every text: fall back to repr
        literal = repr(source)
    digest = hashlib.sha1(source.encode("utf-8")).hexdigest()
    return (
        f'"""C++ source of the kernels in {cpp_file.name} (sha1 {digest}), as a string.\n\n'
        "Written by modeling_fwp.remote_code when the model was saved: transformers copies only Python modules of a\n"
        "trust_remote_code folder, so the source travels here; the kernel module builds it with\n"
        "torch.utils.cpp_extension on first use (FWP_KERNELS_NO_BUILD=1: never) and otherwise runs PyTorch code.\n"
        f'The same text is in {cpp_file.name} next to this file.\n"""\n'
        f"{CPP_SOURCE_NAME} = {literal}\n"
    )


def nested_families(config: transformers.PreTrainedConfig, code_dir: Path) -> List[Tuple[type, type]]:
    """``(config class, causal LM class)`` of the sub-configs of ``config`` (e.g. an FWL model's ``text_config``)
    that are model families defined in ``code_dir`` - which a process without this package does not know."""
    found = []
    for key in getattr(type(config), "sub_configs", None) or {}:
        sub_config = getattr(config, key, None)
        if sub_config is None or _module_file(type(sub_config)).parent != code_dir:
            continue
        model_cls = transformers.AutoModelForCausalLM._model_mapping.get(type(sub_config), None)
        if model_cls is None or _module_file(model_cls).parent != code_dir:
            raise ValueError(
                f"`config.{key}` is a {type(sub_config).__name__} with no causal LM class registered next to it "
                f"(in {code_dir}): import the package that defines it before saving"
            )
        found.append((type(sub_config), model_cls))
    return found


def nested_registration_module(config_cls: type, nested: List[Tuple[type, type]]) -> str:
    """The text of ``register_nested_families.py``, the ``AutoConfig`` entry of a folder whose config nests our
    families: it registers them with ``AutoConfig`` / ``AutoModelForCausalLM`` (unless their model type is known
    already) and re-exports ``config_cls``. transformers parses a sub-config by ``model_type`` before any model
    code runs, so this is the only place where a process without the package can learn them."""
    imports = [(_module_file(cls).stem, cls.__name__) for pair in nested for cls in pair]
    imports.append((_module_file(config_cls).stem, config_cls.__name__))
    lines = [
        f'"""Written by modeling_fwp.remote_code: registers the model families nested in {config_cls.__name__}',
        "(sub-configs) with the Auto classes, so that config.json parses without the modeling_fwp package.",
        '"""',
        "from transformers import AutoConfig, AutoModelForCausalLM",
        "from transformers.models.auto.configuration_auto import CONFIG_MAPPING",
        "",
        *sorted({f"from .{module} import {name}" for module, name in imports}),
        "",
    ]
    for sub_config_cls, model_cls in nested:
        lines += [
            f"if {sub_config_cls.__name__}.model_type not in CONFIG_MAPPING:",
            f"    AutoConfig.register({sub_config_cls.__name__}.model_type, {sub_config_cls.__name__})",
            f"AutoModelForCausalLM.register({sub_config_cls.__name__}, {model_cls.__name__}, exist_ok=True)",
        ]
    lines += ["", f'__all__ = ["{config_cls.__name__}"]', ""]
    return "\n".join(lines)


def stage_remote_code(sources: Dict[str, Path], staging: Path) -> Dict[str, Path]:
    """Writes the files of a code folder into ``staging`` as a saved folder holds them: modules with their kernel
    imports rewritten (:func:`exported_module_text`), and each C++ source twice, as ``<stem>.cpp`` and as the module
    ``<stem>_csrc.py`` that carries it (:func:`embedded_source_module`). Returns ``{file name: staged path}``."""
    staged = {}
    for name, source in sources.items():
        staged[name] = staging / name
        if source.suffix == ".cpp":
            staged[name].write_text(embedded_source_module(source), encoding="utf-8")
            staged[source.name] = staging / source.name
            shutil.copyfile(source, staged[source.name])
        elif _kernel_imports(source.read_text(encoding="utf-8")):
            staged[name].write_text(exported_module_text(source), encoding="utf-8")
        else:
            shutil.copyfile(source, staged[name])
    return staged


def save_remote_code(model: transformers.PreTrainedModel, save_directory: Union[str, os.PathLike]) -> List[Path]:
    """Writes the modeling code of ``model`` (its config, model classes, their sibling modules, the kernels with
    the C++ sources of their accelerated versions, and the code of families nested in its config) flat into
    ``save_directory``; returns the written paths. Sets ``model.config.auto_map``."""
    auto_map = remote_code_auto_map(model)
    code_dir = _module_file(type(model)).parent
    nested = nested_families(model.config, code_dir)
    entry_files = {code_dir / f"{reference.split('.')[0]}.py" for reference in auto_map.values()}
    entry_files |= {_module_file(cls) for pair in nested for cls in pair}
    sources = remote_code_sources(sorted(entry_files), rewrite_kernel_imports=True)
    if nested and f"{NESTED_REGISTRATION_MODULE}.py" in sources:
        raise ValueError(f"{NESTED_REGISTRATION_MODULE}.py is a generated module name; rename the module in {code_dir}")
    folder = Path(save_directory)
    with tempfile.TemporaryDirectory() as staging:
        staged = stage_remote_code(sources, Path(staging))
        check_remote_code_imports(staged, origins=sources)  # the files as the saved folder will hold them
        folder.mkdir(parents=True, exist_ok=True)
        written = [folder / name for name in sorted(staged)]
        for target in written:
            shutil.copyfile(staged[target.name], target)
    if nested:  # config.json is parsed through the module that registers the nested families first
        target = folder / f"{NESTED_REGISTRATION_MODULE}.py"
        target.write_text(nested_registration_module(type(model.config), nested), encoding="utf-8")
        written.append(target)
        auto_map["AutoConfig"] = f"{NESTED_REGISTRATION_MODULE}.{type(model.config).__name__}"
    model.config.auto_map = {**(getattr(model.config, "auto_map", None) or {}), **auto_map}
    return written


# ---------------------------------------------------------------------------------------------------------------
# Weight files
# ---------------------------------------------------------------------------------------------------------------


def check_safetensors_file(path: Union[str, os.PathLike]) -> None:
    """Reads a safetensors file's header (not its tensors) and raises ``OSError`` naming the file and the problem
    when the file is truncated or corrupted.

    Layout: an 8-byte little-endian header length n, n bytes of JSON ``{name: {dtype, shape, data_offsets}}``,
    then the tensor data, which the offsets must cover exactly.
    """
    path = Path(path)
    size = path.stat().st_size
    advice = "re-download or re-save the checkpoint"
    with path.open("rb") as f:
        if size < 8:
            raise OSError(f"{path} is truncated: {size} bytes, shorter than a safetensors header length; {advice}")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > size - 8:
            raise OSError(
                f"{path} is truncated or corrupted: its header claims {header_len} bytes but only {size - 8} follow "
                f"the length prefix; {advice}"
            )
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as error:
            raise OSError(f"{path} is corrupted: its header is not valid JSON ({error}); {advice}") from None
    if not isinstance(header, dict):
        raise OSError(f"{path} is corrupted: its header is not a JSON object; {advice}")
    data_size = size - 8 - header_len
    data_end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            raise OSError(f"{path} is corrupted: tensor {name!r} has no valid data_offsets in the header; {advice}")
        data_end = max(data_end, offsets[1])
    if data_end > data_size:
        raise OSError(
            f"{path} is truncated: its header describes {data_end} bytes of tensor data but the file holds "
            f"{data_size}; {advice}"
        )
    if data_end < data_size:
        raise OSError(
            f"{path} is corrupted: {data_size - data_end} bytes follow the tensor data its header describes; {advice}"
        )


def check_weight_files(folder: Union[str, os.PathLike]) -> None:
    """Checks every ``*.safetensors`` file of a local checkpoint folder (see :func:`check_safetensors_file`)."""
    for path in sorted(Path(folder).glob(WEIGHTS_PATTERN)):
        check_safetensors_file(path)
