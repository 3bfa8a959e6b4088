"""The terminal shows a live bar only on a TTY, plain lines otherwise; metrics.jsonl is trimmed on resume."""
import io
import json

from retrograd.metrics import MetricsLogger


class FakeTTY(io.StringIO):
    def isatty(self):
        return True


def test_plain_lines_without_a_tty(tmp_path):
    out = io.StringIO()
    m = MetricsLogger(tmp_path, 2, stream=out)
    m.log(1, {"train/loss": 1.5, "optimizer/lr": 1e-3, "system/tokens_per_second": 100.0})
    m.log(2, {"train/loss": 1.25, "optimizer/lr": 1e-3, "system/tokens_per_second": 100.0})
    m.close()
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("step 1/2  loss 1.5000  lr 1.00e-03  tok/s 100")
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["train/loss"] == 1.25


def test_live_bar_on_a_tty_keeps_eval_lines(tmp_path):
    out = FakeTTY()
    m = MetricsLogger(tmp_path, 4, stream=out)
    m.log(1, {"train/loss": 2.0})
    m.log(2, {"train/loss": 1.0})
    m.log(2, {"eval/loss": 0.5})
    m.close()
    text = out.getvalue()
    assert text.count("\r\x1b[2K[") == 2  # the bar is redrawn in place
    assert "\neval  step 2/4  eval/loss 0.5000\n" in text


def test_resume_drops_rows_after_the_checkpoint_and_nan_becomes_null(tmp_path):
    m = MetricsLogger(tmp_path, 5, stream=io.StringIO())
    for step in range(1, 5):
        m.log(step, {"train/loss": float("nan") if step == 2 else 1.0})
    m.close()
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write('{"step": 5, "train/lo')  # a line cut by a kill mid-write
    m = MetricsLogger(tmp_path, 5, stream=io.StringIO(), resume_step=2)
    m.close()
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and rows[1]["train/loss"] is None


def test_a_fresh_run_keeps_the_earlier_metrics_file(tmp_path):
    m = MetricsLogger(tmp_path, 1, stream=io.StringIO())
    m.log(1, {"train/loss": 3.0})
    m.close()
    MetricsLogger(tmp_path, 1, stream=io.StringIO()).close()
    kept = list(tmp_path.glob("metrics-*.jsonl"))
    assert len(kept) == 1 and json.loads(kept[0].read_text())["train/loss"] == 3.0
