"""Capturing the sufficient factors of Dense layers while the replica function is traced.

While a :class:`CaptureSession` is active on a thread (the sync algorithm enters it through the
strategy's ``tracing_replica_function()`` hook), ``keras.layers.Dense.call`` is replaced, on that
thread only, by one whose matmul carries a ``tf.custom_gradient``. Its gradient function
computes exactly what TensorFlow's own MatMul gradient computes (dx = δ·Wᵀ, dW = xᵀ·δ) and
records the factors (x, δ) against the dW tensor it returns. When that exact tensor reaches the
gradient reduction, :meth:`CaptureSession.match` finds its factors; if the reduction sends the
factors instead, nothing uses the local dW any more and TensorFlow prunes its MatMul from the
graph. The model is never changed: the swap lasts only as long as the session (the class
attribute is restored when the last session on any thread ends), so saved and exported models
hold plain Keras layers.

What is captured: a ``keras.layers.Dense`` (or subclass that reaches ``Dense.call``) whose input
is a 2-D floating tensor of the layer's own dtype, neither quantized nor LoRA-enabled, called
while a step is traced (a step compiled with ``run_eagerly=True`` all-reduces dW). Dense
layers with inputs of more rank (sequences: K would be batch×time) are recorded as skipped, with
the reason, for the plan.

A gradient that arrives as an ``AddN`` (Keras adds a ``kernel_regularizer``'s gradient that way)
matches when exactly one of its inputs is a captured dW; the other inputs are the gradient's
*extra part*. :func:`replica_invariant` tells whether that part is the same on every rank (it
depends only on constants and the synchronized variables, like a regularizer's gradient), in
which case the reduction can compute its sum over ranks locally.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import threading
from typing import Sequence

import tensorflow as tf

_local = threading.local()  # .sessions: list[CaptureSession] (innermost last)
_install_lock = threading.Lock()
_install_count = 0
_original_call = None


@dataclasses.dataclass
class DenseCall:
    """One forward call of a captured Dense layer during the trace."""

    layer: object  # the keras.layers.Dense
    kernel_name: str  # the kernel variable's path, e.g. "sequential/dense/kernel"
    m: int  # kernel rows (input features)
    n: int  # kernel columns (units)
    rows: int | None  # static row count of the input (local batch K), None if dynamic


@dataclasses.dataclass
class Factors:
    """What one captured call's gradient recorded: dW = Uᵀ·V, with U = x [K, M], the layer's
    input, and V = δ [K, N], the gradient at its output."""

    call: DenseCall
    u: tf.Tensor
    v: tf.Tensor
    grad: tf.Tensor  # the local dW the custom gradient returned


@dataclasses.dataclass
class Match:
    """How a kernel gradient that reached the reduction relates to the captured factors.

    ``factors`` is None when the gradient is not (or not only) one captured product; ``reason``
    then says why SFB cannot reduce it. ``extra`` are the parts of an ``AddN`` other than the
    captured product, ``extra_invariant`` whether they are equal on every rank.
    """

    kernel_name: str
    m: int
    n: int
    rows: int | None
    factors: Factors | None
    extra: list[tf.Tensor]
    extra_invariant: bool
    reason: str | None


class CaptureSession:
    """The Dense calls and gradient factors of one traced replica function (one thread)."""

    def __init__(self):
        self.calls: dict[int, list[DenseCall]] = collections.defaultdict(list)  # id(layer)
        self.skipped: dict[str, tuple[tuple[int, int] | None, str]] = {}  # kernel name
        self._factors: dict = {}  # grad.ref() -> Factors

    def record_call(self, call: DenseCall) -> None:
        self.calls[id(call.layer)].append(call)

    def record_skip(self, layer, reason: str) -> None:
        name = _kernel_name(layer)
        shape = tuple(layer._kernel.shape) if getattr(layer, "_kernel", None) is not None \
            else None
        self.skipped.setdefault(name, (shape, reason))

    def record_factors(self, factors: Factors) -> None:
        self._factors[factors.grad.ref()] = factors

    def match(self, grad: tf.Tensor, variables: Sequence[tf.Variable]) -> Match | None:
        """The Match of ``grad`` (a gradient arriving at the reduction), None if it is not the
        kernel gradient of a captured Dense layer. ``variables``: the variables being
        synchronized (reads of them count as equal on every rank)."""
        factors = self._factors.get(grad.ref())
        parts: list[tf.Tensor] = []
        if factors is None and not tf.executing_eagerly() and grad.op.type == "AddN":
            parts = list(grad.op.inputs)
            found = [self._factors[p.ref()] for p in parts if p.ref() in self._factors]
            if not found:
                return None
            factors = found[0]
            if len(found) > 1:
                uses = len(self.calls[id(factors.call.layer)])
                return self._refuse(factors.call, f"kernel used {uses} times per step "
                                    "(shared layer)")
            parts = [p for p in parts if p.ref() not in self._factors]
        if factors is None:
            return None
        call = factors.call
        uses = len(self.calls[id(call.layer)])
        if uses > 1:
            return self._refuse(call, f"kernel used {uses} times per step (shared layer)")
        invariant = all(replica_invariant(p, variables) for p in parts)
        if not invariant:
            return self._refuse(call, "kernel also used outside its Dense call (its gradient "
                                "has a data-dependent extra part)")
        return Match(call.kernel_name, call.m, call.n, call.rows, factors, parts, True, None)

    def _refuse(self, call: DenseCall, reason: str) -> Match:
        return Match(call.kernel_name, call.m, call.n, call.rows, None, [], False, reason)


def active_session() -> CaptureSession | None:
    sessions = getattr(_local, "sessions", None)
    return sessions[-1] if sessions else None


@contextlib.contextmanager
def capturing(session: CaptureSession):
    """Within it, Dense layers called on this thread record their factors into ``session``.

    Installs the replacement ``Dense.call`` (reference-counted over threads and nesting) and
    restores Keras' own when the last session ends.
    """
    _install()
    sessions = getattr(_local, "sessions", None)
    if sessions is None:
        sessions = _local.sessions = []
    sessions.append(session)
    try:
        yield session
    finally:
        sessions.pop()
        _uninstall()


def _install() -> None:
    global _install_count, _original_call
    import keras
    with _install_lock:
        if _install_count == 0:
            _original_call = keras.layers.Dense.call
            keras.layers.Dense.call = _capturing_call
        _install_count += 1


def _uninstall() -> None:
    global _install_count
    import keras
    with _install_lock:
        _install_count -= 1
        if _install_count == 0:
            # _original_call stays set: another thread may have looked up the replacement
            # just before it was removed, and calls through it to Keras' own.
            keras.layers.Dense.call = _original_call


def _kernel_name(layer) -> str:
    kernel = getattr(layer, "_kernel", None)
    path = getattr(kernel, "path", None) or getattr(kernel, "name", None)
    return path or f"{layer.name}/kernel"


def _ineligible(layer, inputs) -> str | None:
    """Why ``layer``'s call on ``inputs`` cannot be captured (None: it can)."""
    if tf.executing_eagerly():
        # The factors replace dW only where TensorFlow can prune dW's MatMul from a graph;
        # an eager step has computed it already (and tf.custom_gradient sees the kernel read).
        return "the step runs eagerly (run_eagerly=True): factors are captured in traced steps"
    if getattr(layer, "quantization_mode", None) is not None:
        return f"quantized kernel ({layer.quantization_mode})"
    if getattr(layer, "lora_enabled", False):
        return "LoRA-enabled kernel"
    kernel = getattr(layer, "_kernel", None)
    if kernel is None:
        return "no kernel variable"
    if not isinstance(inputs, tf.Tensor) or isinstance(inputs, tf.SparseTensor):
        return "input is not a dense tensor"
    rank = inputs.shape.rank
    if rank != 2:
        return (f"input has {rank} dimensions (SFB needs 2-D input: K would be the product "
                "of the leading dimensions)" if rank is not None else "input rank unknown")
    if inputs.dtype not in (tf.float32, tf.float16, tf.bfloat16):
        return f"input dtype {inputs.dtype.name} (SFB carries float32, float16, bfloat16)"
    if inputs.dtype != tf.as_dtype(kernel.dtype):
        return (f"input dtype {inputs.dtype.name} differs from the kernel's {kernel.dtype} "
                "(mixed precision)")
    return None


