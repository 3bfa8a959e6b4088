"""`retrograd serve --pass-tokens N`: a request's datums are computed in passes of at most N tokens,
with the same log-probabilities and loss as one pass; a bad value is refused naming the flag."""
from __future__ import annotations

import subprocess
import sys

import numpy as np

from service_util import ServeProcess, datum
from tiny import make_model_dir

TOKENS = [5 + (7 * i) % 40 for i in range(24)]


def forward(server: ServeProcess):
    import tinker
    sc = tinker.ServiceClient(base_url=server.url, api_key=server.key)
    tc = sc.create_lora_training_client(base_model=server.model_name, rank=4, seed=0).result()
    data = [datum(TOKENS), datum(TOKENS[:10]), datum(TOKENS[3:20])]
    out = tc.forward(data, "cross_entropy").result()
    return ([np.asarray(o["logprobs"].data) for o in out.loss_fn_outputs], out.metrics["loss:sum"])


def test_small_passes_give_the_same_result_as_one(tmp_path):
    model = make_model_dir(tmp_path / "model")
    results = []
    for extra in ([], ["--pass-tokens", "12"]):
        server = ServeProcess(tmp_path / f"state{len(results)}", model, extra=extra)
        server.model_name = str(model)
        try:
            if extra:
                assert any("passes of at most 12 tokens" in line for line in server.lines)
            results.append(forward(server))
        finally:
            server.stop()
    (one, loss_one), (small, loss_small) = results
    assert [len(x) for x in one] == [23, 9, 16]
    for a, b in zip(one, small):
        assert np.allclose(a, b, atol=1e-5)
    assert abs(loss_one - loss_small) <= 1e-4 * abs(loss_one)


def test_a_bad_pass_size_is_refused(tmp_path):
    model = make_model_dir(tmp_path / "model")
    proc = subprocess.run([sys.executable, "-m", "retrograd", "serve", "--port", "0", "--state-dir",
                           str(tmp_path / "state"), "--models", str(model), "--pass-tokens", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "--pass-tokens 0: must be at least 1" in proc.stderr
