"""The composition: episode advantages -> transform -> batch norm -> cap, by hand and against a
plain-Python re-implementation; plugins by dotted path; errors that name the culprit."""
import math
import random
import textwrap

import pytest
import torch

from retrograd.algorithms.advantages import EPISODE_ADVANTAGES
from retrograd.algorithms.pipeline import ALGORITHM_MODES, token_advantages
from retrograd.algorithms.registry import PluginError
from retrograd.algorithms.transforms import TOKEN_TRANSFORMS, TokenContext

D = torch.float64


def ctx_for(lengths, group_size, seed=0, planning=True):
    g = torch.Generator().manual_seed(seed)
    n, t = len(lengths), max(lengths)
    mask = torch.arange(t)[None, :] < torch.tensor(lengths)[:, None]
    lp = torch.where(mask, -torch.rand(n, t, generator=g, dtype=D) * 4, 0.0)
    plan = (torch.rand(n, t, generator=g) < 0.3) & mask if planning else None
    group = torch.arange(n // group_size).repeat_interleave(group_size)
    return TokenContext(torch.zeros(n, dtype=D), lp, mask, group, plan, None, 0.5, 3)


def call(rewards, ctx, **kw):
    args = dict(advantage_mode="grpo", transform_mode="none", uncertainty_kind="surprisal", tables={},
                advantage_params={}, transform_params={}, batch_norm=False, adv_clip_max=0.0, state={})
    args.update(kw)
    return token_advantages(torch.tensor(rewards, dtype=D), ctx, **args)


# -- by hand ----------------------------------------------------------------------------------

def test_order_by_hand():
    ctx = ctx_for([2, 1], 2, planning=False)
    out, episode, m = call([[1.0, 0.0]], ctx)
    assert episode.tolist() == [0.5, -0.5]
    assert out.tolist() == [[0.5, 0.5], [-0.5, 0.0]]
    # batch norm over the 3 non-zero tokens (0.5, 0.5, -0.5): mean 1/6, std sqrt(2)/3; then cap 0.8
    out, _, m = call([[1.0, 0.0]], ctx, batch_norm=True, adv_clip_max=0.8)
    sd = math.sqrt(2) / 3
    up, down = (0.5 - 1 / 6) / (sd + 1e-8), (-0.5 - 1 / 6) / (sd + 1e-8)
    assert out[0].tolist() == pytest.approx([up, up]) and out[1].tolist() == [-0.8, 0.0]
    assert m["batch_adv_count"] == 3.0 and m["batch_adv_mean"] == pytest.approx(1 / 6)
    assert m["adv_cap_fraction"] == pytest.approx(1 / 3) and m["adv_cap_magnitude"] == pytest.approx(-down)


# -- against a plain re-implementation --------------------------------------------------------

def ref_pipeline(rewards, rows, lam, beta, cap):
    """maxrl + gtpo_sepa + batch norm + cap, list by list. rows[i] = (logprobs, planning)."""
    size = len(rewards[0])
    episode = []
    for r in rewards:
        m = sum(r) / len(r)
        episode += [0.0] * len(r) if m <= 1e-6 else [(x - m) / (m + 1e-6) for x in r]
    token = []
    for a, (lps, plan) in zip(episode, rows):
        u = [min(-x, 50.0) for x in lps]
        ex = [x for x, p in zip(u, plan) if not p]
        if ex:
            mu = sum(ex) / len(ex)
            u = [x if p else lam * mu + (1 - lam) * x for x, p in zip(u, plan)]
        mean = sum(u) / len(u)
        token.append([a] * len(u) if mean < 1e-7 else [a * max(0.0, 1 + beta * (x / (mean + 1e-8) - 1)) for x in u])
    vals = [x for row in token for x in row if x != 0]
    mu = sum(vals) / len(vals)
    sd = math.sqrt(sum((x - mu) ** 2 for x in vals) / len(vals))
    token = [[(x - mu) / (sd + 1e-8) if x != 0 else 0.0 for x in row] for row in token]
    token = [[max(-cap, min(cap, x)) if x != 0 else 0.0 for x in row] for row in token]
    assert size * len(rewards) == len(rows)
    return token, episode


@pytest.mark.parametrize("seed", [0, 1])
def test_against_reference(seed):
    rng = random.Random(seed)
    rewards = [[float(rng.random() < 0.5) for _ in range(4)] for _ in range(3)] + [[0.0] * 4]
    lengths = [rng.randint(1, 8) for _ in range(16)]
    ctx = ctx_for(lengths, 4, seed)
    out, episode, _ = call(rewards, ctx, advantage_mode="maxrl", transform_mode="gtpo_sepa",
                           tables={"gtpo": {"beta": 0.4}}, batch_norm=True, adv_clip_max=1.2)
    rows = [(ctx.logprobs[i, :n].tolist(), ctx.planning[i, :n].tolist()) for i, n in enumerate(lengths)]
    want, want_episode = ref_pipeline(rewards, rows, 0.5, 0.4, 1.2)
    assert episode.tolist() == pytest.approx(want_episode, abs=1e-12)
    for i, n in enumerate(lengths):
        assert out[i, :n].tolist() == pytest.approx(want[i], abs=1e-9)
    assert bool((out[~ctx.mask] == 0).all())


def test_every_builtin_pair_runs_and_is_zero_outside_the_mask():
    ctx = ctx_for([3, 5, 2, 4, 1, 6], 3)
    for adv in EPISODE_ADVANTAGES.names():
        for tx in TOKEN_TRANSFORMS.names():
            state = {}
            out, episode, m = call([[1.0, 0.0, 0.5], [0.2, 0.9, 0.9]], ctx, advantage_mode=adv, transform_mode=tx,
                                   tables={"delight": {"eta_mode": "adaptive"}}, state=state)
            assert out.dtype == D and episode.shape == (6,)
            assert bool((out[~ctx.mask] == 0).all()) and bool(torch.isfinite(out).all())
            assert all(isinstance(v, float) for v in m.values())
            assert ("delight_eta_ema" in state) == tx.startswith("delight")


def test_recipes():
    assert ALGORITHM_MODES["discover_entropic"] == ALGORITHM_MODES["ttt_discover_entropic"] == ("discover_entropic", "none")
    assert ALGORITHM_MODES["maxrl_gtpo_sepa"] == ("maxrl", "gtpo_sepa")
    assert len(ALGORITHM_MODES) == 12
    for adv, tx in ALGORITHM_MODES.values():
        assert adv in EPISODE_ADVANTAGES and tx in TOKEN_TRANSFORMS


# -- plugins and errors ------------------------------------------------------------------------

PLUGIN = '''
import torch
SEEN = {}

def best_only(rewards, params):
    SEEN["adv_params"] = params
    return (rewards == rewards.max(dim=1, keepdim=True).values).double() * params.get("scale", 1.0)

def last_token(ctx, params):
    SEEN["params"] = params
    out = torch.zeros(ctx.mask.shape, dtype=torch.float64)
    n = ctx.mask.sum(1)
    out[torch.arange(len(n)), n - 1] = ctx.advantages
    return out + 7.0 * ~ctx.mask, {"plugin_metric": 1}

def flat(ctx):
    return torch.ones(ctx.mask.shape)

def wrong_shape(ctx, params):
    return torch.zeros(2, 2), {}

def wrong_adv(rewards, params):
    return rewards.reshape(-1)
'''


@pytest.fixture
def plugin(tmp_path, request):
    name = f"rg_plugin_{request.node.name.replace('[', '_').replace(']', '_')}"
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(PLUGIN))
    return name, tmp_path


