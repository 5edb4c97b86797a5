"""Config files by name: the examples installed with qtool, and how ``--config NAME`` finds one."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import QtoolError

PACKAGED_CONFIGS = Path(__file__).parent / "configs"  # the examples installed with qtool (qtool configs lists them)


def packaged_configs() -> dict[str, Path]:
    """The configs installed with qtool, by name (``accurate`` for ``accurate.yaml``)."""
    return {path.stem: path for path in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def resolve_config(path: Path | str) -> Path:
    """A config file's path: the file itself when it exists, else the packaged config of that name.

    ``--config accurate`` (or ``accurate.yaml``) names an installed example when no such file is
    in the working directory; a path with a folder in it is always a path.
    """
    given = Path(path)
    if given.exists() or len(given.parts) != 1:
        return given
    packaged = packaged_configs().get(given.stem if given.suffix in (".yaml", ".yml") else given.name)
    if packaged is None:
        names = ", ".join(packaged_configs())
        raise QtoolError(f"config file not found: {given}", hint=f"or name an installed config: {names}")
    return packaged
