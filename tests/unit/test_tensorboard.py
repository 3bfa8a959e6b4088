"""Our dependency-free event writer, read back with the real tensorboard package."""
from retrograd.metrics.tensorboard import EventWriter, crc32c


def test_crc32c_check_value():
    assert crc32c(b"123456789") == 0xE3069283  # the standard CRC-32C check value


def test_event_file_reads_back_with_tensorboard(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    w = EventWriter(tmp_path)
    for step in range(1, 4):
        w.add_scalars(step, {"train/loss": 1.0 / step, "optimizer/lr": 0.1, "not/a_number": "x"})
    w.close()
    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert set(acc.Tags()["scalars"]) == {"train/loss", "optimizer/lr"}
    loss = acc.Scalars("train/loss")
    assert [e.step for e in loss] == [1, 2, 3]
    assert [round(e.value, 5) for e in loss] == [1.0, 0.5, 0.33333]