def test_plugins_by_dotted_path(plugin):
    name, path = plugin
    ctx = ctx_for([3, 1, 2, 2], 2)
    out, episode, m = call([[1.0, 0.0], [0.5, 0.5]], ctx, advantage_mode=f"{name}:best_only",
                           advantage_params={"scale": 2.0}, transform_mode=f"{name}.last_token",
                           transform_params={"anything": [1, 2]}, tables={"gtpo": {"beta": 0.3}},
                           uncertainty_kind=f"{name}:flat", search_path=path)
    assert episode.tolist() == [2.0, 0.0, 2.0, 2.0]
    assert out.tolist() == [[0.0, 0.0, 2.0], [0.0, 0.0, 0.0], [0.0, 2.0, 0.0], [0.0, 2.0, 0.0]]  # 7s masked off
    assert m["plugin_metric"] == 1.0
    import importlib
    seen = importlib.import_module(name).SEEN
    assert seen["adv_params"] == {"scale": 2.0}
    params = seen["params"]
    assert params["transform_params"] == {"anything": [1, 2]} and params["uncertainty_kind"] == f"{name}:flat"
    assert params["gtpo"] == {"beta": 0.3} and params["delight"]["eta"] == 1.0  # every table, filled
    # a built-in transform with a plugin uncertainty: flat u gives GTPO weights of 1
    out, _, _ = call([[1.0, 0.0], [0.5, 0.5]], ctx, transform_mode="gtpo", uncertainty_kind=f"{name}:flat",
                     search_path=path)
    assert out[0].tolist() == pytest.approx([0.5, 0.5, 0.5])


