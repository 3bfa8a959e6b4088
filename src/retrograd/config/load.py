"""Load run.toml: parse, apply --set overrides, validate strictly, resolve paths, fingerprint.

Errors name the file and line (malformed TOML), the key (unknown, wrong type, out of range) and a
close valid key. Relative paths resolve against the TOML's folder. The result is frozen.
"""
from __future__ import annotations

import dataclasses
import difflib
import json
import math
import os
import re
import sys
from pathlib import Path
from typing import Any, Optional, Union, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

from retrograd.config import schema
from retrograd.config.schema import RunConfig
from retrograd.errors import ConfigError


def _closest(name: str, candidates) -> str:
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.5)
    return f" (did you mean '{match[0]}'?)" if match else ""


def _parse_toml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"config file not found: {path}") from None
    except IsADirectoryError:
        raise ConfigError(f"config path is a folder, not a TOML file: {path}") from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # tomllib says "... (at line L, column C)"; put the location first, as compilers do
        msg = str(e)
        m = re.search(r"\(at line (\d+), column (\d+)\)", msg)
        if m:
            line = int(m.group(1))
            src = text.splitlines()[line - 1] if 0 < line <= len(text.splitlines()) else ""
            msg = msg[: m.start()].strip()
            raise ConfigError(f"{path}:{line}:{m.group(2)}: malformed TOML: {msg}\n    {src}") from None
        raise ConfigError(f"{path}: malformed TOML: {msg}") from None


def parse_override(expr: str) -> tuple[list[str], Any]:
    """`training.lr=1e-5` -> (["training", "lr"], 1e-5). The value is read as a TOML value; a bare
    word that is not valid TOML (e.g. `cosine`, a path) is taken as a string."""
    if "=" not in expr:
        raise ConfigError(f"--set {expr!r}: expected KEY=VALUE, e.g. --set training.lr=1e-5")
    key, raw = expr.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if len(parts) < 2 or not all(parts):
        raise ConfigError(f"--set {expr!r}: the key must be TABLE.KEY, e.g. training.lr")
    try:
        value = tomllib.loads(f"v = {raw.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = raw.strip()
    return parts, value


def apply_overrides(data: dict, overrides: list[str]) -> dict:
    for expr in overrides or []:
        parts, value = parse_override(expr)
        node = data
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            if not isinstance(node, dict):
                raise ConfigError(f"--set {expr!r}: '{p}' is a value, not a table")
        node[parts[-1]] = value
    return data


def _type_name(tp) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            list: "a list", dict: "a table"}.get(tp, str(tp))


def _check_value(where: str, value: Any, tp, meta: dict) -> Any:
    """Check one value against its declared type and range; return it normalised."""
    if get_origin(tp) is Union:  # Optional[X]
        tp = [a for a in get_args(tp) if a is not type(None)][0]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
        list: isinstance(value, list),
        dict: isinstance(value, dict),
    }.get(tp, True)
    if not ok:
        raise ConfigError(f"{where}: expected {_type_name(tp)}, got {value!r}")
    if tp is float:
        value = float(value)
        if not math.isfinite(value):
            raise ConfigError(f"{where}: {value!r} is not a finite number")
    if tp is list and where.endswith("lora.targets"):
        if not value or not all(isinstance(v, str) and v for v in value):
            raise ConfigError(f"{where}: expected a non-empty list of module names, got {value!r}")
    if meta["choices"] and value not in meta["choices"]:
        raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, meta['choices']))}"
                          + (_closest(str(value), meta["choices"]) if isinstance(value, str) else ""))
    lo, hi = meta["min"], meta["max"]
    if lo is not None and (value < lo or (meta["min_exclusive"] and value == lo)):
        raise ConfigError(f"{where}: {value!r} is out of range (must be {'>' if meta['min_exclusive'] else '>='} {lo})")
    if hi is not None and (value > hi or (meta["max_exclusive"] and value == hi)):
        raise ConfigError(f"{where}: {value!r} is out of range (must be {'<' if meta['max_exclusive'] else '<='} {hi})")
    return value


def _resolve_path(value: str, base: Path) -> str:
    if value.startswith("builtin:"):
        return value
    p = Path(os.path.expanduser(value))
    return str(p if p.is_absolute() else (base / p).resolve())


