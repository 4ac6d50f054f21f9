"""    .venv/bin/python scripts/config_reference.py [--check]

Writes the references that come from the code:

* docs/config.md, the ``"gift"`` block of ds_config.json, from the pydantic models in
  ``deepspeed_gift/config.py``: one section per model, named by its key path, with every
  field's type and allowed values, default and docstring;
* docs/telemetry.md, every key of a step's telemetry record, from
  ``deepspeed_gift.telemetry.TELEMETRY_KEYS``.

``--check`` writes nothing and exits 1, saying what differs, when a file is not what this
script would write. Either way it exits 1 when a config field has no docstring
(``undocumented``). tests/test_docs.py imports ``render``, ``render_telemetry`` and
``undocumented``.
"""

from __future__ import annotations

import argparse
import difflib
import enum
import json
import re
import sys
import typing
from pathlib import Path
from typing import Iterator, List, Optional, Tuple

import annotated_types
from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run as a script, sys.path[0] is scripts/
    sys.path.insert(0, str(ROOT))

from deepspeed_gift.config import GIFT_KEY, GiftConfig  # noqa: E402
from deepspeed_gift.telemetry import TELEMETRY_KEYS  # noqa: E402

DOC_PATH = ROOT / "docs" / "config.md"
TELEMETRY_DOC_PATH = ROOT / "docs" / "telemetry.md"
COMMAND = ".venv/bin/python scripts/config_reference.py"

# annotated_types constraints a Field(ge=..., ...) leaves in FieldInfo.metadata, in print order
_BOUNDS = ((annotated_types.Gt, "gt", ">"), (annotated_types.Ge, "ge", ">="),
           (annotated_types.Lt, "lt", "<"), (annotated_types.Le, "le", "<="))
_SCALARS = {bool: "bool", int: "int", float: "number", str: "string"}


def heading_anchor(key: str) -> str:
    """The anchor GitHub gives the section heading of ``key`` (its dots are dropped)."""
    return re.sub(r"[^\w\- ]", "", key.lower()).replace(" ", "-")


def _sub_model(annotation) -> Optional[type]:
    """The config model a field holds (also inside ``Optional``), or None."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, BaseModel):
            return candidate
    return None


def _field_key(name: str, field) -> str:
    return field.alias or name


def sections(root: type = GiftConfig, key: str = GIFT_KEY) -> List[Tuple[str, type]]:
    """(key path, model) of ``root`` and every model reachable from it, depth first in field
    order; a model reached twice is listed once, under its first path."""
    found: List[Tuple[str, type]] = []
    seen = set()

    def visit(model: type, path: str) -> None:
        if model in seen:
            return
        seen.add(model)
        found.append((path, model))
        for name, field in model.model_fields.items():
            sub = _sub_model(field.annotation)
            if sub is not None:
                visit(sub, f"{path}.{_field_key(name, field)}")

    visit(root, key)
    return found


def _fields(root: type, key: str) -> Iterator[Tuple[str, str, object]]:
    """(section path, dotted key, FieldInfo) of every field of every section."""
    for path, model in sections(root, key):
        for name, field in model.model_fields.items():
            yield path, f"{path}.{_field_key(name, field)}", field


def undocumented(root: type = GiftConfig, key: str = GIFT_KEY) -> List[str]:
    """Dotted keys of the fields (of ``root`` and the models under it) with no description."""
    return [dotted for _, dotted, field in _fields(root, key) if not (field.description or "").strip()]


def _json(value) -> str:
    if isinstance(value, enum.Enum):
        value = value.value
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    return json.dumps(value, sort_keys=True)


def _describe_type(annotation, paths: dict) -> str:
    """Markdown for what a value of ``annotation`` may be."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return ", ".join(f"`{_json(v)}`" for v in typing.get_args(annotation))
    if origin is typing.Union:
        members = list(typing.get_args(annotation))
        optional = type(None) in members
        members = [m for m in members if m is not type(None)]
        parts = []
        for member in members:
            item = typing.get_args(member)[0] if typing.get_origin(member) is list else None
            if item is not None and item in members:
                parts.append("a list of them")
            else:
                parts.append(_describe_type(member, paths))
        if optional:
            parts.append("`null`")
        return " or ".join(parts)
    if origin is list:
        (item,) = typing.get_args(annotation) or (typing.Any,)
        return f"list of {_describe_type(item, paths)}"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return ", ".join(f"`{_json(m.value)}`" for m in annotation)
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        path = paths[annotation]
        return f"object, see [`{path}`](#{heading_anchor(path)})"
    if annotation in _SCALARS:
        return _SCALARS[annotation]
    return f"`{getattr(annotation, '__name__', str(annotation))}`"


def _bounds(field) -> str:
    """``>= 0, < 1`` from the field's ge/gt/le/lt constraints (lower bound first)."""
    return ", ".join(f"{op} {_json(getattr(c, attr))}" for cls, attr, op in _BOUNDS
                     for c in field.metadata if isinstance(c, cls))


def _type_cell(field, paths: dict) -> str:
    """The type, with any numeric bounds placed after the non-null part (``int >= 1 or `null```)."""
    annotation, bounds = field.annotation, _bounds(field)
    if not bounds:
        return _describe_type(annotation, paths)
    members = typing.get_args(annotation) if typing.get_origin(annotation) is typing.Union else (annotation,)
    rest = [m for m in members if m is not type(None)]
    text = " or ".join(_describe_type(m, paths) for m in rest) + " " + bounds
    return text + (" or `null`" if len(rest) < len(members) else "")


