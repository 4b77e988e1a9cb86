"""KServe v2 / Triton gRPC tensors <-> numpy, and the model's metadata/config messages.

Request tensors arrive either in ``raw_input_contents`` (one little-endian byte string
per input, in input order — what ``tritonclient`` sends) or in each input's typed
``contents``; both are read. BYTES tensors use Triton's encoding: each element is a
4-byte little-endian length followed by its bytes (``tritonclient.utils.
serialize_byte_tensor``). Messages come from ``tritonclient.grpc.service_pb2`` /
``model_config_pb2`` (generated from triton-inference-server/common
``protobuf/grpc_service.proto`` and ``model_config.proto``).

Invariant: :func:`decode_inputs` returns arrays whose element count matches the declared
shape and whose dtype is the contract's, or raises ``ContractError`` naming the tensor; it
raises nothing else for any message a client can send.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np
from tritonclient.grpc import model_config_pb2, service_pb2
from tritonclient.utils import deserialize_bytes_tensor, serialize_byte_tensor

from engines.contract import INPUTS, MODEL_NAME, ContractError, TensorSpec
from engines.response_tensors import OUTPUTS

MODEL_VERSION = "1"
_INPUT_SPECS: dict[str, TensorSpec] = {spec.name: spec for spec in INPUTS}
_OUTPUT_SPECS: dict[str, TensorSpec] = {spec.name: spec for spec in OUTPUTS}
_NUMPY = {
    "BOOL": np.dtype(np.bool_), "INT8": np.dtype("<i1"), "INT16": np.dtype("<i2"), "INT32": np.dtype("<i4"),
    "INT64": np.dtype("<i8"), "UINT8": np.dtype("<u1"), "UINT16": np.dtype("<u2"), "UINT32": np.dtype("<u4"),
    "UINT64": np.dtype("<u8"), "FP32": np.dtype("<f4"), "FP64": np.dtype("<f8"),
}
_CONTENTS_FIELD = {
    "BOOL": "bool_contents", "INT32": "int_contents", "INT64": "int64_contents", "UINT32": "uint_contents",
    "UINT64": "uint64_contents", "FP32": "fp32_contents", "FP64": "fp64_contents", "BYTES": "bytes_contents",
}
_CONFIG_TYPES = {
    "BOOL": model_config_pb2.TYPE_BOOL, "INT32": model_config_pb2.TYPE_INT32, "UINT64": model_config_pb2.TYPE_UINT64,
    "FP32": model_config_pb2.TYPE_FP32, "BYTES": model_config_pb2.TYPE_STRING,
}


def decode_inputs(request: service_pb2.ModelInferRequest) -> dict[str, np.ndarray]:
    """All input tensors of ``request`` as numpy arrays (validated against the contract)."""
    raw = list(request.raw_input_contents)
    if raw and len(raw) != len(request.inputs):
        raise ContractError(
            f"raw_input_contents has {len(raw)} entries for {len(request.inputs)} inputs", tensor=None
        )
    tensors: dict[str, np.ndarray] = {}
    for index, tensor in enumerate(request.inputs):
        name = tensor.name
        spec = _INPUT_SPECS.get(name)
        if spec is None:
            raise ContractError(f"unexpected inference input '{name}' for model '{MODEL_NAME}'", tensor=name)
        if name in tensors:
            raise ContractError(f"input '{name}' is given twice", tensor=name)
        if tensor.datatype != spec.datatype:
            raise ContractError(
                f"input '{name}' has datatype {tensor.datatype or '(none)'}, model expects {spec.datatype}", tensor=name
            )
        shape = tuple(int(d) for d in tensor.shape)
        if any(d < 0 for d in shape):
            raise ContractError(f"input '{name}' has a negative dimension in shape {list(shape)}", tensor=name)
        # Python ints: np.prod wraps past int64 (a shape of [2**33, 2**31] counted 0 elements).
        count = math.prod(shape)
        payload = raw[index] if raw else None
        capacity = _capacity(tensor, payload)
        if count > capacity:
            raise ContractError(
                f"input '{name}' has shape {list(shape)} ({count} elements), more than its contents can hold ({capacity})",
                tensor=name,
            )
        array = _decode_one(name, tensor, payload, count)
        try:
            tensors[name] = array.reshape(shape)
        except ValueError as exc:  # e.g. a dimension numpy cannot index, next to a 0
            raise ContractError(f"input '{name}' cannot take shape {list(shape)}: {exc}", tensor=name) from None
    return tensors


def check_requested_outputs(request: service_pb2.ModelInferRequest) -> None:
    """ContractError naming the first requested output the model does not have (Triton refuses it
    too); a silently dropped output would leave the client reading a tensor that is not there."""
    for output in request.outputs:
        if output.name not in _OUTPUT_SPECS:
            raise ContractError(
                f"unexpected inference output '{output.name}' for model '{MODEL_NAME}'", tensor=output.name
            )


def _capacity(tensor, raw: bytes | None) -> int:
    """The most elements ``tensor``'s payload can hold (a BYTES element takes at least its 4-byte length)."""
    if raw is not None:
        return len(raw) // (4 if tensor.datatype == "BYTES" else _NUMPY[tensor.datatype].itemsize)
    return len(getattr(tensor.contents, _CONTENTS_FIELD[tensor.datatype]))


