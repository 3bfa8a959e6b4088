"""`retrograd serve` access control and durability: API keys and owners, actor-only policies,
signed download URLs (expiry, tampering), kill during save + restart, the CLI."""
from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import tinker
from tinker import types

from service_util import ServeProcess, client, datum, rest, running_service
from tiny import make_model_dir

TOKENS = [5 + (3 * i) % 30 for i in range(16)]


def _get(url: str, key: str | None = None):
    req = urllib.request.Request(url, headers={"X-API-Key": key} if key else {})
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


@pytest.fixture(scope="module")
def keyed(tmp_path_factory):
    """A server with two owners: alice (rollout-enabled) and bob (actor-only); model tiny-actor is
    actor-only for everyone."""
    from retrograd.service.registry import Registry
    tmp = tmp_path_factory.mktemp("keyed")
    model = make_model_dir(tmp / "model")
    (tmp / "state").mkdir()
    reg = Registry(tmp / "state" / "registry.sqlite3")
    keys = {"alice": reg.create_key("alice"), "bob": reg.create_key("bob", "actor-only")}
    with running_service(tmp / "state", {"tiny": model, "tiny-actor": model}, {"tiny-actor": "actor-only"}) as (svc, url):
        yield svc, url, keys


def test_checkpoints_are_owner_scoped_and_policies_refuse_sampling(keyed):
    svc, url, keys = keyed
    alice, bob = client(url, keys["alice"]), client(url, keys["bob"])
    tc = alice.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    tc.forward_backward([datum(TOKENS)], "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    path = tc.save_state("mine").result().path
    sampler_path = tc.save_weights_for_sampler("mine").result().path

    # bob sees nothing of alice's: loading, reading, deleting all answer "not found"
    with pytest.raises(tinker.NotFoundError, match="not found"):
        bob.create_training_client_from_state_with_optimizer(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest(url, keys["bob"]).get_training_run(tc.model_id).result()
    with pytest.raises(tinker.NotFoundError):
        rest(url, keys["bob"]).delete_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError):
        rest(url, keys["bob"]).get_weights_info_by_tinker_path(path).result()
    assert rest(url, keys["bob"]).list_user_checkpoints().result().checkpoints == []
    # ... and neither does a path spelled differently
    for trick in (path.replace("/weights/", "/weights/./"), path + "/..", path.replace("tinker://", "tinker:///")):
        with pytest.raises((tinker.BadRequestError, tinker.NotFoundError)):
            bob.create_training_client_from_state(trick).result()
    status, body = _get(f"{url}/api/v1/training_runs/{tc.model_id}/checkpoints/weights/mine/manifest", keys["bob"])
    assert status == 404
    assert path in {c.tinker_path for c in rest(url, keys["alice"]).list_checkpoints(tc.model_id).result().checkpoints}

    # bob's key is actor-only: he trains and saves, but may not sample, and the refusal says why
    btc = bob.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    btc.forward_backward([datum(TOKENS)], "cross_entropy")
    btc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
    bpath = btc.save_weights_for_sampler("b").result().path
    with pytest.raises(tinker.PermissionDeniedError, match="actor-only"):
        bob.create_sampling_client(model_path=bpath).result()
    with pytest.raises(tinker.PermissionDeniedError, match="actor-only"):
        btc.save_weights_and_get_sampling_client().result()
    # model tiny-actor is actor-only for everyone; tiny is rollout-enabled for alice
    with pytest.raises(tinker.PermissionDeniedError, match="tiny-actor"):
        alice.create_sampling_client(base_model="tiny-actor").result()
    s = alice.create_sampling_client(model_path=sampler_path).result()
    assert len(s.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=3)).result().sequences) == 1

    # unknown keys are refused
    with pytest.raises(tinker.AuthenticationError):
        rest(url, "tml-not-a-key").list_training_runs().result()


def test_signed_download_urls_verify_expire_and_refuse_tampering(keyed):
    svc, url, keys = keyed
    tc = client(url, keys["alice"]).create_lora_training_client(base_model="tiny", rank=2, seed=1).result()
    path = tc.save_state("dl").result().path
    run_id = path.split("/")[2]
    status, body = _get(f"{url}/api/v1/training_runs/{run_id}/checkpoints/weights/dl/manifest", keys["alice"])
    assert status == 200
    m = json.loads(body)
    assert set(m["files"]) == {"weights.safetensors", "optimizer.pt", "progress.json", "manifest.json"}
    for name, info in m["files"].items():
        status, data = _get(m["urls"][name])  # no API key: the signature is the credential
        assert status == 200 and len(data) == info["bytes"] and hashlib.sha256(data).hexdigest() == info["sha256"]
    # the SDK's export + URL calls: a PEFT adapter folder
    ext = tc.save_weights_external("peft").result().path
    urls = rest(url, keys["alice"]).get_external_weights_urls(ext).result().urls
    assert {"adapter_model.safetensors", "adapter_config.json"} <= set(urls)
    assert json.loads(_get(urls["adapter_config.json"])[1])["r"] == 2

    good = m["urls"]["weights.safetensors"]
    sig = good.rsplit("=", 1)[1]
    tampered = good[:-len(sig)] + ("0" if sig[0] != "0" else "1") + sig[1:]
    assert _get(tampered)[0] == 403
    later = good.replace("expires=", "expires=9")  # a pushed-out deadline breaks the signature
    assert _get(later)[0] == 403
    other_file = good.replace("weights.safetensors", "optimizer.pt")  # a signature is per file
    assert _get(other_file)[0] == 403
    storage_id = good.split("/files/")[1].split("/")[0]
    rel, _ = svc.signer.url_path(storage_id, "weights.safetensors", -5, svc.registry.caller(keys["alice"]).key_id)
    status, body = _get(url + rel)
    assert status == 403 and b"expired" in body
    rest(url, keys["alice"]).delete_checkpoint_from_tinker_path(path).result()
    assert _get(good)[0] == 404  # a valid URL of a deleted checkpoint


