"""--lora-modules: the adapters to serve from the start, as vLLM spells them (name=path, or a JSON object
{"name": ..., "path": ...}), checked once into {name: path}."""

from __future__ import annotations

import json


def parse_lora_modules(value) -> dict[str, str]:
    """A {name: path} dict, or a list of "name=path" / JSON specs (a single string: one spec, or several
    separated by spaces, as an environment variable gives them) -> {name: path}. ValueError names a bad spec
    or a name given twice."""
    if value is None:
        return {}
    if isinstance(value, dict):
        items = list(value.items())
    else:
        specs = value.split() if isinstance(value, str) and not value.lstrip().startswith("{") else value
        items = [item for spec in ([specs] if isinstance(specs, str) else specs) for item in _spec(spec)]
    out: dict[str, str] = {}
    for name, path in items:
        if not isinstance(name, str) or not name or not isinstance(path, str) or not path:
            raise ValueError(f"lora_modules: each adapter needs a name and a path, got {name!r}={path!r}")
        if name in out:
            raise ValueError(f"lora_modules: the name {name!r} is given twice")
        out[name] = path
    return out


def _spec(spec) -> list[tuple[str, str]]:
    """One spec: name=path, vLLM's {"name": ..., "path": ...}, or a {name: path, ...} object (a dict given to
    Ray Serve's arguments arrives as its JSON)."""
    if not isinstance(spec, str):
        raise ValueError(f"lora_modules: {spec!r} is not name=path")
    spec = spec.strip()
    if spec.startswith("{"):
        try:
            obj = json.loads(spec)
        except json.JSONDecodeError as e:
            raise ValueError(f"lora_modules: {spec!r} is not valid JSON ({e})") from None
        if not isinstance(obj, dict):
            raise ValueError(f"lora_modules: {spec!r} is not a JSON object")
        if "name" in obj or "path" in obj:  # vLLM's form: both keys (a base_model_name key is allowed)
            return [(obj.get("name"), obj.get("path"))]
        return list(obj.items())
    name, sep, path = spec.partition("=")
    if not sep:
        raise ValueError(f"lora_modules: {spec!r} is not name=path")
    return [(name.strip(), path.strip())]