def _default_cell(field, paths: dict) -> str:
    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if isinstance(value, BaseModel) and type(value) in paths:
        path = paths[type(value)]
        return f"see [`{path}`](#{heading_anchor(path)})"
    return f"`{_json(value)}`"


def _text(doc: Optional[str]) -> str:
    """One table cell of prose: newlines collapsed, RST ``code`` as Markdown `code`, ``|`` escaped."""
    text = " ".join((doc or "").split())
    text = re.sub(r"``(.+?)``", r"`\1`", text)
    return text.replace("|", "\\|")


def render(root: type = GiftConfig, key: str = GIFT_KEY) -> str:
    """The whole of docs/config.md (for ``root`` under ``key``)."""
    found = sections(root, key)
    paths = {model: path for path, model in found}
    lines = [
        f"# `{key}` config reference",
        "",
        f"Generated by `scripts/config_reference.py` from the models in `deepspeed_gift/config.py`"
        f" (each field's docstring is its description); do not edit this file by hand. After a change"
        f" to the config, run `{COMMAND}`; `tests/test_docs.py` fails while this file is stale.",
        "",
        "Values are read strictly (`\"32\"` is not an int, `1` is not `true`), unknown keys are"
        " errors, and rules that tie keys together (which block sizes a format takes, say) are"
        " checked too and stated in the descriptions.",
        "",
        "Sections:",
        "",
    ]
    lines += [f"- [`{path}`](#{heading_anchor(path)})" for path, _ in found]
    for path, model in found:
        lines += ["", f"## `{path}`", ""]
        if model.__doc__:
            lines += [f"{_text(model.__doc__)} (`{model.__name__}`)", ""]
        lines += ["| key | type / allowed values | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            dotted = f"{path}.{_field_key(name, field)}"
            cells = [f"`{dotted}`", _type_cell(field, paths), _default_cell(field, paths), _text(field.description)]
            lines.append("| " + " | ".join(c.replace("\n", " ") for c in cells) + " |")
    return "\n".join(lines) + "\n"


def render_telemetry() -> str:
    """The whole of docs/telemetry.md."""
    lines = [
        "# Telemetry",
        "",
        f"Generated by `scripts/config_reference.py` from `deepspeed_gift.telemetry.TELEMETRY_KEYS`; do not"
        f" edit this file by hand (`{COMMAND}` rewrites it, `tests/test_docs.py` fails while it is stale).",
        "",
        "GIFT writes one record per optimizer step: in `engine.gift.records`, in `gift.telemetry.jsonl`"
        " (rank 0) and in DeepSpeed's monitor (`Gift/<key>`, when tensorboard, csv or wandb is configured)."
        " A record holds only these keys (any other fails the step: the schema is the code's). Keys marked"
        " *sampled* are written every `gift.telemetry.every` steps, where the fidelity check reduces a sample"
        " of each bucket exactly beside GIFT's reduction; on an accelerator the `*_s` timings are written on"
        " those steps only (the device is synchronized around each part there; on other steps they would"
        " time the queueing of kernels). A nan or inf in a gradient shows as a non-finite fidelity and a"
        " `nonfinite` count, and DeepSpeed skips the step as it does natively.",
        "",
        "| key | meaning |",
        "|---|---|",
    ]
    lines += [f"| `{key}` | {_text(meaning)} |" for key, meaning in TELEMETRY_KEYS.items()]
    lines += [
        "",
        "On refresh steps where layers are judged (`layers: \"measured\"`, or any geometry with sampled"
        " telemetry on) the `profile_*` keys hold that judgement's errors in every metric, never the"
        " optimizer's alone: plain L2, the whitened norm and the update the optimizer takes, each for the"
        " coordinates in use and for all-Euclidean. `profile_per_layer` (JSONL only) has each layer's"
        " errors, whether it is selected, and the kind it uses or, unselected, the one that measured best.",
    ]
    return "\n".join(lines) + "\n"


# (file, what writes it)
GENERATED = ((DOC_PATH, render), (TELEMETRY_DOC_PATH, render_telemetry))


def stale_diff(current: str, expected: str, limit: int = 40, name: str = "docs/config.md") -> str:
    """What differs between the file as it is and as it should be (unified diff, cut at ``limit`` lines)."""
    diff = list(difflib.unified_diff(current.splitlines(), expected.splitlines(),
                                     f"{name} (on disk)", f"{name} (generated)", lineterm=""))
    if len(diff) > limit:
        diff = diff[:limit] + [f"... {len(diff) - limit} more diff lines"]
    return "\n".join(diff)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="Write (or --check) docs/config.md and docs/telemetry.md from the code.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if a generated file is stale")
    args = parser.parse_args(argv)
    status = 0
    missing = undocumented()
    if missing:
        print("fields without a docstring in deepspeed_gift/config.py: " + ", ".join(missing), file=sys.stderr)
        status = 1
    for path, write in GENERATED:
        expected, name = write(), str(path.relative_to(ROOT))
        if args.check:
            current = path.read_text(encoding="utf-8") if path.exists() else ""
            if current != expected:
                print(f"{name} is stale; run {COMMAND}\n" + stale_diff(current, expected, name=name), file=sys.stderr)
                status = 1
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(expected, encoding="utf-8")
        print(f"wrote {name}")
    return status


if __name__ == "__main__":
    sys.exit(main())
