"""A model's config as JSON data, and back: what a saved program stores and what a server sends, so the
other side rebuilds the config (from its class's configuration file, never a modeling file) and reads
the family's rules on it, as the model's own side does."""
from __future__ import annotations

from ..errors import InvalidArgument

PATHS = ("_name_or_path", "name_or_path")  # where a config keeps the folder it was read from


def config_data(config, paths: bool = True) -> dict:
    """``config.to_dict()``; with ``paths=False`` no field that names a folder of this machine (at any depth:
    what a server sends keeps its disk to itself)."""
    data = config.to_dict()
    return data if paths else _without_paths(data)


def _without_paths(value):
    if isinstance(value, dict):
        return {key: _without_paths(item) for key, item in value.items() if key not in PATHS}
    return value


def config_of(model_type: str, data: dict):
    """The config of ``model_type`` with the fields of ``data`` (transformers' configuration class; any
    error it raises on a field is the data's). ``data`` may come from elsewhere (a file, a server): a field
    that is no attribute a config has (a dunder, not an identifier) is refused before the class sees it."""
    odd = [key for key in data if not isinstance(key, str) or key.startswith("__") or not key.isidentifier()]
    if odd:
        raise InvalidArgument(f"a {model_type} config has no field {str(odd[0])[:60]!r}")
    from transformers import AutoConfig  # noqa: PLC0415 — transformers loads with the first config rebuilt
    fields = {key: value for key, value in data.items() if key != "model_type"}
    return AutoConfig.for_model(model_type, **fields)