def _capturing_call(self, inputs, training=None):
    """``Dense.call`` with a factor-recording matmul (see the module docstring)."""
    session = active_session()
    if session is None:
        return _original_call(self, inputs, training=training)
    reason = _ineligible(self, inputs)
    if reason is not None:
        session.record_skip(self, reason)
        return _original_call(self, inputs, training=training)
    from keras import ops
    kernel = ops.convert_to_tensor(self.kernel)
    m, n = (int(d) for d in kernel.shape)
    call = DenseCall(self, _kernel_name(self), m, n, inputs.shape[0])
    session.record_call(call)
    # The rest is Dense.call of Keras 3.15 with the matmul replaced.
    x = _recording_matmul(inputs, kernel, call, session)
    if self.bias is not None:
        x = ops.add(x, self.bias)
    if self.activation is not None:
        x = self.activation(x)
    return x


def _recording_matmul(x: tf.Tensor, kernel: tf.Tensor, call: DenseCall,
                      session: CaptureSession) -> tf.Tensor:
    @tf.custom_gradient
    def matmul(x, kernel):
        def grad(dy):
            # TensorFlow's own MatMul gradient, op for op.
            dx = tf.matmul(dy, kernel, transpose_b=True)
            dkernel = tf.matmul(x, dy, transpose_a=True)
            session.record_factors(Factors(call, x, dy, dkernel))
            return dx, dkernel
        return tf.matmul(x, kernel), grad
    return matmul(x, kernel)