def _build_table(name: str, cls, raw: Any, src: Path, base: Path):
    if not isinstance(raw, dict):
        raise ConfigError(f"{src}: [{name}] must be a table, got {raw!r}")
    hints = get_type_hints(cls)
    known = schema.table_fields(cls)
    for key in raw:
        if key not in known:
            hint = schema.FOREIGN_KEYS.get(f"{name}.{key}")
            if hint:
                raise ConfigError(f"{src}: {name}.{key}: {hint}")
            raise ConfigError(f"{src}: unknown key '{key}' in [{name}]{_closest(key, known)}; "
                              f"valid keys: {', '.join(known)}")
    values = {}
    for key, f in known.items():
        meta = f.metadata
        if key not in raw:
            if meta["required"]:
                raise ConfigError(f"{src}: [{name}] is missing the required key '{key}' ({meta['help']})")
            continue
        v = _check_value(f"{src}: {name}.{key}", raw[key], hints[key], meta)
        if meta["path"] and v is not None:
            v = _resolve_path(v, base)
        values[key] = v
    return cls(**values)


def load_config(path: Union[str, Path], overrides: Optional[list[str]] = None) -> RunConfig:
    src = Path(path).resolve() if Path(path).exists() else Path(path)
    data = apply_overrides(_parse_toml(src), overrides or [])
    base = src.parent
    for name in data:
        if name not in schema.TABLES and name not in schema.ALGORITHM_TABLES:
            raise ConfigError(f"{src}: unknown table [{name}]{_closest(name, schema.TABLES)}; "
                              f"valid tables: {', '.join(schema.TABLES)}")
    for required in ("run", "model", "output"):
        if required not in data:
            raise ConfigError(f"{src}: missing table [{required}]")
    run = _build_table("run", schema.RunTable, data["run"], src, base)
    algo = run.algorithm
    if algo not in schema.SUPPORTED_ALGORITHMS:
        raise ConfigError(f"{src}: run.algorithm = {algo!r} is not available in this version of "
                          f"retrograd; supported: {', '.join(schema.SUPPORTED_ALGORITHMS)}")
    for table, owner in schema.ALGORITHM_TABLES.items():
        if table in data and owner != algo:
            raise ConfigError(f"{src}: table [{table}] does not apply to run.algorithm = {algo!r}; "
                              f"remove it or set algorithm = {owner!r}")
    if algo not in data:
        raise ConfigError(f"{src}: run.algorithm = {algo!r} needs a [{algo}] table (at least its 'data' key)")

    tables = {"run": run}
    for name, cls in schema.TABLES.items():
        if name != "run" and name in data:
            tables[name] = _build_table(name, cls, data[name], src, base)
    lora_raw = data.get("lora", {})
    if isinstance(lora_raw, dict) and lora_raw.get("init_adapter"):
        clash = [k for k in ("rank", "alpha", "targets", "seed") if k in lora_raw]
        if clash:
            raise ConfigError(f"{src}: lora.{clash[0]} cannot be set together with lora.init_adapter: rank, alpha "
                              "and targets are read from the adapter (and it needs no init seed)")
    tables.setdefault("training", schema.TrainingTable())
    if tables["training"].trainable == "lora" and "lora" not in tables:
        tables["lora"] = schema.LoraTable()  # no [lora] table means LoRA with defaults, as in retrograd-rs
    tables.setdefault("metrics", schema.MetricsTable())
    cfg = RunConfig(**tables, source=str(src))
    _cross_checks(cfg, src)
    cfg = _resolve_preference(cfg, src)
    cfg = _resolve_grpo(cfg, src, base)
    cfg = _resolve_ppo(cfg, src, base)
    cfg = _resolve_distill(cfg, src, base)
    if cfg.model.path and not cfg.model.path.startswith("builtin:"):
        # a model path that exists relative to the TOML resolves there; otherwise it stays an alias
        candidate = (base / os.path.expanduser(cfg.model.path))
        if candidate.exists():
            cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, path=str(candidate.resolve())))
    name = cfg.run.name or src.stem
    directory = cfg.run.directory or str((base / "runs" / name).resolve())
    return dataclasses.replace(cfg, run=dataclasses.replace(cfg.run, name=name, directory=directory))


