"""The decoupled python models (cpu ``tensorrt_llm``, ``tensorrt_llm_bls``) send only the outputs a request asked for.

python_backend r24.10 (the bundled tritonserver 2.51) drops a response's other outputs in
``ResponseSender::Send`` with the GIL released and frees their numpy arrays without it; with another
thread of the model running Python, the stub then crashes or hangs within seconds
(``rtk_text.requested_outputs``; docs/serving.md, "Only requested outputs").
``triton_python_backend_utils`` exists only inside the python backend's stub, so :class:`FakePbUtils`
stands in for it here: it records the tensors a response is made of.  The responses' contents are
checked against a real tritonserver in test_serve_tiny.py.
"""

from __future__ import annotations

import importlib.util
import sys
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from toolkit.triton.config import client_outputs, tensorrt_llm_outputs
from toolkit.triton.models.rtk_text import PERF_OUTPUTS

MODELS = Path(__file__).resolve().parents[1] / "toolkit" / "triton" / "models"


class FakePbUtils(types.ModuleType):
    """Stand-in for ``triton_python_backend_utils``: a Tensor is its name and array, a response its tensors."""

    TRITONSERVER_RESPONSE_COMPLETE_FINAL = 1

    class Tensor:
        def __init__(self, name, array):
            self._name, self._array = name, array

        def name(self):
            return self._name

        def as_numpy(self):
            return self._array

    class InferenceResponse:
        def __init__(self, output_tensors=(), error=None):
            self.tensors, self.error = list(output_tensors), error


