"""`retrograd init [--template sft|dpo|grpo|ppo|distill|service] [--out FILE]`: a starter file that runs as written.

The templates (src/retrograd/templates/) are the shipped examples themselves (a test keeps them byte for
byte equal to examples/), so what `init` writes is what the README documents and CI runs: built-in
model and data, output paths relative to the file. `service` writes the tinker-SDK client of
examples/service/train_sft.py (start `retrograd serve` first, as its docstring says).
"""
from __future__ import annotations

from importlib import resources
from pathlib import Path

from retrograd.errors import ConfigError

TEMPLATES = {"sft": ("sft.toml", "quickstart.toml", "run.toml"), "dpo": ("dpo.toml", "dpo.toml", "dpo.toml"),
             "grpo": ("grpo.toml", "grpo.toml", "grpo.toml"), "ppo": ("ppo.toml", "ppo.toml", "ppo.toml"),
             "distill": ("distill.toml", "distill.toml", "distill.toml"),
             "service": ("service.py", "service/train_sft.py", "train_sft.py")}


def template_text(name: str) -> str:
    return (resources.files("retrograd") / "templates" / TEMPLATES[name][0]).read_text(encoding="utf-8")


def run_init(template: str, out: str | None, force: bool) -> int:
    if template not in TEMPLATES:
        raise ConfigError(f"--template {template!r}: choose one of {', '.join(TEMPLATES)}")
    _, example, default_name = TEMPLATES[template]
    path = Path(out or default_name)
    if path.exists() and not force:
        raise ConfigError(f"{path} exists; give --out ANOTHER_FILE, or --force to overwrite it")
    text = template_text(template).replace(f"examples/{example}", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text, encoding="utf-8")
    how = f"python {path}" if path.suffix == ".py" else f"retrograd train {path}"
    print(f"wrote {path} (the {template} template); run it with: {how}")
    if template == "distill":
        print("it needs its teacher first: retrograd train <sft run.toml> --set output.kind=model "
              "--set output.path=out/quickstart-merged (see the file's header)")
    return 0
