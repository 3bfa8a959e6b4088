"""Upload retrograd's offline W&B export to Weights & Biases.

    WANDB_API_KEY=... python3 scripts/import_wandb.py artifacts/wandb --project my-project [--entity E] [--name N]

DIR is a run folder of `[metrics] wandb_export_dir` (it holds run.json) or the export root (every
run folder in it is imported). Each run is replayed through the wandb SDK: its config, every logged
row at its own step (`train/global_step` is the x-axis), and its summary. The run id is derived from
the export, and a `.uploaded` marker makes a second upload of the same run a no-op (--force repeats
it). An export whose run is still `running` (the training was killed and not resumed) is refused.
Test it without an account: WANDB_MODE=offline.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path

FORMAT = "retrograd-wandb-export/1"


class ExportError(Exception):
    pass


def read_export(folder: Path, allow_incomplete: bool = False) -> tuple[dict, list[dict], dict]:
    run_file = folder / "run.json"
    if not run_file.exists():
        raise ExportError(f"{folder}: no run.json; this is not a retrograd W&B export (or it was never started)")
    try:
        run = json.loads(run_file.read_text())
    except ValueError as e:
        raise ExportError(f"{run_file} is corrupt: {e}") from None
    if run.get("format") != FORMAT:
        raise ExportError(f"{run_file}: unknown export format {run.get('format')!r} (expected {FORMAT})")
    if run.get("state") == "running" and not allow_incomplete:
        raise ExportError(f"{folder}: the export is half-written: its run is still marked running (the training was "
                          "killed, or is still going). Resume the run so it ends, or pass --allow-incomplete")
    summary_file = folder / "summary.json"
    if run.get("state") != "running" and not summary_file.exists():
        raise ExportError(f"{folder}: run.json says {run.get('state')!r} but summary.json is missing; the export "
                          "is incomplete")
    rows = []
    lines = (folder / "history.jsonl").read_text().splitlines() if (folder / "history.jsonl").exists() else []
    for i, line in enumerate(lines, 1):
        try:
            rows.append(json.loads(line))
        except ValueError:
            if i == len(lines) and allow_incomplete:
                break  # a last line cut by a kill
            raise ExportError(f"{folder / 'history.jsonl'}:{i}: not valid JSON; the export is damaged") from None
    summary = json.loads(summary_file.read_text()) if summary_file.exists() else {}
    return run, rows, summary


def run_folders(path: Path) -> list[Path]:
    if (path / "run.json").exists():
        return [path]
    found = sorted(p for p in path.iterdir() if (p / "run.json").exists()) if path.is_dir() else []
    if not found:
        raise ExportError(f"{path}: no retrograd W&B export here (no run.json in it or in its sub-folders)")
    return found


def upload(folder: Path, project: str, entity: str | None, name: str | None, force: bool,
           allow_incomplete: bool) -> str:
    import wandb
    run_meta, rows, summary = read_export(folder, allow_incomplete)
    marker = folder / ".uploaded"
    if marker.exists() and not force:
        return f"{folder}: already uploaded as {marker.read_text().strip()} (--force uploads it again)"
    run_id = hashlib.sha256(f"{folder.resolve()}|{run_meta.get('started')}".encode()).hexdigest()[:16]
    run = wandb.init(project=project, entity=entity, name=name or run_meta["name"], id=run_id,
                     config=run_meta.get("config", {}), resume="allow",
                     settings=wandb.Settings(console="off", x_disable_stats=True, save_code=False, disable_git=True))
    run.define_metric("train/global_step")
    run.define_metric("*", step_metric="train/global_step")
    merged: dict[int, dict] = {}
    for row in rows:  # rows of one step (train, eval) become one history row, steps in order
        step = int(row["_step"])
        merged.setdefault(step, {}).update({k: v for k, v in row.items() if v is not None and k != "_step"})
    for step in sorted(merged):
        run.log({**merged[step], "train/global_step": step}, step=step)
    run.summary.update({k: v for k, v in summary.items() if v is not None})
    run.finish(exit_code=0 if run_meta.get("state") != "running" else 1)
    marker.write_text(f"{entity + '/' if entity else ''}{project}/{run_id}\n")
    return f"{folder}: uploaded {len(merged)} steps to {project} as run {run_id}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("export", help="a run folder of the export, or the export root")
    p.add_argument("--project", required=True, help="W&B project")
    p.add_argument("--entity", help="W&B entity (team or user)")
    p.add_argument("--name", help="display name (default: the run's name); only with a single run")
    p.add_argument("--force", action="store_true", help="upload again a run that has an .uploaded marker")
    p.add_argument("--allow-incomplete", action="store_true", help="upload a run that never ended (killed)")
    args = p.parse_args(argv)
    try:
        import wandb  # noqa: F401
    except ImportError:
        print("error: this script needs the wandb package: pip install wandb", file=sys.stderr)
        return 2
    try:
        folders = run_folders(Path(args.export))
        if args.name and len(folders) > 1:
            raise ExportError("--name applies to a single run; point the script at one run folder")
        for folder in folders:
            read_export(folder, args.allow_incomplete)  # refuse before uploading anything
        for folder in folders:
            print(upload(folder, args.project, args.entity, args.name, args.force, args.allow_incomplete))
    except ExportError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
