"""Server-side custom losses (Tinker's `ServiceClient.create_custom_loss`, then `forward_backward(data,
"custom", {"loss_id": ...})`).

The client traces a per-datum loss `fn(logprobs, *inputs) -> (scalar, {"custom/<name>:sum|mean": t})`
with torch.fx and sends its nodes as plain data. Nothing of it is executed as code: `build` rebuilds
the graph node by node from this module's allowlists (pure tensor functions of torch, math and
operator, tensor methods that stay in torch, a few attributes), refusing anything else with a message
naming the node; `CustomLoss.__call__` interprets it on the datum's tensors.
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from retrograd.service.errors import HttpError

_TORCH = ("abs add amax amin any all argmax argmin cat clamp clamp_max clamp_min clip cumsum diff div eq exp exp2 "
          "expm1 flatten flip full_like ge gather gt isfinite isnan le log log10 log1p log2 log_softmax logaddexp "
          "logical_and logical_not logical_or logsumexp lt masked_fill max maximum mean min minimum mul ne neg "
          "nan_to_num ones_like pow prod reciprocal relu rsqrt sigmoid sign softmax sqrt square stack std sub sum "
          "tanh tensor topk var where zeros_like").split()
_FUNCTIONAL = "softplus logsigmoid relu silu gelu log_softmax softmax sigmoid tanh".split()
_MATH = "exp log log1p sqrt expm1 tanh".split()
_OPERATOR = ("add sub mul truediv floordiv mod pow neg pos abs getitem lt le gt ge eq ne and_ or_ xor invert "
             "not_").split()
FUNCTIONS = {**{f"torch.{n}": getattr(torch, n) for n in _TORCH},
             **{f"torch.nn.functional.{n}": getattr(F, n) for n in _FUNCTIONAL},
             **{f"math.{n}": getattr(math, n) for n in _MATH},
             **{f"operator.{n}": getattr(operator, n) for n in _OPERATOR}}
METHODS = set(_TORCH) | {"float", "double", "detach", "to", "view", "reshape", "unsqueeze", "squeeze", "size",
                         "dim", "numel", "t", "transpose", "expand", "expand_as", "contiguous", "clone", "type_as"}
ATTRIBUTES = {"shape", "ndim", "dtype", "T"}
DTYPES = {"float32": torch.float32, "float64": torch.float64, "int64": torch.int64, "int32": torch.int32,
          "bool": torch.bool}
METRIC_KEY = re.compile(r"custom/[a-z0-9_./-]{1,64}:(sum|mean)")
INPUT_NAME = re.compile(r"[a-z_][a-z0-9_]{0,63}")
MAX_NODES = 2000


def _bad(node: str, why: str) -> HttpError:
    return HttpError(400, f"create_custom_loss: node {node!r}: {why}")


@dataclass
class CustomLoss:
    name: str
    inputs: list[tuple[str, int]]  # (name, rank), logprobs first
    nodes: list[dict]

    def __call__(self, *args: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        env: dict = {}
        placeholders = iter(args)
        for node in self.nodes:
            op, name = node["op"], node["name"]
            if op == "placeholder":
                env[name] = next(placeholders)
                continue
            a = [_decode(x, env) for x in node["args"]]
            kw = {k: _decode(x, env) for k, x in node["kwargs"].items()}
            if op == "call_function":
                env[name] = node["fn"](*a, **kw)
            elif op == "call_method":
                env[name] = getattr(a[0], node["target"])(*a[1:], **kw)
            else:  # output
                loss, metrics = a[0]
                return loss, metrics
        raise ValueError("custom loss graph without an output node")


def _decode(x, env):
    if isinstance(x, list):
        return [_decode(v, env) for v in x]
    if not isinstance(x, dict):
        return x
    (kind, value), = x.items()
    if kind == "ref":
        return env[value]
    if kind == "tuple":
        return tuple(_decode(v, env) for v in value)
    if kind == "dict":
        return {k: _decode(v, env) for k, v in value.items()}
    if kind == "slice":
        return slice(*(_decode(v, env) for v in value))
    if kind == "ellipsis":
        return Ellipsis
    if kind == "float":
        return float(value)
    if kind == "dtype":
        return DTYPES[value]
    if kind == "device":
        return torch.device("cpu")  # the loss runs where the log-probs are
    return None  # layout / memory_format: defaults


def _check_arg(x, names: set[str], node: str) -> None:
    if isinstance(x, list):
        for v in x:
            _check_arg(v, names, node)
        return
    if x is None or isinstance(x, (bool, int, float, str)):
        return
    if not isinstance(x, dict) or len(x) != 1:
        raise _bad(node, f"an argument {x!r:.60} is not in the wire's encoding")
    (kind, value), = x.items()
    if kind == "ref":
        if value not in names:
            raise _bad(node, f"refers to {value!r} before it is defined")
    elif kind in ("tuple", "slice"):
        _check_arg(value, names, node)
    elif kind == "dict":
        if not isinstance(value, dict):
            raise _bad(node, "a dict argument must be an object")
        _check_arg(list(value.values()), names, node)
    elif kind == "float":
        if value not in ("inf", "-inf", "nan"):
            raise _bad(node, f"float {value!r} is not inf, -inf or nan")
    elif kind == "dtype":
        if value not in DTYPES:
            raise _bad(node, f"dtype {value!r} is not one of {', '.join(DTYPES)}")
    elif kind not in ("ellipsis", "device", "layout", "memory_format"):
        raise _bad(node, f"argument kind {kind!r} is not allowed")


def build(body: dict) -> CustomLoss:
    """Check a CreateCustomLossRequest's graph against the allowlists and return the loss."""
    name = body.get("name") if isinstance(body.get("name"), str) else "custom"
    inputs = body.get("inputs")
    if not isinstance(inputs, list) or not inputs or len(inputs) > 16:
        raise HttpError(400, "create_custom_loss: inputs must list 1 to 16 {name, rank} (logprobs first)")
    parsed = []
    for i in inputs:
        if not (isinstance(i, dict) and isinstance(i.get("name"), str) and INPUT_NAME.fullmatch(i["name"])
                and i.get("rank") in (0, 1, 2)):
            raise HttpError(400, f"create_custom_loss: input {i!r:.80} must be {{name, rank 0|1|2}}")
        parsed.append((i["name"], i["rank"]))
    if parsed[0][0] != "logprobs" or parsed[0][1] == 0:
        raise HttpError(400, "create_custom_loss: the first input is logprobs, of rank 1 or 2")
    graph = body.get("graph")
    if not isinstance(graph, dict) or graph.get("format") != 1 or not isinstance(graph.get("nodes"), list):
        raise HttpError(400, "create_custom_loss: graph must be {format: 1, nodes: [...]}")
    if len(graph["nodes"]) > MAX_NODES:
        raise HttpError(400, f"create_custom_loss: the graph has more than {MAX_NODES} nodes")
    names: set[str] = set()
    nodes, placeholders, output = [], 0, False
    for raw in graph["nodes"]:
        if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or raw["name"] in names:
            raise HttpError(400, f"create_custom_loss: node {raw!r:.80} needs a unique name")
        node, op, target = raw["name"], raw.get("op"), raw.get("target")
        args, kwargs = raw.get("args", []), raw.get("kwargs", {})
        if not isinstance(args, list) or not isinstance(kwargs, dict) or not isinstance(target, str):
            raise _bad(node, "args must be a list, kwargs an object and target a string")
        _check_arg(args, names, node)
        _check_arg(list(kwargs.values()), names, node)
        out = {"op": op, "name": node, "target": target, "args": args, "kwargs": kwargs}
        if op == "placeholder":
            placeholders += 1
        elif op == "call_function":
            if target == "builtins.getattr":
                if len(args) != 2 or args[1] not in ATTRIBUTES:
                    raise _bad(node, f"getattr of {args[1:]!r:.40}: only {', '.join(sorted(ATTRIBUTES))}")
                out["fn"] = getattr
            elif target in FUNCTIONS:
                out["fn"] = FUNCTIONS[target]
            else:
                raise _bad(node, f"{target} is not an allowed function (pure torch / math / operator functions)")
        elif op == "call_method":
            if target not in METHODS:
                raise _bad(node, f"method {target!r} is not allowed")
        elif op == "output":
            output = True
        else:
            raise _bad(node, f"{op!r} nodes are not allowed (no modules, no captured tensors)")
        names.add(node)
        nodes.append(out)
        if output:
            break
    if not output or placeholders != len(parsed):
        raise HttpError(400, f"create_custom_loss: the graph needs one output and {len(parsed)} placeholders "
                             f"(logprobs and its inputs), it has {placeholders}")
    return CustomLoss(name, parsed, nodes)


