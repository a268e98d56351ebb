"""The fence around hivemind's insides: every method of hivemind's that our classes override or
that we rely on is as hivemind 1.1.12 has it (its signature and its code), every attribute we
touch is still set, and every override in diloco/comm/hivemind is in the table."""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import logging
import pkgutil

import hivemind
import pytest

import diloco.comm.hivemind
from diloco.comm.hivemind import overrides
from diloco.comm.hivemind.overrides import OVERRIDDEN, RELIED_ON, Pinned

_SENTINEL = object()
_NOT_METHODS = {"__module__", "__doc__", "__qualname__", "__dict__", "__weakref__", "__annotations__"}


@pytest.mark.parametrize("pinned", OVERRIDDEN + RELIED_ON, ids=lambda pinned: pinned.where)
def test_each_hivemind_method_we_override_or_rely_on_is_as_pinned(pinned: Pinned):
    changed = overrides.differences(pinned)
    assert not changed, (
        f"hivemind {hivemind.__version__} (pinned: {overrides.PINNED}) changed a method diloco depends on; "
        "check the override against it, then record it (python -m diloco.comm.hivemind.overrides):\n"
        + "\n".join(changed)
    )


def test_every_attribute_of_hivemind_we_read_or_set_is_still_set():
    assert not overrides.missing_attributes()


def _our_subclasses_of_hivemind() -> list[type]:
    """The classes defined in diloco.comm.hivemind's modules that have a class of hivemind's as a base."""
    found = []
    for module in pkgutil.iter_modules(diloco.comm.hivemind.__path__, "diloco.comm.hivemind."):
        for _, cls in inspect.getmembers(importlib.import_module(module.name), inspect.isclass):
            if cls.__module__ == module.name and any(base.__module__.startswith("hivemind") for base in cls.__mro__):
                found.append(cls)
    return found


def _overridden(cls: type) -> set[tuple[str, str]]:
    """(hivemind's class, method) of each method of hivemind's that ``cls`` or one of our bases defines anew."""
    found = set()
    ours = [c for c in cls.__mro__ if c.__module__.startswith("diloco.")]
    theirs = [c for c in cls.__mro__ if c.__module__.startswith("hivemind.")]
    for mine in ours:
        for name in set(vars(mine)) - _NOT_METHODS:
            owner = next((c for c in theirs if name in vars(c)), None)
            if owner is None:
                continue
            if callable(vars(owner)[name]) or isinstance(vars(owner)[name], property | staticmethod | classmethod):
                found.add((f"{owner.__module__}.{owner.__qualname__}", name))
    return found


def test_every_hivemind_method_our_classes_override_is_in_the_table():
    found = set().union(*(_overridden(cls) for cls in _our_subclasses_of_hivemind()))
    listed = {(pinned.owner, pinned.name) for pinned in OVERRIDDEN}
    assert found - listed == set(), "overridden but not in overrides.OVERRIDDEN"
    assert listed - found == set(), "in overrides.OVERRIDDEN but no class of ours overrides it"


@pytest.mark.parametrize("pinned", OVERRIDDEN, ids=lambda pinned: pinned.where)
def test_the_table_names_the_class_of_ours_that_overrides_each_method(pinned: Pinned):
    ours = overrides.resolve(pinned.ours_path)
    assert pinned.name in vars(ours), f"{pinned.ours_path} does not define {pinned.name}"


def test_a_changed_signature_a_changed_code_and_a_gone_method_are_each_named():
    pinned = OVERRIDDEN[0]
    assert overrides.differences(dataclasses.replace(pinned, signature="(self)")) == [
        f"{pinned.where} (for {pinned.ours}): signature is now {pinned.signature}, was (self)"
    ]
    (code,) = overrides.differences(dataclasses.replace(pinned, fingerprint="0" * 16))
    assert code.startswith(f"{pinned.where} (for {pinned.ours}): its code changed")
    (gone,) = overrides.differences(dataclasses.replace(pinned, name="_no_such_method"))
    assert gone.startswith(f"{pinned.owner}._no_such_method (overridden or relied on by {pinned.ours}) is gone")


class _Base:
    kind = "a class attribute"

    def __init__(self):
        self.set_here, self._private = 1, 2


class _Derived(_Base):
    def method(self):
        self.set_later: int = 3
        return self.only_read


def test_an_attribute_counts_as_set_where_a_class_or_its_base_assigns_or_defines_it():
    assert {"kind", "set_here", "_private", "set_later", "method"} <= overrides.set_attributes(_Derived)
    assert "only_read" not in overrides.set_attributes(_Derived)


def test_a_fingerprint_is_of_the_code_not_of_its_docstring_comments_or_layout():
    plain = overrides.source_fingerprint("def f(x):\n    return x + 1\n")
    documented = '    def f(x):\n        """Doc."""\n        return (x+1)  # one more\n'
    assert overrides.source_fingerprint(documented) == plain
    assert overrides.source_fingerprint("def f(x):\n    return x + 2\n") != plain
    assert overrides.source_fingerprint("def f(x, y=0):\n    return x + 1\n") != plain
    assert overrides.signature(lambda x, *, y=None, z=_SENTINEL: x) == "(x, *, y=None, z=<object>)"


def test_an_averager_on_another_hivemind_says_so_once(monkeypatch, caplog):
    monkeypatch.setattr(overrides, "_warned", False)
    monkeypatch.setattr(hivemind, "__version__", "9.9.9")
    with caplog.at_level(logging.WARNING, logger=overrides.__name__):
        overrides.warn_if_not_pinned()
        overrides.warn_if_not_pinned()
    assert [r.getMessage() for r in caplog.records] == [
        "hivemind 9.9.9 is installed; diloco overrides parts of hivemind 1.1.12 (diloco/comm/hivemind/overrides.py)"
    ]
