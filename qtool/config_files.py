"""Config files by name: the examples installed with qtool, and how ``--config NAME`` finds one."""

from __future__ import annotations

from pathlib import Path

from qtool.errors import QtoolError

PACKAGED_CONFIGS = Path(__file__).parent / "configs"  # the examples installed with qtool (qtool configs lists them)


def packaged_configs() -> dict[str, Path]:
    """The configs installed with qtool, by name (``accurate`` for ``accurate.yaml``)."""
    return {path.stem: path for path in sorted(PACKAGED_CONFIGS.glob("*.yaml"))}


def resolve_config(path: Path | str) -> Path:
    """A config file's path, by one rule: the user's file first, then the installed config of that name.

    ``--config NAME`` reads, in order: the file ``NAME`` as given (a path with a folder in it is
    always a path); ``NAME.yaml`` (or ``.yml``) in the working directory when NAME has no suffix;
    the installed config NAME (``accurate`` or ``accurate.yaml``). A file the user has by that name
    that cannot be read (a broken link, a folder) is an error, never passed over for the installed one.
    """
    given = Path(path)
    if given.exists() or len(given.parts) != 1:
        _check_readable(given)
        return given
    local = [given.with_suffix(suffix) for suffix in (".yaml", ".yml")] if not given.suffix else []
    for candidate in [given, *local]:
        if candidate.is_symlink() or candidate.exists():  # present, even as a broken link
            _check_readable(candidate)
            return candidate
    packaged = packaged_configs().get(given.stem if given.suffix in (".yaml", ".yml") else given.name)
    if packaged is None:
        names = ", ".join(packaged_configs())
        raise QtoolError(f"config file not found: {given}", hint=f"or name an installed config: {names}")
    return packaged


def _check_readable(path: Path) -> None:
    """Refuse the user's config path when it is a broken link or a folder (read_text reports the rest)."""
    if path.is_symlink() and not path.exists():
        raise QtoolError(
            f"config file {path} is a broken symbolic link (to {path.readlink()})",
            hint="fix the link, or remove it to use the installed config of that name",
        )
    if path.is_dir():
        raise QtoolError(f"config {path} is a folder, not a YAML file")