def run(loss: CustomLoss, logprobs: list[torch.Tensor], inputs: list[dict]) -> tuple[torch.Tensor, dict]:
    """The summed loss over datums and the metrics reduced by their suffix (`:sum` / `:mean`)."""
    total, sums = None, {}
    for lp, datum in zip(logprobs, inputs):
        args = [lp]
        for name, rank in loss.inputs[1:]:
            if name not in datum:
                raise HttpError(400, f"custom loss {loss.name!r} reads loss_fn_inputs[{name!r}], which a datum lacks")
            t = datum[name].to(lp.dtype) if datum[name].is_floating_point() else datum[name]
            args.append(t.reshape(()) if rank == 0 else t)
        value, metrics = loss(*args)
        if not isinstance(value, torch.Tensor) or value.ndim != 0:
            raise HttpError(400, f"custom loss {loss.name!r} must return a scalar loss")
        if not isinstance(metrics, dict) or not all(isinstance(k, str) and METRIC_KEY.fullmatch(k) for k in metrics):
            raise HttpError(400, f"custom loss {loss.name!r}: metrics must be named custom/<name>:sum|mean")
        total = value if total is None else total + value
        for k, m in metrics.items():
            sums[k] = sums.get(k, 0.0) + float(m.detach() if isinstance(m, torch.Tensor) else m)
    return total, {k: v / len(inputs) if k.endswith(":mean") else v for k, v in sums.items()}
