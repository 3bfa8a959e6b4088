"""TensorBoard scalars (tensorboardX), read back with the real tensorboard package: values and steps;
a resumed run drops the points logged after its checkpoint; a fresh run moves an earlier one aside."""
from retrograd.metrics.tensorboard import EventWriter


def read(folder):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(folder))
    acc.Reload()
    return acc


def test_event_file_reads_back_with_tensorboard(tmp_path):
    w = EventWriter(tmp_path / "run")
    for step in range(1, 4):
        w.add_scalars(step, {"train/loss": 1.0 / step, "optimizer/lr": 0.1, "not/a_number": "x", "flag": True})
    w.close()
    acc = read(tmp_path / "run")
    assert set(acc.Tags()["scalars"]) == {"train/loss", "optimizer/lr"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [round(e.value, 5) for e in loss] == [1.0, 0.5, 0.33333]


def test_a_resumed_run_reads_as_one_run(tmp_path):
    w = EventWriter(tmp_path / "run")
    for step in range(1, 6):  # killed after step 5; its last checkpoint was step 3
        w.add_scalars(step, {"train/loss": float(step)})
    w.close()
    w = EventWriter(tmp_path / "run", resume_step=3)
    for step in range(4, 7):
        w.add_scalars(step, {"train/loss": 10.0 * step})
    w.close()
    loss = read(tmp_path / "run").Scalars("train/loss")
    assert [(e.step, e.value) for e in loss] == [(1, 1.0), (2, 2.0), (3, 3.0), (4, 40.0), (5, 50.0), (6, 60.0)]


def test_a_fresh_run_moves_the_earlier_one_aside(tmp_path):
    w = EventWriter(tmp_path / "run")
    w.add_scalars(1, {"train/loss": 5.0})
    w.close()
    w = EventWriter(tmp_path / "run")
    w.add_scalars(1, {"train/loss": 1.0})
    w.close()
    assert [e.value for e in read(tmp_path / "run").Scalars("train/loss")] == [1.0]
    aside = [p for p in tmp_path.iterdir() if p.name.startswith("run-")]
    assert len(aside) == 1 and [e.value for e in read(aside[0]).Scalars("train/loss")] == [5.0]
