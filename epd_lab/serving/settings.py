"""Settings written once: a role's frozen dataclass is its command line, its launcher's argv and its checks.

    @dataclasses.dataclass(slots=True, frozen=True)
    class DecodeSettings:
        max_batch: int = option(8, "requests per decode forward")

`parser(DecodeSettings)` is the role's ``argparse`` parser (``--max-batch``, typed from the annotation; a
``Mapping[str, Mapping[str, Any]]`` field takes ``--name KEY=JSON``, repeated),
`from_argv` the settings it parses (a value the dataclass refuses exits with the usage), and `to_argv` the
command line that recreates given settings, which `epd_lab.launch` starts each process with.

`ServerSettings` (``--host``, ``--port``) is every role's base; the model roles' bases, which add the model's
placement and the paged KV cache, are `epd_lab.servers.model_settings`'s (they need torch; the proxy does not).
`check_at_least`, `check_positive`, `check_choice` and `check_urls` (a role's backends) are the checks the roles'
``__post_init__`` share, each with one message.
"""
from __future__ import annotations

import argparse
import collections.abc
import dataclasses
import json
import types
import typing
from typing import Any, Sequence, TypeVar

__all__ = ["ServerSettings", "check_at_least", "check_choice", "check_positive", "check_urls", "from_argv", "option",
           "parser", "to_argv"]

S = TypeVar("S")


def option(default: Any = dataclasses.MISSING, help: str = "", *, choices: Sequence[str] | None = None,  # noqa: A002
           flag: str | None = None, cli: bool = True) -> Any:
    """A settings field with its command-line help; `flag` overrides ``--field-name``, `choices` limits the
    values, ``cli=False`` keeps it off the command line (a value only Python can give)."""
    return dataclasses.field(default=default, metadata={"help": help, "choices": choices, "flag": flag, "cli": cli})


def _flag(field: dataclasses.Field) -> str:
    return field.metadata.get("flag") or "--" + field.name.replace("_", "-")


def _cli_fields(cls: type) -> list[tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f, hints[f.name]) for f in dataclasses.fields(cls) if f.metadata.get("cli", True)]


def _split(value: str) -> list[str]:
    """A comma-separated list option; repeating the option adds to it."""
    return [v.strip() for v in value.split(",") if v.strip()]


def _key_json(value: str) -> tuple[str, dict[str, Any]]:
    """A ``KEY=JSON`` option, the JSON an object; repeating the option adds keys."""
    key, sep, text = value.partition("=")
    if not sep or not key.strip():
        raise argparse.ArgumentTypeError(f"{value!r} is not KEY=JSON (e.g. prefill='{{\"num_gpus\": 1}}')")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"{key.strip()}: {text!r} is not JSON ({exc})") from None
    if not isinstance(obj, dict):
        raise argparse.ArgumentTypeError(f"{key.strip()}: {text!r} is not a JSON object")
    return key.strip(), obj


def _is_mapping(kind: Any) -> bool:
    return typing.get_origin(kind) in (collections.abc.Mapping, dict)


