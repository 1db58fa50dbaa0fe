"""The server's command line, generated from :class:`~.server_config.ServerConfig`, both ways:
:func:`add_server_flags` and :func:`config_from_args` read it, :func:`config_to_argv` writes it
for the trainer's embedded server (``parse(config_to_argv(c)) == c``). No grpc, no server imports.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import functools
import inspect
import pathlib
import re
import sys
import textwrap
from collections.abc import Callable, Mapping
from typing import Any

from .errors import ConfigError
from .server_config import FLAG, Flag, ServerConfig
from .sizes import KiB, MiB, GiB, TiB, parse_size

__all__ = [
    "UserFlag", "add_server_flags", "attach_negative_values", "config_from_args", "config_to_argv",
    "field_docs", "format_size_flag", "parse_server_argv", "user_flags"]


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """``{field: docstring}`` of a dataclass's attribute docstrings, whitespace collapsed; empty
    where the source is unavailable."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # no source shipped: help still has examples
        return {}
    body = ast.parse(source).body[0]
    assert isinstance(body, ast.ClassDef)
    return {node.target.id: " ".join(after.value.value.split()) for node, after in zip(body.body, body.body[1:])
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant) and isinstance(after.value.value, str)}


@dataclasses.dataclass(frozen=True)
class UserFlag:
    field: dataclasses.Field
    spec: Flag

    @property
    def name(self) -> str:
        return self.field.name

    @property
    def option(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def kind(self) -> str:
        if self.spec.kind is not None:
            return self.spec.kind
        # the annotation's text (``from __future__ import annotations`` in server_config)
        return {"bool": "switch", "int": "int", "float": "float", "str": "str",
                "pathlib.Path": "path"}[str(self.field.type).removesuffix(" | None")]

    @property
    def required(self) -> bool:
        return self.field.default is dataclasses.MISSING and self.field.default_factory is dataclasses.MISSING

    @property
    def metavar(self) -> str | None:
        if self.spec.metavar is not None or self.spec.choices is not None:
            return self.spec.metavar
        return {"size": "SIZE", "seconds": "SECONDS", "int": "N", "float": "X", "path": "PATH",
                "str": self.name.upper(), "switch": None}.get(self.kind)

    def default_text(self) -> str | None:
        """The default as ``--help`` shows it, None when there is nothing to show."""
        if self.spec.default_text is not None:
            return self.spec.default_text
        if self.required:
            return None
        factory = self.field.default_factory
        value = self.field.default if factory is dataclasses.MISSING else factory()
        if value is None or self.kind == "switch":
            return None
        return self.format(value)

    def parse(self, text: str) -> Any:
        return _PARSERS[self.kind](text)

    def format(self, value: Any) -> str:
        if self.kind == "size":
            return format_size_flag(value)
        if self.kind in ("seconds", "float"):
            return repr(float(value)).removesuffix(".0")
        return str(value)

    def help(self) -> str:
        parts = [field_docs(ServerConfig).get(self.name, "").replace("``", "")]
        if self.required:
            parts.append("Required.")
        default = self.default_text()
        if default is not None:
            parts.append(f"Default: {default}.")
        examples = [e if e.startswith("--") else f"{self.option} {e}" for e in self.spec.example.split(" or ")]
        parts.append("e.g. " + " or ".join(examples))
        return " ".join(p for p in parts if p).replace("%", "%%")  # argparse %-formats help


@functools.cache
def user_flags() -> tuple[UserFlag, ...]:
    """The flags, in field order: every :class:`ServerConfig` field with a ``Flag``."""
    return tuple(UserFlag(field, field.metadata[FLAG])
                 for field in dataclasses.fields(ServerConfig) if FLAG in field.metadata)


def format_size_flag(nbytes: int) -> str:
    """Bytes as the shortest exact size flag value: ``67108864`` -> ``"64M"``."""
    for suffix, unit in (("T", TiB), ("G", GiB), ("M", MiB), ("K", KiB)):
        if nbytes and nbytes % unit == 0:
            return f"{nbytes // unit}{suffix}"
    return str(nbytes)


def _size(text: str) -> int:
    """A size; a negative one (``-5G``) parses too, for the config to refuse with the flag's rule."""
    stripped = text.strip()
    sign = -1 if stripped.startswith("-") else 1
    try:
        return sign * parse_size(stripped.removeprefix("-").removesuffix("/s"))
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(
            str(exc) if sign > 0 else f"not a size: {text!r} (expected e.g. 512M, 64G or 1T)") from None


def _seconds(text: str) -> float:
    """A number; the config refuses one out of the flag's range, naming the flag."""
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None


def _host_port(text: str) -> tuple[str | None, int]:
    host, sep, port = text.rpartition(":")
    try:
        number = int(port)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected PORT or HOST:PORT, got {text!r}") from None
    if not 0 <= number <= 65535:
        raise argparse.ArgumentTypeError(f"port out of range: {text!r}")
    return (host.strip("[]") if sep else None), number


_PARSERS: dict[str, Callable[[str], Any]] = {
    "size": _size, "seconds": _seconds, "host_port": _host_port, "int": int, "float": float, "str": str,
    "path": pathlib.Path, "switch": bool}


def add_server_flags(parser: argparse.ArgumentParser) -> None:
    """Declare every user flag on ``parser``; one not given leaves no attribute (the config's default holds)."""
    for flag in user_flags():
        options: dict[str, Any] = {"dest": flag.name, "default": argparse.SUPPRESS, "help": flag.help()}
        if flag.kind == "switch":
            if flag.field.default is not False:
                raise TypeError(f"{flag.name}: a switch flag must default to False")
            options["action"] = "store_true"
        else:
            options.update(type=flag.parse, metavar=flag.metavar, required=flag.required)
            if flag.spec.choices is not None:
                options["choices"] = flag.spec.choices
        parser.add_argument(flag.option, **options)


def config_from_args(args: argparse.Namespace) -> ServerConfig:
    return config_from_settings({flag.name: getattr(args, flag.name) for flag in user_flags()
                                 if hasattr(args, flag.name)})


def setting_value(name: str, value: Any) -> Any:
    """``value`` of setting ``name``: a flag's text parsed as the flag parses it, else as is."""
    flag = next((flag for flag in user_flags() if flag.name == name), None)
    return flag.parse(value) if flag is not None and isinstance(value, str) else value


def config_from_settings(settings: Mapping[str, Any]) -> ServerConfig:
    """Settings by field name -> config (or ConfigError); a flag's value may be its text
    (``"64G"``, parsed as the flag parses it) or the value itself."""
    flags = {flag.name: flag for flag in user_flags()}
    values: dict[str, Any] = {}
    for name, value in settings.items():
        flag = flags.get(name)
        value = setting_value(name, value)
        if flag is not None and flag.kind == "host_port" and isinstance(value, tuple):
            host, value = value
            if host and flag.spec.host_field:
                values[flag.spec.host_field] = host
        values[name] = value
    return ServerConfig(**values)


def parse_server_argv(argv: list[str] | None = None, parser: argparse.ArgumentParser | None = None) -> ServerConfig:
    """Flags (None: ``sys.argv[1:]``) -> config, exiting 2 with usage on bad flags. ``parser``:
    one built with :func:`add_server_flags` (None: a bare one)."""
    if parser is None:
        parser = argparse.ArgumentParser(prog="swap-state-server")
        add_server_flags(parser)
    args = parser.parse_args(attach_negative_values(sys.argv[1:] if argv is None else argv))
    try:
        return config_from_args(args)
    except ConfigError as exc:
        parser.error(str(exc))  # exits


_NEGATIVE = re.compile(r"-\d")


def attach_negative_values(argv: list[str]) -> list[str]:
    """``--shm-size -5G`` -> ``--shm-size=-5G``: argparse takes ``-5G`` for an option, attached
    it reaches the flag's parser and the config refuses it with the flag's rule."""
    takes_value = {flag.option for flag in user_flags() if flag.kind != "switch"}
    out: list[str] = []
    items = iter(argv)
    for arg in items:
        out.append(arg)
        if arg == "--":
            out.extend(items)
        elif arg in takes_value and (value := next(items, None)) is not None:
            if _NEGATIVE.match(value):
                out[-1] = f"{arg}={value}"
            else:
                out.append(value)
    return out


def _resolves_to(config: ServerConfig, name: str, value: Any) -> bool:
    """Whether leaving ``name`` out (None) gives ``value`` again, resolved on construction."""
    try:
        return getattr(dataclasses.replace(config, **{name: None}), name) == value
    except ConfigError:
        return False


def config_to_argv(config: ServerConfig) -> list[str]:
    """The ``swap-state-server`` flags that reproduce ``config`` (``--shm-size`` and ``--listen``
    always, others where not default) as ``--flag=value``; ValueError for a setting that has
    no flag (``mlock``, ...) away from its default."""
    flags = user_flags()
    named = {f.name for f in flags} | {f.spec.host_field for f in flags if f.spec.host_field}
    for field in dataclasses.fields(ServerConfig):
        if field.name not in named and getattr(config, field.name) != field.default:
            raise ValueError(f"ServerConfig.{field.name}={getattr(config, field.name)!r} has no command-line "
                             "flag: a server started from argv cannot reproduce it")
    argv: list[str] = []
    for flag in flags:
        value, field = getattr(config, flag.name), flag.field
        if flag.kind == "host_port" and flag.spec.host_field:
            host = getattr(config, flag.spec.host_field)
            default_host = ServerConfig.__dataclass_fields__[flag.spec.host_field].default
            if value != field.default or host != default_host:
                where = "" if host == default_host else f"[{host}]:" if ":" in host else f"{host}:"
                argv.append(f"{flag.option}={where}{value}")
            continue
        # A default_factory (--listen) depends on the environment where the argv runs: say it.
        if field.default_factory is dataclasses.MISSING:
            if not flag.required and value == field.default:
                continue
            if field.default is None and value is not None and _resolves_to(config, flag.name, value):
                continue  # e.g. --cow-budget: the same value comes back from the other flags
            if value is None:
                raise ValueError(f"ServerConfig.{flag.name}=None cannot be written as {flag.option}")
        if flag.kind != "switch":
            argv.append(f"{flag.option}={flag.format(value)}")
        elif value:
            argv.append(flag.option)
    return argv
