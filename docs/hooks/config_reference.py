"""MkDocs hook: the configuration reference, rendered from the pydantic models at build time.

``docs/reference/config.md`` holds the placeholder ``<!-- config-reference -->``; this hook replaces it with one
table per model (key, type, default, constraints, description), so the models in ``shardopt/`` stay the one source
of truth: each optimizer's hyperparameters (``cls.Config`` of every entry of ``shardopt.optim.registry.OPTIMIZERS``),
``matrix_ops`` and its numeric ``profile``, the DeepSpeed ``"shardopt"`` section and the reference trainer's JSON.
Nested models are expanded under their key path (``matrix_ops.strategy``, ``train.steps``).

``render()`` returns the markdown; ``tests/test_docs.py`` checks that it names every key of every model.
"""

from __future__ import annotations

import enum
import json
import types
import typing
from typing import Any

PLACEHOLDER = "<!-- config-reference -->"
PAGE = "reference/config.md"


def _models() -> dict[str, Any]:
    from shardopt.optim.config import MatrixOpsConfig, OptimizerConfig, ProfileConfig
    from shardopt.optim.registry import OPTIMIZERS

    return {
        "OPTIMIZERS": OPTIMIZERS,
        "MatrixOpsConfig": MatrixOpsConfig,
        "ProfileConfig": ProfileConfig,
        "OptimizerConfig": OptimizerConfig,
    }


