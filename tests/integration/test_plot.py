"""`retrograd plot`: a PNG that opens (looked at once by hand) and an HTML report, for runs overlaid;
an unknown metric is refused naming what was logged."""
import json

from PIL import Image

from tiny import write_run


def test_plot_runs_to_png_and_html(tmp_path, tiny_model, cli):
    cfg = write_run(tmp_path, tiny_model, "[evaluation]\ndata = \"eval.jsonl\"\nevery_steps = 2\n", steps=6)
    cli("train", cfg, "--set", 'run.name="a"', check=0)
    cli("train", cfg, "--set", 'run.name="b"', "--set", "training.lr=0.001", check=0)
    r = json.loads(cli("plot", "runs", "--out", "plots/curves.png", "--json", check=0).stdout)
    assert r["metrics"] == ["train/loss", "eval/loss"] and sorted(r["groups"]) == ["a", "b"]
    img = Image.open(tmp_path / "plots" / "curves.png")
    img.verify()
    assert img.size[0] >= 600 and img.size[1] >= 500
    report = (tmp_path / "plots" / "curves.html").read_text()
    assert "data:image/png;base64," in report and "training" in report and "eval/loss" in report
    cli("plot", "runs/a", "--metric", "optimizer/lr", "--out", "lr.png", check=0)
    assert (tmp_path / "lr.png").stat().st_size > 1000
    bad = cli("plot", "runs/a", "--metric", "eval/nothing")
    assert bad.returncode == 2 and "was not logged" in bad.stderr and "train/loss" in bad.stderr