def _resolve_grpo(cfg: RunConfig, src: Path, base: Path) -> RunConfig:
    """Build the [grpo.*] sub-tables with the same checks as top-level tables."""
    g = cfg.grpo
    if g is None:
        return cfg
    subs = {}
    for key, cls in schema.GRPO_SUBTABLES.items():
        raw = getattr(g, key)
        subs[key] = None if raw is None else _build_table(f"grpo.{key}", cls, raw, src, base)
    sampling = subs["sampling"]
    if cfg.reference is not None and g.kl_coefficient == 0:
        raise ConfigError(f"{src}: [reference] is only used by the KL term, and grpo.kl_coefficient = 0")
    if not g.rewards and not g.reward_command and g.judge is None:
        raise ConfigError(f"{src}: [grpo] needs at least one reward: [[grpo.rewards]] tables, reward_command or "
                          "[grpo.judge]")
    subs["judge"] = _resolve_judge(g, "grpo", src, base)
    if sampling.max_new_tokens >= cfg.training.ctx:
        raise ConfigError(f"{src}: grpo.sampling.max_new_tokens = {sampling.max_new_tokens} leaves no room for the "
                          f"prompt in training.ctx = {cfg.training.ctx}")
    ov = subs["overlong_penalty"]
    if ov is not None and ov.buffer_tokens > sampling.max_new_tokens:
        raise ConfigError(f"{src}: grpo.overlong_penalty.buffer_tokens must be <= grpo.sampling.max_new_tokens")
    from retrograd.config.rl import resolve_credit, resolve_policy_loss
    g = resolve_policy_loss(resolve_credit(dataclasses.replace(g, **subs), src, base), src, base)
    return dataclasses.replace(cfg, grpo=g)


def _resolve_ppo(cfg: RunConfig, src: Path, base: Path) -> RunConfig:
    """Build the [ppo.*] sub-tables and check what PPO needs."""
    p = cfg.ppo
    if p is None:
        return cfg
    subs = {key: None if getattr(p, key) is None else _build_table(f"ppo.{key}", cls, getattr(p, key), src, base)
            for key, cls in schema.PPO_SUBTABLES.items()}
    if not p.rewards and not p.reward_command and p.judge is None:
        raise ConfigError(f"{src}: [ppo] needs at least one reward: [[ppo.rewards]] tables, reward_command or "
                          "[ppo.judge]")
    subs["judge"] = _resolve_judge(p, "ppo", src, base)
    if subs["judge"] is not None and subs["judge"].mode != "pointwise":
        raise ConfigError(f"{src}: ppo.judge.mode = {subs['judge'].mode!r} compares a group's completions; PPO "
                          "samples one completion per prompt: use mode = \"pointwise\"")
    if subs["sampling"].max_new_tokens >= cfg.training.ctx:
        raise ConfigError(f"{src}: ppo.sampling.max_new_tokens = {subs['sampling'].max_new_tokens} leaves no room for "
                          f"the prompt in training.ctx = {cfg.training.ctx}")
    if 0 < p.clip_ratio_c <= 1:
        raise ConfigError(f"{src}: ppo.clip_ratio_c = {p.clip_ratio_c} must be > 1 (or 0 to turn dual-clip off)")
    critic = subs["critic"]
    if not critic.enabled and critic != schema.PpoCriticTable(enabled=False):
        raise ConfigError(f"{src}: [ppo.critic] enabled = false: its other keys are not read; remove them")
    if (critic.critic == "model") != (critic.model is not None):
        raise ConfigError(f"{src}: ppo.critic.model names the value model of critic = \"model\" (and only then)")
    if critic.critic != "model" and critic.rank != schema.PpoCriticTable().rank:
        raise ConfigError(f"{src}: ppo.critic.rank is read by critic = \"model\" only")
    return dataclasses.replace(cfg, ppo=dataclasses.replace(p, **subs))


def _resolve_judge(table, name: str, src: Path, base: Path):
    """[<name>.judge] built and checked, with its weight; None without a judge."""
    if table.judge is None:
        if table.judge_weight is not None:
            raise ConfigError(f"{src}: {name}.judge_weight weighs a judge; add a [{name}.judge] table or remove it")
        return None
    if table.judge_weight is None:
        raise ConfigError(f"{src}: [{name}.judge] needs {name}.judge_weight (the reward is reward + judge_weight x "
                          "verdict, the verdict in [0, 1])")
    judge = _build_table(f"{name}.judge", schema.JudgeTable, table.judge, src, base)
    if not judge.base_url.startswith(("http://", "https://")):
        raise ConfigError(f"{src}: {name}.judge.base_url = {judge.base_url!r} must start with http:// or https://")
    if judge.mode == "pairwise" and getattr(table, "group_size", 2) < 2:
        raise ConfigError(f"{src}: {name}.judge.mode = \"pairwise\" needs groups of at least 2 completions")
    return judge


