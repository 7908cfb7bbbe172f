"""OpenAI's ``response_format``, checked at the edge: its canonical form (``None`` for text,
``{"type": "json_object"}``, or ``{"type": "json_schema", "schema": {...}}``) and its *grammar key*,
the canonical text a request's sampler carries (``SamplingParams.grammar``; ``GRAMMAR_OFF``: none).
A schema the grammar engine (xgrammar) cannot compile is refused here, before any replica works;
``eyas.verification.grammar`` compiles and enforces it."""

from __future__ import annotations

import json
import re
from typing import Any

GRAMMAR_OFF = ""  # the key of "no grammar"
MAX_SCHEMA_BYTES = 64 * 1024  # a response format's JSON text; a larger one is refused, naming the field


def canonical_response_format(value: Any) -> dict | None:
    """OpenAI's ``response_format`` -> ``None`` (text), ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "schema": {...}}``; a schema xgrammar cannot compile is refused here,
    before any replica works: ``ValueError`` whose message names ``response_format``. Also takes
    ``{"type": "json_schema", "schema": {...}}`` (the canonical form itself)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise ValueError(f"response_format: expected an object with a 'type', got {type(value).__name__}")
    kind = value.get("type")
    extra = sorted(set(value) - {"type", "json_schema", "schema"})
    if extra:
        raise ValueError(f"response_format: unknown field {extra[0]!r}")
    if kind == "text":
        return None
    if kind == "json_object":
        xgrammar()  # refused here, at the edge, when the engine is missing
        return {"type": "json_object"}
    if kind != "json_schema":
        raise ValueError(f"response_format.type: expected 'text', 'json_object' or 'json_schema', got {kind!r}")
    if "schema" in value:
        schema = value["schema"]
    else:
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise ValueError("response_format.json_schema: expected an object with a 'schema'")
        schema = spec["schema"]
    if not isinstance(schema, dict):
        raise ValueError(f"response_format.json_schema.schema: expected a JSON object, got {type(schema).__name__}")
    text = json.dumps(schema, separators=(",", ":"))  # key order kept: a schema's property order is the output's
    if len(text.encode()) > MAX_SCHEMA_BYTES:
        raise ValueError(f"response_format.json_schema.schema: at most {MAX_SCHEMA_BYTES} bytes of JSON")
    xgr = xgrammar()
    try:
        xgr.Grammar.from_json_schema(text)
    except Exception as err:  # noqa: BLE001 - xgrammar raises several types; the client gets the reason
        raise ValueError(
            f"response_format.json_schema.schema: xgrammar cannot compile it ({xgrammar_reason(err)})"
        ) from None
    return {"type": "json_schema", "schema": schema}


def xgrammar_reason(err: Exception) -> str:
    """xgrammar's message without its log prefix (time, source file and line: internals)."""
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)[:200]


def xgrammar():
    """The grammar engine, or a ``ValueError`` naming ``response_format`` when it is not installed."""
    try:
        import xgrammar as xgr
    except ImportError:
        raise ValueError(
            "response_format: structured output needs xgrammar, which is not installed here "
            "(pip install 'eyas[structured]')"
        ) from None
    return xgr


def grammar_key(fmt: dict | None) -> str:
    """The canonical text of a canonical response format (:func:`canonical_response_format`)."""
    return GRAMMAR_OFF if fmt is None else json.dumps(fmt, separators=(",", ":"))