def _base(hint: Any) -> tuple[Any, bool]:
    """(the type, whether None is allowed) of ``X`` or ``X | None``."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return hint, False


def parser(cls: type, prog: str | None = None, description: str | None = None) -> argparse.ArgumentParser:
    """The command line of settings dataclass `cls`: one option per field, typed from its annotation (``bool``
    → ``--x/--no-x``, ``tuple[str, ...]`` → comma-separated or repeated, ``X | None`` → optional)."""
    ap = argparse.ArgumentParser(prog=prog, description=description or (cls.__doc__ or "").split("\n")[0],
                                 allow_abbrev=False)
    for field, hint in _cli_fields(cls):
        kind, _ = _base(hint)
        required = field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
        help_ = field.metadata.get("help", "")
        if field.default is not dataclasses.MISSING and field.default not in (None, "", ()):
            help_ += f" (default: {field.default})"
        kw: dict[str, Any] = {"dest": field.name, "help": help_, "required": required}
        if kind is bool:
            ap.add_argument(_flag(field), action=argparse.BooleanOptionalAction, default=None, **kw)
        elif typing.get_origin(kind) is tuple:
            ap.add_argument(_flag(field), type=_split, action="extend", default=None, metavar="A[,B...]", **kw)
        elif _is_mapping(kind):
            ap.add_argument(_flag(field), type=_key_json, action="append", default=None, metavar="KEY=JSON", **kw)
        else:
            ap.add_argument(_flag(field), type=kind, choices=field.metadata.get("choices"), default=None, **kw)
    return ap


def from_argv(cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None,
              description: str | None = None) -> S:
    """Settings `cls` from a command line (options not given keep the field defaults); a value the dataclass
    refuses (`ValueError`) exits with the usage, as argparse does."""
    ap = parser(cls, prog, description)
    args = ap.parse_args(argv)
    mappings = {f.name for f, hint in _cli_fields(cls) if _is_mapping(_base(hint)[0])}
    given = {k: (dict(v) if k in mappings else tuple(v) if isinstance(v, list) else v)
             for k, v in vars(args).items() if v is not None}
    try:
        return cls(**given)
    except (TypeError, ValueError) as exc:
        ap.error(str(exc))


def to_argv(settings: Any) -> list[str]:
    """The command line that `from_argv` turns back into `settings`: the fields that differ from their
    defaults. A value the command line cannot carry (None where the default is not, an empty list, an item
    with a comma) is refused with `ValueError`."""
    argv: list[str] = []
    for field, hint in _cli_fields(type(settings)):
        value = getattr(settings, field.name)
        if field.default is not dataclasses.MISSING and value == field.default:
            continue
        flag = _flag(field)
        if value is None:
            raise ValueError(f"{field.name}=None has no command line (its default is {field.default!r})")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, collections.abc.Mapping):
            for key, obj in value.items():
                argv += [flag, f"{key}={json.dumps(obj, separators=(',', ':'))}"]
        elif isinstance(value, tuple):
            if not value or any("," in str(v) for v in value):
                raise ValueError(f"{field.name}={value!r} has no comma-separated command line")
            argv += [flag, ",".join(map(str, value))]
        else:
            argv += [flag, str(value)]
    return argv


def check_at_least(settings: Any, minimum: int, *names: str) -> None:
    """`ValueError` unless each field in `names` is at least `minimum`."""
    for name in names:
        if getattr(settings, name) < minimum:
            raise ValueError(f"{name} must be >= {minimum}, got {getattr(settings, name)}")


def check_positive(settings: Any, *names: str) -> None:
    """`ValueError` unless each field in `names` is above 0 (a NaN is not)."""
    for name in names:
        if not getattr(settings, name) > 0:
            raise ValueError(f"{name} must be positive, got {getattr(settings, name)}")


def check_choice(settings: Any, name: str, choices: Sequence[str]) -> None:
    """`ValueError` unless field `name` is one of `choices` (the command line's ``choices``, for Python callers)."""
    if getattr(settings, name) not in choices:
        raise ValueError(f"unknown {name} {getattr(settings, name)!r}; choose one of {', '.join(choices)}")


def check_urls(settings: Any, name: str, noun: str, *, required: bool = True) -> None:
    """`ValueError` unless each URL in field `name` starts with http:// or https://, and (`required`) there is at
    least one; the URLs are kept without a trailing slash (paths are appended to them). `noun` names them in the
    message."""
    urls = tuple(u.rstrip("/") for u in getattr(settings, name))
    object.__setattr__(settings, name, urls)
    if required and not urls:
        raise ValueError(f"at least one {noun} URL is needed")
    for url in urls:
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{noun} URL {url!r} must start with http:// or https://")


# keyword-only: a role's own fields come first in its constructor (the proxy's URLs stay positional)
@dataclasses.dataclass(slots=True, frozen=True, kw_only=True)
class ServerSettings:
    """What every role's server is started with: the address it binds. A role's settings derive from it (or
    from a base that does) and call its ``__post_init__`` from theirs, by name: zero-argument ``super()`` fails
    in a slotted dataclass (Python < 3.14)."""

    host: str = option("127.0.0.1", "address to bind")
    port: int = option(0, "0: the OS picks (printed on stdout)")

    def __post_init__(self) -> None:
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in 0..65535, got {self.port}")