def _resolve_distill(cfg: RunConfig, src: Path, base: Path) -> RunConfig:
    """Keys of the other mode are refused; the chosen mode's unset keys get their defaults."""
    d = cfg.distill
    if d is None:
        return cfg
    mine, theirs = ((schema.DISTILL_ON_POLICY, schema.DISTILL_OFFLINE) if d.mode == "on_policy"
                    else (schema.DISTILL_OFFLINE, schema.DISTILL_ON_POLICY))
    wrong = [k for k in theirs if getattr(d, k) is not None]
    if wrong:
        raise ConfigError(f"{src}: distill.{wrong[0]} is not read by mode = {d.mode!r}; remove it")
    missing = [k for k, v in mine.items() if v is None and getattr(d, k) is None]
    if missing:
        raise ConfigError(f"{src}: [distill] mode = {d.mode!r} needs {missing[0]}")
    filled = {k: getattr(d, k) if getattr(d, k) is not None else v for k, v in mine.items()}
    if d.mode == "on_policy":
        filled["sampling"] = _build_table("distill.sampling", schema.GrpoSamplingTable, filled["sampling"], src, base)
        if filled["sampling"].max_new_tokens >= cfg.training.ctx:
            raise ConfigError(f"{src}: distill.sampling.max_new_tokens leaves no room for the prompt in training.ctx")
    if d.mode == "topk_offline" and cfg.training.epochs != 1:
        raise ConfigError(f"{src}: offline distillation counts its passes in distill.offline_epochs, not "
                          "training.epochs")
    teacher = base / os.path.expanduser(d.teacher_path)
    if teacher.exists():
        filled["teacher_path"] = str(teacher.resolve())
    return dataclasses.replace(cfg, distill=dataclasses.replace(d, **filled))


PREFERENCE_BETA = {"dpo": 0.1, "ipo": 0.1, "simpo": 2.0, "orpo": 0.1}


def _resolve_preference(cfg: RunConfig, src: Path) -> RunConfig:
    """Refuse [preference] keys the chosen loss does not read, then fill the loss's defaults."""
    if cfg.reference is not None and cfg.run.algorithm not in ("preference", "grpo", "distill"):  # (PPO's KL is toward the rollout policy)
        raise ConfigError(f"{src}: [reference] does not apply to run.algorithm = {cfg.run.algorithm!r}")
    pc = cfg.preference
    if pc is None:
        return cfg
    unread = {"label_smoothing": ("dpo",), "gamma_beta_ratio": ("simpo",), "reference": ("dpo", "ipo")}
    for key, losses in unread.items():
        if getattr(pc, key) is not None and pc.loss not in losses:
            raise ConfigError(f"{src}: preference.{key} is not read by loss = {pc.loss!r} (only by "
                              f"{' / '.join(losses)}); remove it")
    if cfg.reference is not None:
        if pc.loss not in ("dpo", "ipo"):
            raise ConfigError(f"{src}: [reference] is not read by preference.loss = {pc.loss!r} (simpo and orpo "
                              "use no reference); remove the table")
        if pc.reference is not None:
            raise ConfigError(f"{src}: give preference.reference or a [reference] model, not both")
        if cfg.reference.ctx not in (None, cfg.training.ctx):
            raise ConfigError(f"{src}: reference.ctx = {cfg.reference.ctx} must equal training.ctx = "
                              f"{cfg.training.ctx}: the reference scores the same token sequences")
    filled = dataclasses.replace(
        pc, beta=pc.beta if pc.beta is not None else PREFERENCE_BETA[pc.loss],
        reference=pc.reference or ("initial" if pc.loss in ("dpo", "ipo") and cfg.reference is None else None),
        label_smoothing=pc.label_smoothing if pc.label_smoothing is not None else (0.0 if pc.loss == "dpo" else None),
        gamma_beta_ratio=pc.gamma_beta_ratio if pc.gamma_beta_ratio is not None else (0.5 if pc.loss == "simpo" else None))
    return dataclasses.replace(cfg, preference=filled)


