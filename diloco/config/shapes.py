"""A layer's shape against the schema, before omegaconf merges it: a section given a value
(``inner=5``), a list given a scalar or a mapping (``comm.hivemind.initial_peers=/ip4/...``, no
brackets), each as one line that names the key and shows the fix; omegaconf's own messages for
these name no key, or name one and then its internal node types (``AnyNode is not a
ListConfig``), or are a ``TypeError``. An empty section in a file (``inner:`` with every key
commented out) is read as what it says: nothing set there."""

from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from diloco.errors import ConfigError


def check_shapes(schema: DictConfig, layer: DictConfig, *, in_file: bool) -> None:
    """Raise ``ConfigError`` for the first key of ``layer`` whose value has another shape than the
    schema's (a section, a list); drop the sections ``layer`` leaves empty. ``in_file``: the fix is
    shown as YAML rather than as an override."""
    _check(schema, layer, "", in_file)


def _check(schema: DictConfig, layer: DictConfig, prefix: str, in_file: bool) -> None:
    for name in list(layer.keys()):
        key = f"{prefix}{name}"
        if name not in schema or OmegaConf.is_interpolation(layer, name):
            continue  # an unknown key is omegaconf's to name (with its new place if it moved)
        expected, given = schema[name], layer[name]
        if OmegaConf.is_dict(expected):
            if given is None and in_file:
                del layer[name]  # `inner:` alone in a file: an empty section
            elif not OmegaConf.is_dict(given):
                raise ConfigError(_section_message(key, expected, given))
            else:
                _check(expected, layer[name], f"{key}.", in_file)
        elif OmegaConf.is_list(expected) and not OmegaConf.is_list(given):
            raise ConfigError(_list_message(key, given, in_file))


def _section_message(key: str, section: DictConfig, given) -> str:
    first = next(iter(section.keys()), "KEY")
    return (
        f"{key} is a section, not a value ({given!r} given): set its keys, such as {key}.{first}=... "
        "(`diloco config` prints every key)"
    )


def _list_message(key: str, given, in_file: bool) -> str:
    """``KEY must be a list: KEY="['a','b']"``, the items taken from a scalar (split at commas)."""
    items = [item.strip() for item in str(given).split(",") if item.strip()] if isinstance(given, str) else []
    shown = "" if given is None else ",".join(f"'{item}'" for item in items or ["..."])
    if in_file:
        return f"{key} must be a list: {key.rsplit('.', 1)[-1]}: [{shown}] in the file"
    return f'{key} must be a list: {key}="[{shown}]"'
