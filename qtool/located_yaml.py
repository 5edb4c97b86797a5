"""A YAML document read as Python values, with the file:line:col of every key and value for errors."""

from __future__ import annotations

from typing import Any

import yaml

from qtool.errors import QtoolError

_MAX_YAML_NODES = 100_000  # refuses alias bombs long before they exhaust memory
Path_ = tuple[str, ...]


class LocatedYaml:
    """A YAML document as Python values plus the source position of every path."""

    def __init__(self, source: str, text: str) -> None:
        self.source = source
        self.marks: dict[Path_, yaml.Mark] = {}  # where each value starts
        self.key_marks: dict[Path_, yaml.Mark] = {}  # where each mapping key starts
        self._nodes = 0
        self._constructor = yaml.SafeLoader("")
        self._open: set[int] = set()  # the collections being converted: an alias to one of them is a cycle
        try:
            root = yaml.compose(text, Loader=yaml.SafeLoader)
            self.value: Any = {} if root is None else self._convert(root, ())
        except yaml.YAMLError as e:
            mark = getattr(e, "problem_mark", None)
            where = f"{source}:{mark.line + 1}:{mark.column + 1}" if mark else source
            problem = getattr(e, "problem", None) or str(e)
            raise QtoolError(f"{where}: invalid YAML: {problem}") from e
        except RecursionError:  # composing and converting recurse once per nesting level
            raise QtoolError(f"{source}: YAML nests too deeply", hint="a config nests a few levels at most") from None
        except ValueError as e:  # PyYAML's scanner: an escape past U+10FFFF ("\U00110000") raises from chr()
            raise QtoolError(f"{source}: invalid YAML: {e}") from None

    def _convert(self, node: yaml.Node, path: Path_) -> Any:
        self._nodes += 1
        if self._nodes > _MAX_YAML_NODES:
            raise QtoolError(
                f"{self.source}: YAML document is too large (more than {_MAX_YAML_NODES} nodes)",
                hint="a config needs a few hundred nodes at most; check for recursive aliases",
            )
        self.marks[path] = node.start_mark
        if isinstance(node, yaml.ScalarNode):
            return self._construct(node)
        if id(node) in self._open:
            raise self.error(path, "a YAML alias refers to a collection that contains it", hint="remove the cycle")
        self._open.add(id(node))
        try:
            if isinstance(node, yaml.MappingNode):
                # Merge keys (<<: *defaults) as yaml.safe_load reads them; a bad one is an "invalid YAML" error.
                self._constructor.flatten_mapping(node)
                result: dict[str, Any] = {}
                for key_node, value_node in node.value:
                    key = self._construct(key_node) if isinstance(key_node, yaml.ScalarNode) else None
                    if not isinstance(key, str):
                        raise QtoolError(f"{self._where_mark(key_node.start_mark)}: keys must be strings")
                    self.key_marks[path + (key,)] = key_node.start_mark  # noqa: RUF005 - mypy rejects (*path, key) here on 3.10
                    result[key] = self._convert(value_node, (*path, key))
                return result
            return [self._convert(item, (*path, str(i))) for i, item in enumerate(node.value)]
        finally:
            self._open.discard(id(node))

    def _construct(self, node: yaml.ScalarNode) -> Any:
        """A scalar's Python value; a tag its text does not fit (``!!int abc``, ``!foo``) is a located error."""
        try:
            return self._constructor.construct_object(node)
        except Exception as e:  # PyYAML raises ConstructorError, or ValueError, IndexError... from parsing the text
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise QtoolError(
                f"{self._where_mark(node.start_mark)}: cannot read {node.value!r} as {tag}",
                hint=f"fix the value or drop the {tag} tag",
            ) from e

    def _where_mark(self, mark: yaml.Mark) -> str:
        return f"{self.source}:{mark.line + 1}:{mark.column + 1}"

    def error(self, path: Path_, message: str, hint: str | None = None, *, at_key: bool = False) -> QtoolError:
        """A QtoolError located at the value (or, with ``at_key``, the key) of ``path``."""
        marks = self.key_marks if at_key else self.marks
        probe = path
        while probe and probe not in marks:
            probe = probe[:-1]
        mark = marks.get(probe) or self.marks.get(probe)
        where = self._where_mark(mark) if mark else self.source
        dotted = ".".join(path) or "<document>"
        return QtoolError(f"{where}: {dotted}: {message}", hint=hint)