def _decode_one(name: str, tensor, raw: bytes | None, count: int) -> np.ndarray:
    datatype = tensor.datatype
    if datatype == "BYTES":
        if raw is not None:
            try:
                array = deserialize_bytes_tensor(raw) if raw else np.array([], dtype=np.object_)
            except Exception as exc:
                raise ContractError(f"input '{name}' is not a valid BYTES tensor: {exc}", tensor=name) from exc
        else:
            array = np.array(list(tensor.contents.bytes_contents), dtype=np.object_)
    else:
        dtype = _NUMPY[datatype]
        if raw is not None:
            if len(raw) != count * dtype.itemsize:
                raise ContractError(
                    f"input '{name}' has {len(raw)} bytes, expected {count * dtype.itemsize} for its shape",
                    tensor=name,
                )
            array = np.frombuffer(raw, dtype=dtype).copy()
        else:
            array = np.array(list(getattr(tensor.contents, _CONTENTS_FIELD[datatype])), dtype=dtype)
    if array.size != count:
        raise ContractError(f"input '{name}' holds {array.size} elements, its shape says {count}", tensor=name)
    return array


def encode_outputs(
    response: service_pb2.ModelInferResponse, tensors: Mapping[str, np.ndarray], requested: set[str] | None = None
) -> service_pb2.ModelInferResponse:
    """Append ``tensors`` (name -> array) to ``response`` as raw outputs."""
    for name, array in tensors.items():
        if requested and name not in requested:
            continue
        spec = _OUTPUT_SPECS[name]
        output = response.outputs.add()
        output.name = name
        output.datatype = spec.datatype
        output.shape.extend(array.shape)
        if spec.datatype == "BYTES":
            serialized = serialize_byte_tensor(np.asarray(array, dtype=np.object_))
            response.raw_output_contents.append(serialized.item() if serialized.size else b"")
        else:
            response.raw_output_contents.append(np.ascontiguousarray(array, dtype=_NUMPY[spec.datatype]).tobytes())
    return response


def model_metadata() -> service_pb2.ModelMetadataResponse:
    def meta(spec: TensorSpec):
        return service_pb2.ModelMetadataResponse.TensorMetadata(name=spec.name, datatype=spec.datatype, shape=list(spec.shape))

    return service_pb2.ModelMetadataResponse(
        name=MODEL_NAME, versions=[MODEL_VERSION], platform="kvgate_reference",
        inputs=[meta(s) for s in INPUTS], outputs=[meta(s) for s in OUTPUTS],
    )


def model_config(*, max_input_len: int, max_output_len: int) -> model_config_pb2.ModelConfig:
    """The config a Triton ``config.pbtxt`` for this model would hold (decoupled, no batching)."""
    config = model_config_pb2.ModelConfig(
        name=MODEL_NAME, backend="kvgate_reference", max_batch_size=0,
        model_transaction_policy=model_config_pb2.ModelTransactionPolicy(decoupled=True),
    )
    for spec in INPUTS:
        # Every input is optional to Triton: the stats call sends only kv_stats (see contract).
        config.input.add(name=spec.name, data_type=_CONFIG_TYPES[spec.datatype], dims=list(spec.shape), optional=True)
    for spec in OUTPUTS:
        config.output.add(name=spec.name, data_type=_CONFIG_TYPES[spec.datatype], dims=list(spec.shape))
    config.parameters["max_input_len"].string_value = str(max_input_len)
    config.parameters["max_output_len"].string_value = str(max_output_len)
    return config
