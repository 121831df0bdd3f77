"""Loading a configuration: a named preset (`presets/`) with a user's YAML file and overrides laid
over it (`load_config`), or a config rebuilt from its own YAML in a pipeline task (`config_from_yaml`).

The YAML is read by a strict loader (no aliases, a nesting limit, no repeated keys), and validation
errors become one `ConfigError` that names each key. Kept apart from `config`, which is the typed
model and the checks every config must pass however it was made: this is where one comes from.
"""

from __future__ import annotations

import os
import reprlib
from importlib import resources
from pathlib import Path

import yaml
from pydantic import ValidationError

from dynamicrubric.infra.config import Config
from dynamicrubric.infra.config_sections import DEFAULT_PRESET, PRESETS, TENSOR_PARALLEL_ENV, ConfigError


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


def preset_dict(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"preset: unknown preset {name!r}; expected one of {list(PRESETS)}")
    text = resources.files("dynamicrubric").joinpath("presets", f"{name}.yaml").read_text()
    return yaml.safe_load(text) or {}


# Keys that moved: an old config gets the new key's name, not only "unknown key".
MOVED_KEYS = {"models.reference_judge_url": "guard.gold_judge.url (a judge is named the same way everywhere)"}


def _format_error(err: ValidationError, source: str) -> str:
    lines = []
    for e in err.errors():
        key = ".".join(str(p) for p in e["loc"]) or "<root>"
        if e["type"] == "extra_forbidden" and key in MOVED_KEYS:
            lines.append(f"{source}: {key} is now {MOVED_KEYS[key]}")
        elif e["type"] == "extra_forbidden":
            lines.append(f"{source}: unknown key {key!r}")
        elif not e["loc"]:  # a check across sections: its input would be the whole config
            lines.append(f"{source}: {e['msg'].removeprefix('Value error, ')}")
        else:
            # reprlib: a value of any size is shown in a few dozen characters, never printed whole
            lines.append(f"{source}: {key}: {e['msg']} (got {reprlib.repr(e.get('input'))})")
    return "\n".join(lines)


# A config is a few sections deep; far deeper nesting is a mistake or an attack (a 5,000-deep list
# overflowed Python's stack in the YAML composer).
MAX_CONFIG_DEPTH = 32


class _Refused(yaml.YAMLError):
    """YAML the config reader does not take, though it is valid YAML."""


class _ConfigLoader(yaml.SafeLoader):
    """safe_load without aliases and with a nesting limit. An alias (*name) reuses a node without
    copying it, so a 0.4 KB file of nested aliases expands to gigabytes once anything walks the value
    (validation, or an error message that prints it); a config has no need for them."""

    depth = 0

    def compose_node(self, parent, index):
        if self.check_event(yaml.AliasEvent):
            line = self.peek_event().start_mark.line + 1
            raise _Refused(
                f"line {line}: YAML aliases (*name) are not allowed in a config; write the value out"
            )
        if self.depth >= MAX_CONFIG_DEPTH:
            line = self.peek_event().start_mark.line + 1
            raise _Refused(f"line {line}: nested more than {MAX_CONFIG_DEPTH} levels deep")
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node, deep=False):
        # PyYAML keeps the last of two equal keys without a word: `k: 8` then `k: 1000` further down
        # silently means 1000. A config says each key once.
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=True)
                line = key_node.start_mark.line + 1
                if isinstance(key, str | int | float | bool):
                    if key in seen:
                        raise _Refused(f"line {line}: key {key!r} repeats the one on line {seen[key]}")
                    seen[key] = line
        return super().construct_mapping(node, deep=deep)


def load_config(
    path: str | Path | None = None, preset: str | None = None, overrides: dict | None = None
) -> Config:
    """Load a preset, lay a YAML file and then `overrides` over it, and validate the result."""
    user: dict = {}
    source = "<defaults>"
    if path is not None:
        source = str(path)
        try:
            user = yaml.load(Path(path).read_text(), Loader=_ConfigLoader) or {}  # noqa: S506 (a SafeLoader)
        except FileNotFoundError:
            raise ConfigError(f"{path}: no such config file") from None
        except UnicodeDecodeError as e:
            raise ConfigError(f"{path}: not UTF-8 text (invalid byte at offset {e.start})") from None
        except OSError as e:
            raise ConfigError(f"{path}: cannot read the config file: {e.strerror}") from None
        except _Refused as e:
            raise ConfigError(f"{path}: {e}") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: not valid YAML: {e}".splitlines()[0]) from None
        if not isinstance(user, dict):
            raise ConfigError(f"{path}: expected a mapping of sections at the top level")
    name = preset or user.get("preset") or DEFAULT_PRESET
    data = _merge(preset_dict(name), user)
    data = _merge(data, overrides or {})
    data["preset"] = name
    try:
        return Config.model_validate(data)
    except ValidationError as e:
        raise ConfigError(_format_error(e, source)) from None


def config_from_yaml(text: str) -> Config:
    """Rebuild a config from `Config.to_yaml()` output (how pipeline components receive it).

    In a pipeline task whose pod carries `DYNRUBRIC_TENSOR_PARALLEL_SIZE` (set at compile time from the
    stage's `pipeline.resources.<stage>.gpus`), that value becomes `engine.tensor_parallel_size`, so
    vLLM shards each model over exactly the GPUs the task requested.
    """
    try:
        cfg = Config.model_validate(yaml.safe_load(text))
    except ValidationError as e:
        raise ConfigError(_format_error(e, "<config yaml>")) from None
    value = os.environ.get(TENSOR_PARALLEL_ENV, "").strip()
    if not value:
        return cfg
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(
            f"{TENSOR_PARALLEL_ENV}={value!r}: expected a positive integer (the task's GPU count)"
        )
    return cfg.model_copy(
        update={"engine": cfg.engine.model_copy(update={"tensor_parallel_size": int(value)})}
    )