def _cross_checks(cfg: RunConfig, src: Path) -> None:
    tr = cfg.training
    if tr.trainable == "full" and cfg.lora is not None:
        raise ConfigError(f"{src}: [lora] does not apply to training.trainable = 'full'; remove the table "
                          "or set trainable = 'lora'")
    out = cfg.output
    kind = output_kind(cfg)
    if kind == "adapter" and tr.trainable != "lora":
        raise ConfigError(f"{src}: output.kind = 'adapter' needs training.trainable = 'lora'; a full fine-tune "
                          "writes kind = 'model' (an HF folder, or a GGUF when the path ends in .gguf)")
    if kind == "peft" and tr.trainable != "lora":
        raise ConfigError(f"{src}: output.kind = 'peft' needs training.trainable = 'lora'")
    if kind == "peft" and out.path.endswith(".gguf"):
        raise ConfigError(f"{src}: output.kind = 'peft' writes a folder, but output.path ends in .gguf")
    for table in ("grpo", "distill"):  # their KL term's reference is the policy with its adapter disabled
        t = getattr(cfg, table)
        if t is not None and (t.kl_coefficient or 0) > 0 and tr.trainable == "full" and cfg.reference is None:
            raise ConfigError(f"{src}: {table}.kl_coefficient > 0 with training.trainable = 'full' needs a "
                              "[reference] model (without LoRA there is no adapter to disable for the base)")
    if cfg.distill is not None and cfg.reference is not None and not cfg.distill.kl_coefficient:
        raise ConfigError(f"{src}: [reference] is only used by the KL term, and distill.kl_coefficient = 0")
    bp = cfg.backpressure
    if bp is not None and cfg.run.algorithm != "grpo":
        raise ConfigError(f"{src}: [backpressure] sizes GRPO's updates; it does not apply to run.algorithm = "
                          f"{cfg.run.algorithm!r}")
    if bp is not None and bp.min_batch_size > bp.max_batch_size:
        raise ConfigError(f"{src}: backpressure.min_batch_size must be <= max_batch_size")
    ck = cfg.checkpoint
    if ck is not None:
        if ck.mode in ("steps", "steps_and_best_eval") and ck.every_steps is None:
            raise ConfigError(f"{src}: checkpoint.mode = {ck.mode!r} needs checkpoint.every_steps")
        if ck.mode == "best_eval" and ck.every_steps is not None:
            raise ConfigError(f"{src}: checkpoint.every_steps does not apply to mode = 'best_eval'; "
                              "use mode = 'steps_and_best_eval' to have both")
        if ck.mode in ("best_eval", "steps_and_best_eval") and cfg.evaluation is None:
            raise ConfigError(f"{src}: checkpoint.mode = {ck.mode!r} needs an [evaluation] table")
    ev = cfg.evaluation
    if ev is not None and ev.every_steps is not None and ev.every_iterations is not None:
        raise ConfigError(f"{src}: give evaluation.every_steps or evaluation.every_iterations, not both")


def output_kind(cfg: RunConfig) -> str:
    """adapter (llama.cpp GGUF LoRA), peft (adapter folder) or model (HF folder; a LoRA is merged in);
    when output.kind
    is not given it follows the path: *.gguf -> adapter, otherwise peft (LoRA) or model (full)."""
    if cfg.output.kind:
        return cfg.output.kind
    if cfg.output.path.endswith(".gguf"):
        return "adapter" if cfg.training.trainable == "lora" else "model"
    return "peft" if cfg.training.trainable == "lora" else "model"


def trajectory_settings(cfg: RunConfig) -> dict:
    """Every setting that changes the trained weights, flattened to 'table.key' -> value.

    Stored in each checkpoint; a resume compares it key by key and names what differs. Data files
    and the model are compared by content fingerprint elsewhere, not by path.
    """
    out = {}
    for name in schema.TABLES:
        table = getattr(cfg, name, None)
        if table is None:
            continue
        for f in dataclasses.fields(table):
            if not f.metadata.get("trajectory", True):
                continue
            value = getattr(table, f.name)
            if dataclasses.is_dataclass(value):  # a sub-table such as [grpo.sampling]
                for sub in dataclasses.fields(value):
                    if sub.metadata.get("trajectory", True):
                        out[f"{name}.{f.name}.{sub.name}"] = getattr(value, sub.name)
            else:
                out[f"{name}.{f.name}"] = value
    return out


