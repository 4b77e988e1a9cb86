"""A double of ``triton_python_backend_utils`` (Triton Python backend), only what kvgate_llm uses.

Names were read in triton-inference-server/python_backend branch r26.04 (47f9e030):
``src/resources/triton_python_backend_utils.py`` — ``get_input_tensor_by_name`` (walks
``request.inputs()``), ``using_decoupled_model_transaction_policy(model_config: dict)``,
``TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1``; ``src/pb_stub.cc`` — ``Tensor(name, ndarray)``
with ``name()``/``as_numpy()``, ``InferenceRequest.inputs()``/``request_id()``/
``get_response_sender()``, ``InferenceResponse(output_tensors=, error=)``, ``TritonError``,
``TritonModelException``, and the response sender's ``send(response=None, flags=0)`` and
``is_cancelled()``.
"""

from __future__ import annotations

import sys
import threading
import types

import numpy as np


def make_module() -> types.ModuleType:
    mod = types.ModuleType("triton_python_backend_utils")
    mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, value):
            if not isinstance(name, str) or not isinstance(value, np.ndarray):
                raise TypeError("Tensor(name: str, value: numpy.ndarray)")
            self._name, self._value = name, value

        def name(self):
            return self._name

        def as_numpy(self):
            return self._value

    class TritonError:
        def __init__(self, message, code=None):
            self._message = message

        def message(self):
            return self._message

    class TritonModelException(Exception):
        pass

    class InferenceResponse:
        def __init__(self, output_tensors=None, error=None):
            self.output_tensors = list(output_tensors or [])
            self._error = error

        def has_error(self):
            return self._error is not None

        def error(self):
            return self._error

        def tensors(self):
            return {t.name(): t.as_numpy() for t in self.output_tensors}

    class ResponseSender:
        def __init__(self):
            self.responses: list[tuple[InferenceResponse | None, int]] = []
            self.finished = threading.Event()
            self.cancelled = False

        def send(self, response=None, flags=0):
            # python_backend r26.04 src/response_sender.cc UpdateStateAndCounters: a FINAL flag closes the
            # sender and any later send throws PythonBackendException("Unable to send response. Response
            # sender has been closed."), which src/pb_stub.cc registers as pb_utils.TritonModelException.
            if self.finished.is_set():
                raise TritonModelException("Unable to send response. Response sender has been closed.")
            self.responses.append((response, flags))
            if flags & mod.TRITONSERVER_RESPONSE_COMPLETE_FINAL:
                self.finished.set()

        def is_cancelled(self):
            return self.cancelled

    class InferenceRequest:
        def __init__(self, tensors: dict[str, np.ndarray], request_id: str = ""):
            self._inputs = [Tensor(k, v) for k, v in tensors.items()]
            self.sender = ResponseSender()
            self._request_id = request_id

        def inputs(self):
            return list(self._inputs)

        def request_id(self):
            return self._request_id

        def get_response_sender(self):
            return self.sender

    def get_input_tensor_by_name(request, name):
        for tensor in request.inputs():
            if tensor.name() == name:
                return tensor
        return None

    def using_decoupled_model_transaction_policy(model_config):
        if "model_transaction_policy" in model_config:
            return model_config["model_transaction_policy"]["decoupled"]
        return False

    for obj in (Tensor, TritonError, TritonModelException, InferenceResponse, ResponseSender, InferenceRequest,
                get_input_tensor_by_name, using_decoupled_model_transaction_policy):
        setattr(mod, obj.__name__, obj)
    return mod


def install(module: types.ModuleType, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", module)
