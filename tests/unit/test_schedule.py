import math

import pytest

from retrograd.algorithms.schedule import lr_at


def test_constant_with_warmup():
    assert [lr_at(s, 10, 1.0, "constant", 4) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_linear_decays_to_zero_at_the_end():
    lrs = [lr_at(s, 5, 2.0, "linear", 0) for s in range(5)]
    assert lrs == pytest.approx([2.0, 1.6, 1.2, 0.8, 0.4])
    assert lr_at(5, 5, 2.0, "linear", 0) == 0.0


def test_cosine_midpoint_and_warmup():
    # warmup 2, then 8 decay steps: step 6 is halfway -> peak/2
    assert lr_at(6, 10, 1.0, "cosine", 2) == pytest.approx(0.5)
    assert lr_at(2, 10, 1.0, "cosine", 2) == pytest.approx(1.0)
    assert lr_at(4, 10, 1.0, "cosine", 2) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.25)))
