"""Write attnscope/anatomy/defaults.json: what `attnscope anatomy` needs from transformers' config classes,
read once here so that anatomy itself never imports transformers (whose config classes import torch).

    python scripts/anatomy_defaults.py            # rewrite the file from the installed transformers
    python scripts/anatomy_defaults.py --check    # exit 1 if the file differs from what it would write

For every model_type transformers knows (CONFIG_MAPPING):
- `fields`: the class defaults of the settings anatomy reads (anatomy_config.FIELDS) that are fixed values, not
  derived in `__post_init__` (those default to None in the class and are left out: anatomy derives them);
- `rope_default`: the `rope_parameters` a default instance builds, where the class default is None (GPT-OSS's yarn);
- `attribute_map`, `default_theta` (where not 10000), `text_config` (the model_type of its text part);
- `causal`: true or false where every `is_causal = <literal>` in the family's modeling files agrees;
- `layer_kinds`: the layer types of a default instance, where some are not attention (mamba, linear attention).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import re
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
OUT = ROOT / "attnscope" / "anatomy" / "defaults.json"

from attnscope.anatomy.config import FIELDS  # noqa: E402

DERIVED = {"layer_types"}  # per layer: derived from the number of layers, never a fixed default


def class_defaults(cls: type) -> dict[str, Any]:
    """Defaults of the constructor's parameters (4.x) or the dataclass fields (5.x)."""
    found: dict[str, Any] = {}
    if dataclasses.is_dataclass(cls):
        for field in dataclasses.fields(cls):
            if field.default is not dataclasses.MISSING:
                found[field.name] = field.default
            elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
                found[field.name] = field.default_factory()  # type: ignore[misc]
    for name, parameter in inspect.signature(cls.__init__).parameters.items():
        if parameter.default is not inspect.Parameter.empty:
            found.setdefault(name, parameter.default)
    return found


def jsonable(value: Any) -> bool:
    try:
        json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        return False
    return True


def text_type(cls: type) -> str | None:
    specs = getattr(cls, "sub_configs_defaults", None) or {}
    spec = specs.get("text_config")
    if spec is not None:
        for holder in (spec, getattr(spec, "config_class", None)):
            model_type = getattr(holder, "model_type", None)
            if isinstance(model_type, str) and model_type:
                return model_type
    sub = (getattr(cls, "sub_configs", None) or {})
    if isinstance(sub, dict) and "text_config" in sub:
        try:
            return str(cls().text_config.model_type)
        except Exception:  # noqa: BLE001 - a composite that cannot build its default: no text part known
            return None
    return None


def causal(module_name: str) -> bool | None:
    import transformers

    folder = Path(transformers.__file__).parent / "models" / module_name
    said = set()
    for path in folder.glob("modeling_*.py"):
        said |= set(re.findall(r"\bis_causal\s*=\s*(\w+(?:\.\w+)*)", path.read_text(encoding="utf-8")))
    literal = said & {"True", "False"}
    if not said or said != literal or len(literal) != 1:
        return None
    return literal == {"True"}


def entry(model_type: str, cls: type, module_name: str, base: dict[str, Any]) -> dict[str, Any]:
    defaults = class_defaults(cls)
    fields = {name: defaults[name] for name in FIELDS  # what every config has (is_decoder False) says nothing
              if name not in DERIVED and defaults.get(name) is not None and jsonable(defaults[name])
              and not (name in base and base[name] == defaults[name])}
    found: dict[str, Any] = {"fields": fields}
    if "rope_parameters" in defaults and defaults["rope_parameters"] is None:
        try:
            built = cls().rope_parameters
        except Exception:  # noqa: BLE001 - a default that cannot be built: nothing to record
            built = None
        if built and jsonable(built):
            found["rope_default"] = built
    found["rope"] = any(name in defaults for name in ("rope_parameters", "rope_theta", "rope_scaling"))
    if getattr(cls, "attribute_map", None):
        found["attribute_map"] = dict(cls.attribute_map)
    theta = getattr(cls, "default_theta", 10_000.0)
    if theta != 10_000.0 and jsonable(theta):
        found["default_theta"] = theta
    if (text := text_type(cls)) is not None:
        found["text_config"] = text
    if (is_causal := causal(module_name)) is not None:
        found["causal"] = is_causal
    kinds = layer_kinds(cls)
    if kinds - {"full_attention", "sliding_attention", "chunked_attention"}:
        found["layer_kinds"] = sorted(kinds)
    return found


def layer_kinds(cls: type) -> set[str]:
    """The layer types a default instance has: where they go beyond attention (mamba, linear attention), anatomy
    says so for a config that does not list them."""
    try:
        types = cls().layer_types
    except Exception:  # noqa: BLE001 - no layer_types, or none that a default instance can build
        return set()
    return {t for t in types if isinstance(t, str)} if isinstance(types, (list, tuple)) else set()


def build() -> dict[str, Any]:
    import logging

    import transformers
    from transformers import PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING, model_type_to_module_name

    logging.disable(logging.WARNING)
    families = {}
    base = class_defaults(PretrainedConfig)
    for model_type in sorted(CONFIG_MAPPING.keys()):
        try:
            cls = CONFIG_MAPPING[model_type]
        except Exception as exc:  # noqa: BLE001 - a class that does not import here is left out, and said
            print(f"skipped {model_type}: {type(exc).__name__}: {exc}", file=sys.stderr)
            continue
        families[model_type] = entry(model_type, cls, model_type_to_module_name(model_type), base)
    return {"transformers": transformers.__version__, "families": families}


def main() -> int:
    text = json.dumps(build(), indent=0, sort_keys=True, separators=(",", ":")) + "\n"
    if "--check" in sys.argv[1:]:
        same = OUT.exists() and OUT.read_text(encoding="utf-8") == text
        print(f"{OUT.relative_to(ROOT)} is {'up to date' if same else 'stale: run scripts/anatomy_defaults.py'}")
        return 0 if same else 1
    OUT.write_text(text, encoding="utf-8")
    print(f"wrote {OUT.relative_to(ROOT)} ({len(text)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
