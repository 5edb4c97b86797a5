"""Option groups: flags declared once, as the fields of a record, and spread into a command's signature.

A group is a frozen dataclass deriving from :class:`OptionGroup`; each field is a flag (an ``Annotated``
typer type and its default) or a nested group. A command decorated with :func:`option_groups` takes a
group as one parameter; Typer sees the group's flags in its place, and the command receives the group
built from their values. A command sets its own defaults with a group instance as the parameter's
default (or a nested group's default).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import typing
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T")
G = TypeVar("G", bound="OptionGroup")
R = TypeVar("R", bound="DataclassInstance")
_EMPTY = inspect.Parameter.empty
_KEYWORD = inspect.Parameter.KEYWORD_ONLY


class OptionGroup:
    """Base of the option groups: a frozen dataclass of flags (and nested groups)."""

    __dataclass_fields__: ClassVar[dict[str, Any]]


def _is_group(annotation: object) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, OptionGroup)


def _hints(group: type[OptionGroup]) -> dict[str, Any]:
    return typing.get_type_hints(group, include_extras=True)


def _default(field: dataclasses.Field[Any], owner: OptionGroup | None) -> Any:
    """A field's default: the owner instance's value, else the field's own."""
    if owner is not None:
        return getattr(owner, field.name)
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return _EMPTY


def flags(group: type[OptionGroup], defaults: OptionGroup | None = None) -> Iterator[inspect.Parameter]:
    """The group's flags as keyword-only parameters, in field order, nested groups spread in place."""
    hints = _hints(group)
    for field in dataclasses.fields(group):
        annotation, default = hints[field.name], _default(field, defaults)
        if _is_group(annotation):
            yield from flags(annotation, None if default is _EMPTY else default)
        else:
            yield inspect.Parameter(field.name, _KEYWORD, default=default, annotation=annotation)


def built(group: type[G], values: dict[str, Any]) -> G:
    """The group from the flag values (taken out of ``values``)."""
    hints = _hints(group)
    return group(
        **{
            f.name: built(hints[f.name], values) if _is_group(hints[f.name]) else values.pop(f.name)
            for f in dataclasses.fields(group)
        }
    )


def option_groups(command: Callable[..., T]) -> Callable[..., T]:
    """The command as Typer sees it: each group parameter replaced by the group's flags, in its place."""
    hints = typing.get_type_hints(command, include_extras=True)
    signature = inspect.signature(command)
    groups = {name: hints[name] for name in signature.parameters if _is_group(hints[name])}
    parameters: list[inspect.Parameter] = []
    for param in signature.parameters.values():
        if param.name in groups:
            parameters.extend(flags(groups[param.name], param.default if param.default is not _EMPTY else None))
        else:
            parameters.append(param.replace(kind=_KEYWORD, annotation=hints[param.name]))
    names = [p.name for p in parameters]
    if twice := sorted({name for name in names if names.count(name) > 1}):
        raise TypeError(f"{command.__name__}: a flag's name is used twice: {', '.join(twice)}")

    @functools.wraps(command)
    def wrapper(**values: Any) -> T:
        records = {name: built(group, values) for name, group in groups.items()}
        return command(**values, **records)

    wrapper.__signature__ = signature.replace(parameters=parameters)  # type: ignore[attr-defined]
    wrapper.__annotations__ = {p.name: p.annotation for p in parameters} | {"return": hints.get("return")}
    return wrapper


def filled(record: type[R], *groups: OptionGroup, **own: Any) -> R:
    """``record`` from the fields of ``groups`` that it has (same name), then ``own``.

    ``own``: the command's extra fields, and those whose flag value needs converting (it wins over a group's).
    """
    names = {f.name for f in dataclasses.fields(record)}
    values = {f.name: getattr(g, f.name) for g in groups for f in dataclasses.fields(g) if f.name in names}
    return record(**(values | own))