def load_model(name: str, monkeypatch):
    monkeypatch.setitem(sys.modules, "triton_python_backend_utils", FakePbUtils("triton_python_backend_utils"))
    monkeypatch.syspath_prepend(str(MODELS))
    spec = importlib.util.spec_from_file_location(f"rtk_test_{name}", MODELS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def names(response) -> set[str]:
    return {t.name() for t in response.tensors}


@pytest.fixture
def cpu_model(monkeypatch):
    return load_model("tensorrt_llm_cpu", monkeypatch)


def cpu_response(m, requested):
    """The response the cpu model makes for a stream that asked for every optional output."""
    model = m.TritonPythonModel.__new__(m.TritonPythonModel)  # _response needs none of initialize's state
    s = m._Stream(None, m._Group(None, 1, frozenset(requested)), 0, "t", [1, 2, 3])
    s.engine_id, s.generated, s.log_probs = "e1", [7, 8], [-0.5, -0.25]
    s.want_log_probs = s.want_perf = s.want_in = s.want_out = True
    s.kv, s.dropped = (1, 2), 0
    return model._build(s, model._response(s, [7, 8], 3, 2))


def test_the_cpu_model_makes_every_output_it_serves_when_all_are_requested(cpu_model):
    declared = {t.name for t in tensorrt_llm_outputs(rtk_extensions=True)}
    got = names(cpu_response(cpu_model, declared))
    assert got <= declared
    assert {"output_ids", "sequence_length", "preceding_ids", "sequence_index", "cum_log_probs"} <= got
    assert {*PERF_OUTPUTS, "kv_cache_reused_blocks", "num_output_tokens", "request_key", "dropped_turns"} <= got


def test_the_cpu_model_makes_only_the_requested_outputs(cpu_model):
    declared = {t.name for t in tensorrt_llm_outputs(rtk_extensions=True)}
    served = names(cpu_response(cpu_model, declared))
    assert names(cpu_response(cpu_model, {"output_ids", "sequence_length"})) == {"output_ids", "sequence_length"}
    for name in sorted(declared):
        assert names(cpu_response(cpu_model, {name})) == {name} & served, name
    assert names(cpu_response(cpu_model, set())) == set()


def test_the_cpu_models_outputs_keep_their_values_when_filtered(cpu_model):
    full = {t.name(): t.as_numpy() for t in cpu_response(cpu_model, {"output_ids", "cum_log_probs"}).tensors}
    np.testing.assert_array_equal(full["output_ids"], np.array([[[7, 8]]], dtype=np.int32))
    np.testing.assert_allclose(full["cum_log_probs"], [[-0.75]])


def test_a_cpu_response_is_what_its_stream_was_when_the_token_came_not_when_it_is_sent(cpu_model):
    """A decoupled stream's response is made on its sender thread while the engine steps on: what it reports is
    read from the stream in the token's callback (``_response``), not when the sender makes it (``_build``)."""
    m = cpu_model
    model = m.TritonPythonModel.__new__(m.TritonPythonModel)
    wanted = {"output_ids", "preceding_ids", "cum_log_probs", "num_output_tokens", "kv_cache_reused_blocks"}
    s = m._Stream(None, m._Group(None, 1, frozenset(wanted)), 0, "t", [1, 2, 3])
    s.engine_id, s.generated, s.log_probs = "e1", [7, 8], [-0.5, -0.25]
    s.want_log_probs = s.want_perf = s.want_out = True
    s.want_in, s.kv, s.dropped = False, (1, 2), None
    reply = model._response(s, [8], 4, 1)
    s.generated.append(9)  # the next step's token, before the sender thread gets to the reply
    s.log_probs.append(-4.0)
    s.kv = (2, 3)
    got = {t.name(): t.as_numpy() for t in model._build(s, reply).tensors}
    np.testing.assert_array_equal(got["output_ids"], [[[8]]])
    np.testing.assert_array_equal(got["preceding_ids"], [[1, 2, 3, 7]])
    np.testing.assert_allclose(got["cum_log_probs"], [[-0.75]])
    assert got["num_output_tokens"].item() == 2 and got["kv_cache_reused_blocks"].item() == 1


def test_the_bls_model_makes_only_the_requested_outputs(monkeypatch):
    m = load_model("tensorrt_llm_bls", monkeypatch)
    model = m.TritonPythonModel.__new__(m.TritonPythonModel)
    pb = sys.modules["triton_python_backend_utils"]
    extras = [pb.Tensor("cum_log_probs", np.zeros((1, 1), np.float32)), pb.Tensor("sequence_index", np.zeros((1, 1)))]
    declared = {t.name for t in client_outputs(dropped_turns=True)}
    everything = model._response(frozenset(declared), "hi", extras, 0)
    assert names(everything) == {"text_output", "cum_log_probs", "sequence_index", "dropped_turns"}
    only = model._response(frozenset({"text_output"}), "hi", extras, 0)
    assert names(only) == {"text_output"} and only.tensors[0].as_numpy()[0] == b"hi"
    assert names(model._response(frozenset({"sequence_index"}), "hi", extras, 0)) == {"sequence_index"}


class _Log:
    def __init__(self):
        self.errors = []

    def log_error(self, message):
        self.errors.append(message)


def test_the_cpu_models_sender_keeps_each_requests_order_and_sends_requests_side_by_side(cpu_model):
    """Each Triton request's responses go out in order, and a request whose send the server holds up does not
    hold up another request's (tritonserver takes one response at a time per sending thread)."""
    log = _Log()
    sender = cpu_model._Sender(log, cpu_model.SENDER_LANES)
    a, b = sender.lane(), sender.lane()
    assert a != b
    held, sent, names = threading.Event(), [], set()

    def deliver(request, i):
        names.add(Path(f"/proc/self/task/{threading.get_native_id()}/comm").read_text().strip())
        if (request, i) == ("a", 0):
            assert held.wait(10), "request b's responses queued behind request a's"
        sent.append((request, i))
        if (request, i) == ("b", 2):
            held.set()

    for i in range(3):
        sender.put(a, deliver, "a", i)
    for i in range(3):
        sender.put(b, deliver, "b", i)
    sender.close()
    assert log.errors == []
    assert [x for x in sent if x[0] == "a"] == [("a", 0), ("a", 1), ("a", 2)]
    assert [x for x in sent if x[0] == "b"] == [("b", 0), ("b", 1), ("b", 2)]
    assert sent.index(("b", 2)) < sent.index(("a", 0))
    assert names == {"rtk-sender"}  # the OS's name of the sending threads (top -H, bench_serving.py)