# -- is a tensor the same on every rank? ----------------------------------------------------

_WALK_BUDGET = 20000  # ops visited at most; beyond, the answer is "not known to be invariant"


def replica_invariant(tensor: tf.Tensor, variables: Sequence[tf.Variable]) -> bool:
    """True if ``tensor``'s value provably depends only on constants and reads of
    ``variables`` (equal on every rank in sync mode), so it is the same on every rank.

    Conservative: function inputs (the batch), iterator and random ops, other stateful ops,
    reads of other variables, and graphs larger than the walk budget all answer False.
    """
    if tf.executing_eagerly() or not hasattr(tensor, "op"):
        return False
    handles = [v.handle for v in variables if hasattr(v, "handle")]
    memo: dict[str, bool] = {}
    budget = [_WALK_BUDGET]

    def synced_read(op) -> bool:
        source = _capture_source(op.inputs[0])
        return any(source is h for h in handles)

    def invariant(op) -> bool:
        if op.name in memo:
            return memo[op.name]
        budget[0] -= 1
        if budget[0] < 0:
            return False
        memo[op.name] = False  # cycles (none in a FuncGraph) stay False
        if op.type == "Const":
            result = True
        elif op.type == "ReadVariableOp":
            result = synced_read(op)
        elif op.type == "Placeholder" or _is_stateful(op):
            result = False
        else:
            result = all(invariant(t.op) for t in op.inputs)
        memo[op.name] = result
        return result

    return invariant(tensor.op)


def _is_stateful(op) -> bool:
    try:
        return bool(op._is_stateful)  # pylint: disable=protected-access
    except AttributeError:
        return True


def _capture_source(tensor):
    """The outermost tensor that ``tensor`` (a placeholder of a function or loop body graph)
    captures: for a variable's handle, the variable's own eager handle."""
    for _ in range(32):  # nesting depth of function and loop bodies
        if not tf.is_symbolic_tensor(tensor) or tensor.op.type != "Placeholder":
            break
        outer = next((external for external, internal in getattr(tensor.graph, "captures", ())
                      if internal is tensor), None)
        if outer is None:
            break
        tensor = outer
    return tensor
