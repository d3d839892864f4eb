"""The ``builtin:`` models warmctl builds itself, by name: where each lives and building it.

``builtin:tiny`` and ``builtin:tiny-moe`` (:mod:`warmctl.models.tinymodel`) and
``builtin:random-llama-<L>x<H>`` (:mod:`warmctl.models.randmodel`, which uses the tiny model's
tokenizer). This module is above both, so neither imports the other's caller.
"""

from __future__ import annotations

from pathlib import Path

from warmctl.models import randmodel, tinymodel


def builtin_dir(model: str, models_root: Path) -> Path | None:
    """:func:`warmctl.models.tinymodel.model_dir` of a ``builtin:`` model name
    (:data:`warmctl.models.tinymodel.BUILTIN`; for ``builtin:random-llama-<L>x<H>``,
    :func:`warmctl.models.randmodel.model_dir`), None for any other."""
    kind = tinymodel.BUILTIN.get(model)
    if kind is None:
        shape = randmodel.parse(model)
        return None if shape is None else randmodel.model_dir(models_root, shape)
    return tinymodel.model_dir(models_root, kind)


def build_builtin(model: str, models_root: Path) -> Path | None:
    """Build the ``builtin:`` model ``model`` under ``models_root`` if missing
    (:func:`warmctl.models.tinymodel.build`, or :func:`warmctl.models.randmodel.build` for
    ``builtin:random-llama-<L>x<H>``); its directory, or None when ``model`` is not a builtin
    name."""
    d = builtin_dir(model, models_root)
    if d is None:
        return None
    if model in tinymodel.BUILTIN:
        return tinymodel.build(d, tinymodel.BUILTIN[model])
    shape = randmodel.parse(model)
    assert shape is not None  # builtin_dir found the name
    return randmodel.build(d, shape)