def test_closing_a_session_frees_its_models_but_keeps_its_checkpoints(keyed):
    svc, url, keys = keyed
    sc = client(url, keys["alice"])
    tc = sc.create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    path = tc.save_state("kept").result().path
    assert tc.model_id in svc.runs
    sc.close("success").result()
    deadline = time.time() + 30  # the release runs on the compute thread, after queued jobs
    while tc.model_id in svc.runs and time.time() < deadline:
        time.sleep(0.05)
    assert tc.model_id not in svc.runs
    req = urllib.request.Request(f"{url}/api/v1/optim_step", data=json.dumps(
        {"model_id": tc.model_id, "seq_id": 99, "adam_params": {}}).encode(), headers={"X-API-Key": keys["alice"]})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 404
    again = client(url, keys["alice"]).create_training_client_from_state_with_optimizer(path).result()
    assert again.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] > 0


def test_checkpoint_ttl(keyed):
    svc, url, keys = keyed
    rc = rest(url, keys["alice"])
    tc = client(url, keys["alice"]).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
    path = tc.save_state("ttl").result().path
    [c] = [c for c in rc.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path]
    assert c.expires_at is None
    rc.set_checkpoint_ttl_from_tinker_path(path, 7200).result()
    [c] = [c for c in rc.list_checkpoints(tc.model_id).result().checkpoints if c.tinker_path == path]
    assert 7100 < (c.expires_at.timestamp() - time.time()) <= 7200
    rc.set_checkpoint_ttl_from_tinker_path(path, 1).result()
    time.sleep(1.5)
    assert path not in {c.tinker_path for c in rc.list_checkpoints(tc.model_id).result().checkpoints}
    with pytest.raises(tinker.NotFoundError):
        client(url, keys["alice"]).create_training_client_from_state(path).result()
    storage = {p.name for p in (svc.state_dir / "checkpoints").iterdir()}
    tc.save_state("after").result()  # a save sweeps expired checkpoints off the disk
    assert len(storage - {p.name for p in (svc.state_dir / "checkpoints").iterdir()}) == 1


def test_request_size_limit(keyed):
    _, url, keys = keyed
    from retrograd.service.http import MAX_JSON_BYTES
    req = urllib.request.Request(f"{url}/api/v1/create_session", data=b"{" + b" " * (MAX_JSON_BYTES + 1) + b"}",
                                 headers={"X-API-Key": keys["alice"], "Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=30)
    assert e.value.code == 413


def test_kill_during_save_leaves_no_registered_half_checkpoint(tmp_path):
    model = make_model_dir(tmp_path / "model")
    state = tmp_path / "state"
    server = ServeProcess(state, model, env={"RETROGRAD_TEST_CRASH_IN_SAVE": "service:doomed"})
    try:
        sc = client(server.url, server.key)
        tc = sc.create_lora_training_client(base_model=str(model), rank=2, seed=0).result()
        tc.forward_backward([datum(TOKENS)], "cross_entropy")
        tc.optim_step(types.AdamParams(learning_rate=1e-3)).result()
        kept = tc.save_state("kept").result().path
        tc.save_state("doomed")  # the server SIGKILLs itself after writing the files, before registering
        assert server.proc.wait(60) == -signal.SIGKILL
    finally:
        server.stop()
    assert len(list((state / "checkpoints").iterdir())) == 2  # kept + the unregistered remains

    server = ServeProcess(state, model)
    try:
        listed = [c.tinker_path for c in rest(server.url, server.key).list_checkpoints(kept.split("/")[2]).result()
                  .checkpoints]
        assert listed == [kept]
        assert len(list((state / "checkpoints").iterdir())) == 1  # the remains were swept at start
        assert any("removed 1 unregistered" in line for line in server.lines)
        resumed = client(server.url, server.key).create_training_client_from_state_with_optimizer(kept).result()
        assert resumed.forward([datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"] > 0
    finally:
        server.stop()


def test_cli_keys_and_checkpoint_list(tmp_path):
    state = tmp_path / "state"
    env = {**os.environ, "RETROGRAD_HOME": str(tmp_path / "home")}
    r = subprocess.run([sys.executable, "-m", "retrograd", "serve", "keys", "create", "--owner", "carol",
                        "--policy", "actor-only", "--state-dir", str(state)], capture_output=True, text=True, env=env,
                       timeout=60)
    assert r.returncode == 0 and r.stdout.strip().startswith("tml-")
    key = r.stdout.strip()

    model = make_model_dir(tmp_path / "model")
    with running_service(state, {"tiny": model}) as (svc, url):
        assert svc.registry.caller(key).owner == "carol"
        tc = client(url, key).create_lora_training_client(base_model="tiny", rank=2, seed=0).result()
        path = tc.save_state("first").result().path
        session = tc.model_id.split(":")[0]
        r = subprocess.run([sys.executable, "-m", "retrograd", "checkpoint", "list", "--session-id", session,
                            "--limit", "25", "--base-url", url, "--api-key", key],
                           capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 0 and path in r.stdout and "training" in r.stdout
        r = subprocess.run([sys.executable, "-m", "retrograd", "checkpoint", "list", "--session-id", "nope",
                            "--base-url", url, "--api-key", key], capture_output=True, text=True, env=env, timeout=60)
        assert r.returncode == 2 and "404" in r.stderr and "not found" in r.stderr