# ----------------------------------------------------------------------------------------------- cells
def type_name(annotation: Any) -> str:
    """A short, readable type: ``float``, ``int | None``, ``"rms" | "l2"``, ``tuple[float, float]``."""
    if annotation is type(None):
        return "null"
    if annotation is Any:
        return "any"
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin is typing.Literal:
        return " | ".join(json.dumps(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin is not None:
        name = getattr(origin, "__name__", str(origin))
        if args:
            return f"{name}[{', '.join('...' if a is Ellipsis else type_name(a) for a in args)}]"
        return name
    if isinstance(annotation, type):
        return annotation.__name__
    return str(annotation).replace("typing.", "")


def _jsonable(value: Any) -> Any:
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "model_dump"):
        return value.model_dump()
    return value


def default_text(field: Any, nested: type | None = None) -> str:
    """The default as JSON (``null`` is Python's ``None``); a nested model shows the keys it sets otherwise than
    its own defaults (``{}``: all of them)."""
    from pydantic_core import PydanticUndefined

    if field.default_factory is not None:
        value = field.default_factory()
    elif field.default is PydanticUndefined:
        return "required"
    else:
        value = field.default
    if nested is not None and hasattr(value, "model_dump"):
        base = nested().model_dump()
        value = {k: v for k, v in value.model_dump().items() if base.get(k) != v}
    try:
        return f"`{json.dumps(_jsonable(value))}`"
    except TypeError:
        return f"`{value!r}`"


def constraints(field: Any) -> str:
    marks = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    out = []
    for m in field.metadata:
        for attr, sign in marks.items():
            v = getattr(m, attr, None)
            if v is not None:
                out.append(f"{sign} {v:g}" if isinstance(v, (int, float)) else f"{sign} {v}")
    return ", ".join(out)


def _nested_model(annotation: Any) -> type | None:
    """The pydantic model inside ``annotation`` (``X``, ``X | None``), if any."""
    import pydantic

    for a in (annotation, *typing.get_args(annotation)):
        if isinstance(a, type) and issubclass(a, pydantic.BaseModel):
            return a
    return None


def _description(model: type, key: str, field: Any) -> str:
    """The field's description; where a subclass redefines a field without one, the description of the same key
    in its bases (Muon's ``weight_decay``); a nested model's first docstring line."""
    if field.description:
        return field.description
    for other in model.__mro__[1:]:
        f = getattr(other, "model_fields", {}).get(key)
        if f is not None and f.description:
            return f.description
    nested = _nested_model(field.annotation)
    if nested is not None and nested.__doc__:
        return nested.__doc__.strip().splitlines()[0]
    return ""


def _cell(text: str) -> str:
    return " ".join(str(text).split()).replace("|", "\\|")


# ----------------------------------------------------------------------------------------------- tables
def model_table(
    model: type,
    prefix: str = "",
    links: dict[str, str] | None = None,
    extra_nested: dict[str, type] | None = None,
    order: list[str] | None = None,
) -> str:
    """One markdown table: a row per field of ``model`` (keys under ``prefix``, in ``order`` if given), nested
    models named by link."""
    rows = ["| key | type | default | constraints | description |", "|---|---|---|---|---|"]
    for key in order or model.model_fields:
        field = model.model_fields[key]
        nested = _nested_model(field.annotation) or (extra_nested or {}).get(key)
        name = f"`{prefix}{key}`"
        if nested is not None and links and key in links:
            name = f"[{name}]({links[key]})"
        kind = type_name(field.annotation)
        if (extra_nested or {}).get(key) is not None:
            kind = f"{kind} (name or {extra_nested[key].__name__})"
        rows.append(
            "| "
            + " | ".join(
                _cell(c)
                for c in (
                    name,
                    kind,
                    default_text(field, _nested_model(field.annotation)),
                    constraints(field),
                    _description(model, key, field) or "-",
                )
            )
            + " |"
        )
    return "\n".join(rows) + "\n"


def _expand(model: type, path: str, level: int, seen: set, out: list[str], extra: dict[tuple, type]) -> None:
    """Sections for the models nested in ``model`` (depth first), each under its key path."""
    for key, field in model.model_fields.items():
        nested = _nested_model(field.annotation) or extra.get((model, key))
        if nested is None or (nested, f"{path}{key}") in seen:
            continue
        seen.add((nested, f"{path}{key}"))
        full = f"{path}{key}"
        doc = (nested.__doc__ or "").strip()
        out.append(f"{'#' * level} `{full}` ({nested.__name__})\n\n" + (f"{' '.join(doc.split())}\n\n" if doc else ""))
        out.append(model_table(nested, f"{full}.", extra_nested={k: m for (o, k), m in extra.items() if o is nested}))
        out.append("\n")
        _expand(nested, f"{full}.", level + 1, seen, out, extra)


def render() -> str:
    """The whole reference (markdown)."""
    from shardopt.plugin.deepspeed_engine import ShardoptSection
    from shardopt.train.config import TrainConfig

    m = _models()
    optimizers, MatrixOps, Profile, Common = (
        m["OPTIMIZERS"],
        m["MatrixOpsConfig"],
        m["ProfileConfig"],
        m["OptimizerConfig"],
    )
    out = []
    out.append(
        "## Optimizers\n\nEach optimizer's hyperparameters: the keyword arguments of `create_optimizer(model, "
        'name, **hyperparameters)` and of the class, the `params` of the DeepSpeed `"shardopt"` section and '
        "the trainer's `optimizer.params`. Unknown keys are an error naming the key path. The keys shared by "
        f"every optimizer come from `{Common.__name__}` (the AdamW part, the non-finite policy, plan checks); "
        "whole-matrix optimizers add [`matrix_ops`](#matrix_ops). Defaults are JSON (`null` is Python's `None`); "
        "a nested model's default lists the keys it sets otherwise than that model's defaults (`{}`: none).\n\n"
    )
    out.append("| name | class | model | algorithm |\n|---|---|---|---|\n")
    for name, cls in optimizers.items():
        page = "alice" if name.startswith("alice") else "asgo" if name in ("asgo", "dasgo") else name
        out.append(
            f"| [`{name}`](#{name}) | `shardopt.{cls.__name__}` | `{cls.Config.__module__}.{cls.Config.__name__}` "
            f"| [{page}](../algorithms/{page}.md) |\n"
        )
    out.append("\n")
    for name, cls in optimizers.items():
        model = cls.Config
        own = [k for k in model.model_fields if k not in Common.model_fields and k != "matrix_ops"]
        doc = " ".join((model.__doc__ or "").split())
        out.append(
            f"### `{name}` {{#{name}}}\n\n`{model.__module__}.{model.__name__}`" + (f": {doc}" if doc else "") + "\n\n"
        )
        out.append(f"Its own keys: {', '.join(f'`{k}`' for k in own) or 'none'}; the rest are common.\n\n")
        order = own + [k for k in model.model_fields if k not in own]  # its own keys first, then the common ones
        out.append(model_table(model, links={"matrix_ops": "#matrix_ops"}, order=order))
        out.append("\n")
    out.append(
        "## `matrix_ops` {#matrix_ops}\n\n"
        f"`{MatrixOps.__module__}.{MatrixOps.__name__}`: {' '.join((MatrixOps.__doc__ or '').split())} "
        "Taken by the whole-matrix optimizers ("
        + ", ".join(f"`{n}`" for n, c in optimizers.items() if "matrix_ops" in c.Config.model_fields)
        + '); in a DeepSpeed JSON under `"shardopt": {"params": {"matrix_ops": {...}}}`.\n\n'
    )
    out.append(
        model_table(
            MatrixOps, "matrix_ops.", links={"profile": "#matrix_opsprofile"}, extra_nested={"profile": Profile}
        )
    )
    out.append(
        "\n### `matrix_ops.profile` {#matrix_opsprofile}\n\n"
        f'`"auto"`, `"gpu"`, `"cpu"`, or numbers: `{Profile.__module__}.{Profile.__name__}`: '
        f"{' '.join((Profile.__doc__ or '').split())}\n\n"
    )
    out.append(model_table(Profile, "matrix_ops.profile."))
    out.append(
        '\n## DeepSpeed `"shardopt"` section\n\n'
        f"`{ShardoptSection.__module__}.{ShardoptSection.__name__}`: "
        f"{' '.join((ShardoptSection.__doc__ or '').split())}\n\n"
    )
    out.append(model_table(ShardoptSection, "shardopt."))
    out.append(
        "\n## Reference trainer (`python -m shardopt.train --config`)\n\n"
        f"`{TrainConfig.__module__}.{TrainConfig.__name__}`; `--set key.path=value` overrides any key.\n\n"
    )
    out.append(model_table(TrainConfig))
    out.append("\n")
    _expand(TrainConfig, "", 3, set(), out, {})
    return "".join(out)


def on_page_markdown(markdown: str, page: Any, **kwargs: Any) -> str:
    if page.file.src_uri == PAGE:
        if PLACEHOLDER not in markdown:
            raise ValueError(f"{PAGE}: the placeholder {PLACEHOLDER} is missing")
        return markdown.replace(PLACEHOLDER, render())
    return markdown