def config_as_dict(cfg: RunConfig) -> dict:
    d = {}
    for name in schema.TABLES:
        table = getattr(cfg, name, None)
        if table is not None:
            d[name] = {k: v for k, v in dataclasses.asdict(table).items() if v is not None}
    return d


def dump_toml(cfg: RunConfig) -> str:
    """The resolved config as TOML (written into the run folder)."""
    lines = [f"# resolved config of {cfg.source}"]
    for name, table in config_as_dict(cfg).items():
        lines.append(f"\n[{name}]")
        for k, v in table.items():
            lines.append(f"{k} = {_toml_value(v)}")
    return "\n".join(lines) + "\n"


def _toml_value(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        return repr(v)
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, list):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):  # TOML has no null: an unset (None) key is left out, as in the user's file
        return "{ " + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + " }"
    raise TypeError(v)


def _table_schema(cls) -> dict:
    py = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array", dict: "object"}
    hints = get_type_hints(cls)
    tprops, required = {}, []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if get_origin(tp) is Union:
            tp = [a for a in get_args(tp) if a is not type(None)][0]
        p = {"type": py.get(tp, "string"), "description": f.metadata["help"]}
        if f.metadata["choices"]:
            p["enum"] = list(f.metadata["choices"])
        if f.metadata["min"] is not None:
            p["exclusiveMinimum" if f.metadata["min_exclusive"] else "minimum"] = f.metadata["min"]
        if f.metadata["max"] is not None:
            p["exclusiveMaximum" if f.metadata["max_exclusive"] else "maximum"] = f.metadata["max"]
        if f.metadata["required"]:
            required.append(f.name)
        else:  # the default a key takes when left out (None: "not set", which the docs describe)
            default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
            if default is not None and default is not dataclasses.MISSING:
                p["default"] = default
        tprops[f.name] = p
    return {"type": "object", "properties": tprops, "required": required, "additionalProperties": False}


def json_schema() -> dict:
    """A JSON Schema of run.toml, for editor completion (`retrograd config-schema`)."""
    props = {name: _table_schema(cls) for name, cls in schema.TABLES.items()}
    props["run"]["properties"]["algorithm"]["enum"] = list(schema.SUPPORTED_ALGORITHMS)  # not the refused ones
    for name in set(schema.ALGORITHMS) - set(schema.SUPPORTED_ALGORITHMS) - {"sft"}:
        props.pop(name, None)
    for key, cls in schema.GRPO_SUBTABLES.items():  # [grpo.sampling] etc.
        props["grpo"]["properties"][key] = {**_table_schema(cls), "description": props["grpo"]["properties"][key]["description"]}
    for key, cls in schema.PPO_SUBTABLES.items():  # [ppo.sampling], [ppo.critic], ...
        props["ppo"]["properties"][key] = {**_table_schema(cls), "description": props["ppo"]["properties"][key]["description"]}
    for table in ("grpo", "ppo"):  # [grpo.judge], [ppo.judge]
        props[table]["properties"]["judge"] = {**_table_schema(schema.JudgeTable),
                                               "description": props[table]["properties"]["judge"]["description"]}
    props["distill"]["properties"]["sampling"] = {**_table_schema(schema.GrpoSamplingTable),
                                                  "description": props["distill"]["properties"]["sampling"]["description"]}
    from retrograd.algorithms.transforms import TABLE_DEFAULTS, TABLE_HELP
    py = {bool: "boolean", int: "integer", float: "number", str: "string", list: "array"}
    for table, defaults in TABLE_DEFAULTS.items():  # [grpo.gtpo] etc.: the token transforms' parameters
        props["grpo"]["properties"][table] = {
            "type": "object", "additionalProperties": False,
            "description": props["grpo"]["properties"][table]["description"],
            "properties": {k: {**({"type": py[type(v)]} if type(v) in py else {}), "default": v,
                               "description": TABLE_HELP[table][k]} for k, v in defaults.items()}}
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "title": "retrograd run.toml",
            "type": "object", "properties": props, "required": ["run", "model", "output"],
            "additionalProperties": False}
