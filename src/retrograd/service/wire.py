"""Tinker's protobuf wire format, server side: decode a `forward_backward` request, encode the
`ForwardBackwardOutput` and `SampleResponse` results (the SDK refuses JSON for those two since
0.25). The message classes are the SDK's own generated module (`tinker.proto.tinker_public_pb2`,
Apache-2.0), so the SDK version pinned in the `[service]` extra defines the format.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from retrograd.errors import RetrogradError


class WireError(RetrogradError):
    """A request body that does not decode (reported to the client as a 400)."""


def _pb():
    try:
        from tinker.proto import tinker_public_pb2
    except ImportError:
        raise RetrogradError("retrograd serve needs the tinker SDK's wire format: "
                             'pip install "retrograd[service]"') from None
    return tinker_public_pb2


@dataclass
class Datum:
    tokens: list[int]
    inputs: dict[str, np.ndarray] = field(default_factory=dict)  # float32 / int64, shaped
    # provenance of the target positions, in order: ("sampled" | "prompt", sequence_id, offset, length)
    target_spans: list[tuple[str, str, int, int]] = field(default_factory=list)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict
    forward_only: bool
    data: list[Datum]


def _tensor(msg, name: str) -> np.ndarray:
    pb = _pb()
    dtypes = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    if msg.dtype not in dtypes:
        raise WireError(f"loss_fn_inputs[{name!r}]: unsupported dtype {msg.dtype}")
    dtype = dtypes[msg.dtype]
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):  # 2-D CSR (the SDK's form of [N, K] targets / weights)
        values = np.frombuffer(msg.sparse_csr.values, dtype=dtype)
        crow = np.frombuffer(msg.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(msg.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1:
            raise WireError(f"loss_fn_inputs[{name!r}]: a sparse tensor must be 2-D CSR")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            dense[r, col[crow[r]:crow[r + 1]]] = values[crow[r]:crow[r + 1]]
        return dense
    arr = np.frombuffer(msg.dense, dtype=dtype)
    if shape:
        if int(np.prod(shape)) != arr.size:
            raise WireError(f"loss_fn_inputs[{name!r}]: shape {shape} does not hold {arr.size} values")
        arr = arr.reshape(shape)
    return arr.astype(np.int64) if dtype == np.int32 else arr.copy()


def decode_forward_backward(body: bytes) -> FwdBwdRequest:
    pb = _pb()
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # protobuf raises DecodeError (not exported under a stable name)
        raise WireError(f"forward_backward: the body is not a ForwardBackwardRequest protobuf ({e})") from None
    config = {k: v for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():  # v2 carries strings too and wins when present
        config[k] = v.text if v.WhichOneof("value") == "text" else v.number
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for chunk in d.model_input:
            kind = chunk.WhichOneof("chunk")
            if kind != "encoded_text":
                raise WireError(f"datum {i}: {kind} chunks are not supported by this server (text models only)")
            tokens.extend(np.frombuffer(chunk.encoded_text.tokens, dtype=np.int32).tolist())
        spans = []
        for span in d.loss_fn_input_spans:
            kind = "sampled" if span.WhichOneof("span") == "sampled_tokens" else "prompt"
            part = span.sampled_tokens if kind == "sampled" else span.prompt_tokens
            spans.append((kind, part.sequence_id, int(part.offset), int(part.length)))
        data.append(Datum(tokens, {name: _tensor(t, name) for name, t in d.loss_fn_inputs.items()}, spans))
    return FwdBwdRequest(msg.model_id, int(msg.seq_id), msg.loss_fn, config, bool(msg.forward_only), data)


def _batched(arrays: list[np.ndarray]) -> object:
    pb = _pb()
    bt = pb.BatchedTensor()
    arrs = [np.ascontiguousarray(a, dtype=np.float32) for a in arrays]
    sizes = [a.nbytes for a in arrs]
    bt.data = b"".join(a.tobytes() for a in arrs)
    bt.offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64).tobytes()
    bt.dtype = pb.DTYPE_FLOAT32
    trailing = arrs[0].shape[1:] if arrs and arrs[0].ndim > 1 else ()
    bt.trailing_shape.extend(int(s) for s in trailing)
    return bt


def encode_forward_backward_output(logprobs: list[np.ndarray], metrics: dict[str, float]) -> bytes:
    """One ArrayRecord with a `logprobs` field per datum; metric keys must be `name:reduction`."""
    pb = _pb()
    out = pb.ForwardBackwardOutput()
    out.loss_fn_output_type = "ArrayRecord"
    record = out.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(logprobs)
    if logprobs:
        record.fields["logprobs"].CopyFrom(_batched(logprobs))
    for k, v in metrics.items():
        out.metrics[k] = float(v)
    return out.SerializeToString()


def _topk(ids: np.ndarray, logps: np.ndarray):
    pb = _pb()
    t = pb.TopkLogprobs()
    t.length, t.k = int(ids.shape[0]), int(ids.shape[1])
    t.token_ids = np.ascontiguousarray(ids, dtype=np.int32).tobytes()
    t.logprobs = np.ascontiguousarray(logps, dtype=np.float32).tobytes()
    return t


def encode_sample_response(sequences: list[dict], prompt_logprobs: np.ndarray | None = None,
                           topk_prompt: tuple[np.ndarray, np.ndarray] | None = None) -> bytes:
    """sequences: dicts with tokens, logprobs, stopped (EOS / stop string, else length)."""
    pb = _pb()
    out = pb.SampleResponse()
    for s in sequences:
        seq = out.sequences.add()
        seq.stop_reason = pb.STOP_REASON_STOP if s["stopped"] else pb.STOP_REASON_LENGTH
        seq.tokens = np.asarray(s["tokens"], dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        out.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    if topk_prompt is not None:
        out.topk_prompt_logprobs.CopyFrom(_topk(*topk_prompt))
    return out.SerializeToString()