def test_plugin_wrong_shapes_are_named(plugin):
    name, path = plugin
    ctx = ctx_for([3, 1], 2)
    with pytest.raises(ValueError, match=f"transform_mode '{name}:wrong_shape' returned token advantages"):
        call([[1.0, 0.0]], ctx, transform_mode=f"{name}:wrong_shape", search_path=path)
    with pytest.raises(ValueError, match=f"advantage_mode '{name}:wrong_adv' returned"):
        call([[1.0, 0.0]], ctx, advantage_mode=f"{name}:wrong_adv", search_path=path)
    with pytest.raises(PluginError, match="cannot import"):
        call([[1.0, 0.0]], ctx, transform_mode=f"{name}:missing", search_path=path)


def test_unknown_names_list_the_builtins():
    ctx = ctx_for([3, 1], 2)
    with pytest.raises(PluginError, match="unknown advantage_mode 'grpoo'; built in: grpo, rloo, grpo_std, maxrl"):
        call([[1.0, 0.0]], ctx, advantage_mode="grpoo")
    with pytest.raises(PluginError, match="unknown transform_mode 'gtpo_sepa_x'; built in: none, gtpo,"):
        call([[1.0, 0.0]], ctx, transform_mode="gtpo_sepa_x")
    with pytest.raises(PluginError, match="unknown uncertainty_kind 'varentropy'"):
        call([[1.0, 0.0]], ctx, uncertainty_kind="varentropy")


def test_parameter_errors():
    ctx = ctx_for([3, 1], 2)
    with pytest.raises(PluginError, match=r"\['beta'\] not read by 'grpo'"):
        call([[1.0, 0.0]], ctx, advantage_params={"beta": 1.0})
    out, episode, _ = call([[1.0, 0.0]], ctx, advantage_mode="discover_entropic", advantage_params={"beta": math.log(3)})
    assert episode.tolist() == pytest.approx([0.5, -0.5])
    with pytest.raises(PluginError, match="transform_params .* are for plugin transforms"):
        call([[1.0, 0.0]], ctx, transform_mode="gtpo", transform_params={"beta": 0.2})
    with pytest.raises(PluginError, match=r"\[grpo.gtpo\]: unknown keys"):
        call([[1.0, 0.0]], ctx, transform_mode="gtpo", tables={"gtpo": {"betta": 0.2}})


def test_context_must_match_the_rewards():
    ctx = ctx_for([3, 1, 2, 2], 2)
    with pytest.raises(ValueError, match="2 groups of 3 rewards but 4 completions"):
        call([[1.0, 0.0, 1.0], [0.0, 1.0, 0.0]], ctx)
    ctx.group = torch.tensor([0, 1, 0, 1])
    with pytest.raises(ValueError, match="group by group"):
        call([[1.0, 0.0], [0.0, 1.0]], ctx)
