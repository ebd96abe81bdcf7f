"""The layer engine (Keras layers, PyTorch modules: lstmgrad_cli/layers/) on a GPU backend computes on its device.

Run on the cupy backend built for the host (tests/cuda_host.py: numpy as the device, its arrays marked as the
device's, only the functions cupy has too): a layer's tensors cross to the device once each, the recomputed
forward, the schedule's reordering, the gradient, the activations' recurrence and the merges of directions and
layers run there (no ufunc is given a host array beside a device one), and each gradient comes back once, equal
bit for bit to the numpy backend's.  Computed through ``lstmgrad_cli.load(...).gradients``, the path ``lstmgrad
seq`` takes (problem/gradients.py), and the Python API.

Bit for bit where numpy's products see the same memory layouts on both: the backend's ``to_device`` makes arrays
C-contiguous, and an unbatched projected module's Fortran-ordered weights then round differently in the last bits
(a GPU's cuBLAS rounds its own way anyway).
"""

from __future__ import annotations

import json
import types
from pathlib import Path

import cuda_host
import numpy as np
import pytest

import lstmgrad_cli as lg
from lstmgrad_cli.backends import get_backend
from lstmgrad_cli.layers import device as devices

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"
KERAS, TORCH = FIXTURES / "keras", FIXTURES / "torch"
TORCH_CASES = {c["name"]: c for c in json.loads((TORCH / "manifest.json").read_text())}

pytestmark = pytest.mark.skipif(cuda_host.compiler() is None, reason="no C compiler to build the cupy backend's "
                                                                     "kernels for the host")


def layer_tensors(T, B, I, C, directions=((None, None),), states=1, grads=()):  # noqa: E741
    """The float tensors of a layer as the engine holds them (what must cross to the device, once each): x
    [T, B, I] time-major, each direction's w [I' + H, 4C] and b [4C] (``directions``: (input width, h width) of
    each, None for I and C), h0 and c0 [states, B, C] (zeros where the file has none), and the gradients given."""
    shapes = [(T, B, I), (states, B, C), (states, B, C), *grads]
    for width, h in directions:
        shapes += [((width or I) + (h or C), 4 * C), (4 * C,)]
    return sorted(shapes)


CASES = {
    # a Keras LSTM layer, the op's own maths (lstmgrad seq computes it as BlockLSTMGradV2): x [B=3, T=5, I=4], C=3
    "keras layer": ((KERAS / "keras_seq.in.npz", {}), layer_tensors(5, 3, 4, 3, grads=[(5, 3, 3)])),
    # a Keras Bidirectional (concat) of two layers, C=2, with their states and final-state gradients
    "keras bidirectional": ((KERAS / "keras_bidir_concat.in.npz", {"weights": KERAS / "keras_bidir_concat.keras"}),
                            layer_tensors(5, 2, 3, 2, directions=((None, None),) * 2, states=2, grads=[(5, 2, 4)])),
    # a Keras layer made with activation="relu": the engine's own recurrence
    "keras relu": ((KERAS / "keras_relu.in.npz", {"weights": KERAS / "keras_relu.keras"}),
                   layer_tensors(5, 2, 3, 4, grads=[(5, 2, 4)])),
    # a PyTorch nn.LSTM, 2 layers x 2 directions, batch-first, packed with lengths [2, 5, 1, 5]; the second layer
    # reads the first's two directions (6 wide); gradients at out and h_n
    "torch stacked packed": ((TORCH / "torch_packed_bidir2_bf.in.npz",
                              {"weights": TORCH / "torch_packed_bidir2_bf.weights.safetensors", "batch_first": True}),
                             layer_tensors(5, 4, 4, 3, directions=((None, None),) * 2 + ((6, None),) * 2, states=4,
                                           grads=[(5, 4, 6), (4, 4, 3)])),
}


def on_both(path, options, **stand_in):
    """The gradients of one input on the cupy backend built for the host, and on the numpy backend."""
    on_device = lg.load(path, **options).gradients(backend=cuda_host.cupy_backend(**stand_in))
    return on_device, lg.load(path, **options).gradients(backend="numpy")


def assert_same_bits(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for name, value in want.items():
        assert type(got[name]) is np.ndarray, name  # back on the host
        assert got[name].dtype == value.dtype and got[name].shape == value.shape, name
        np.testing.assert_array_equal(got[name], value, err_msg=name)


@pytest.mark.parametrize("case", list(CASES))
def test_a_layer_on_a_gpu_backend_crosses_once_each_way_and_gives_the_hosts_bits(case):
    (path, options), tensors = CASES[case]
    copied, host_operands = [], []
    got, want = on_both(path, options, copied=copied, host_operands=host_operands)
    assert_same_bits(got, want)
    assert host_operands == []  # every operation on device arrays only
    floats_in = sorted(shape for way, dtype, shape in copied if way == "in" and dtype.kind == "f")
    assert floats_in == tensors  # each of the layer's tensors once
    steps = max(t[0] * t[1] for t in tensors if len(t) == 3)  # T * B
    index_in = [(dtype, shape) for way, dtype, shape in copied if way == "in" and dtype.kind != "f"]
    assert all(dtype.kind in "iub" and int(np.prod(shape)) <= steps for dtype, shape in index_in)  # (a schedule's)
    out = sorted(shape for way, dtype, shape in copied if way == "out")
    assert out == sorted(value.shape for value in got.values())  # each gradient once


def test_a_projected_pytorch_module_runs_on_the_device_too():
    """PyTorch's proj_size (the engine's own recurrence with h = (o * tanh(c)) @ weight_hr^T), 2 layers x 2
    directions, packed: the projections cross once and their gradients come back once."""
    options = {"weights": TORCH / "torch_proj_bidir2_packed_bf.weights.safetensors", "batch_first": True,
               "weights_group": "encoder.rnn"}
    copied, host_operands = [], []
    got, want = on_both(TORCH / "torch_proj_bidir2_packed_bf.in.npz", options, copied=copied,
                        host_operands=host_operands)
    assert_same_bits(got, want)
    assert host_operands == [] and any(name.startswith("weight_hr") for name in got)
    assert sorted(shape for way, _, shape in copied if way == "out") == sorted(v.shape for v in got.values())


def test_the_python_api_computes_a_module_on_the_device():
    case = TORCH_CASES["torch_packed_bidir2_bf"]
    from safetensors.numpy import load_file

    state = load_file(str(TORCH / case["files"]["weights"]))
    with np.load(TORCH / case["files"]["in"]) as data:
        inputs = {k: data[k] for k in data.files}
    copies = []
    got = lg.torch_lstm_grad(inputs["x"], state_dict=state, batch_first=True, lengths=inputs["lengths"],
                             h_grad=inputs["h_grad"], hn_grad=inputs["hn_grad"],
                             backend=cuda_host.cupy_backend(copies=copies))
    want = lg.torch_lstm_grad(inputs["x"], state_dict=state, batch_first=True, lengths=inputs["lengths"],
                              h_grad=inputs["h_grad"], hn_grad=inputs["hn_grad"], backend="numpy")
    assert_same_bits(got, want)
    assert copies.count("out") == len(got)


def test_where_the_engine_computes_for_each_backend():
    """The host for the host backends and for a GPU backend that does not offer its array module (it computes the
    gradient on its device from host arrays, as before); the device for one that does."""
    assert devices.of(get_backend("numpy")) is devices.HOST
    stand_in = cuda_host.cupy_backend()
    there = devices.of(stand_in)
    assert not there.on_host and there.xp is stand_in.array_module

    class WithoutModule:
        name, version, gpu_arrays = "partial", "0", True
        to_device, to_host = stand_in.to_device, stand_in.to_host
        block_lstm_grad = stand_in.block_lstm_grad

    assert devices.of(WithoutModule()) is devices.HOST
    path, options = CASES["keras relu"][0]
    got = lg.load(path, **options).gradients(backend=WithoutModule())
    assert_same_bits(got, lg.load(path, **options).gradients(backend="numpy"))



@pytest.mark.parametrize("path, options", [(KERAS / "keras_seq.in.npz", {}),
                                           (TORCH / "torch_batch_first.in.npz", {"batch_first": True})])
def test_a_layer_read_for_a_gpu_backend_is_never_run_forward_on_the_host(path, options):
    """What ``lstmgrad seq`` reads (problem.reading.load_problem) for a framework's single layer holds the op's
    forward outputs unmade (reading.OpArrays): the cupy backend computes the layer on its device from the layer's own
    tensors and never asks for them, so no forward pass runs on the host for nothing; the numpy backend asks, and
    they are made once, for the op's gradient."""
    from lstmgrad_cli.problem.gradients import gradients
    from lstmgrad_cli.problem.reading import load_problem, ready
    from lstmgrad_cli.problem.request import request_from

    on_device = load_problem(path, request_from(**options))
    on_host = load_problem(path, request_from(**options))
    assert on_device.framework.single and on_device.sources["activations"] == "recomputed"
    assert "i" not in ready(on_device.arrays)  # read: the forward outputs not made yet
    assert_same_bits(gradients(on_device, cuda_host.cupy_backend()), gradients(on_host, get_backend("numpy")))
    assert "i" not in ready(on_device.arrays)  # never made: the device computed the layer
    assert "i" in ready(on_host.arrays)  # made for the op's gradient on the host


def _device_arrays(backend, tensors: dict) -> dict:
    """The tensors as the backend's device holds them (the stand-in's: each marked as copied in)."""
    return {name: backend.to_device(value) for name, value in tensors.items()}


def assert_stays_on_device(got, want, kind) -> None:
    for name, value in want.items():
        assert isinstance(got[name], kind), name  # the device's array: not copied back
        np.testing.assert_array_equal(np.asarray(got[name]), value, err_msg=name)


@pytest.mark.parametrize("api", ["keras layer", "torch module", "torch cell"])
def test_the_python_api_takes_a_layers_tensors_on_the_device_and_leaves_its_gradients_there(api):
    """Tensors on the device (cupy's arrays; here the stand-in's) are brought to the host once each to be checked,
    the layer is computed on the device, and each gradient is left there as the device's array: none copies back."""
    from safetensors.numpy import load_file

    copies = []
    backend = cuda_host.cupy_backend(copies=copies)
    if api == "keras layer":
        with np.load(KERAS / "keras_seq.in.npz") as data:
            tensors = {k: data[k] for k in data.files}

        def grads(given, on):
            return lg.keras_lstm_grad(**given, backend=on)._asdict()
    elif api == "torch module":
        case = TORCH_CASES["torch_packed_bidir2_bf"]
        with np.load(TORCH / case["files"]["in"]) as data:
            tensors = {k: data[k] for k in data.files if k != "lengths"}
            lengths = data["lengths"]
        state = load_file(str(TORCH / case["files"]["weights"]))
        tensors.update(state)

        def grads(given, on):
            weights = {k: given.pop(k) for k in state}
            return lg.torch_lstm_grad(**given, state_dict=weights, lengths=lengths, batch_first=True, backend=on)
    else:
        with np.load(TORCH / "torch_cell.in.npz") as data:
            tensors = {k: data[k] for k in data.files}
        state = load_file(str(TORCH / "torch_cell.weights.safetensors"))
        tensors.update({k.removeprefix("decoder.cell."): v for k, v in state.items()})

        def grads(given, on):
            return lg.torch_cell_grad(**given, backend=on)._asdict()

    want = {k: v for k, v in grads(dict(tensors), "numpy").items() if v is not None}
    on_device = _device_arrays(backend, tensors)
    del copies[:]
    got = grads(dict(on_device), backend)
    assert_stays_on_device({k: v for k, v in got.items() if v is not None}, want, backend.array_module.ndarray)
    assert copies.count("out") == len(tensors)  # each given tensor brought back once, to be checked; no gradient


class _OnGpu:
    """An array in GPU memory as numba's device arrays offer it (``__cuda_array_interface__``), which numpy cannot
    read; ``torch=True``: a torch CUDA tensor, which copies itself to the host (``.detach().cpu().numpy()``)."""

    def __init__(self, value, torch=False):
        self.__cuda_array_interface__ = {"shape": value.shape, "typestr": value.dtype.str, "data": (0, False),
                                         "version": 3}
        if torch:
            self.detach = lambda: self
            self.cpu = lambda: types.SimpleNamespace(numpy=lambda: value.copy())

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed")


def test_the_python_api_copies_torch_gpu_tensors_for_a_host_backend_and_refuses_other_gpu_arrays():
    with np.load(KERAS / "keras_seq.in.npz") as data:
        tensors = {k: data[k] for k in data.files}
    want = lg.keras_lstm_grad(**tensors, backend="numpy")
    # None, where cupy is not usable (no GPU): the default backend, on the host
    for backend in ("numpy",) if lg.backends.status("cupy").available else ("numpy", None):
        got = lg.keras_lstm_grad(**{**tensors, "x": _OnGpu(tensors["x"], torch=True)}, backend=backend)
        for name, value in want._asdict().items():
            assert type(getattr(got, name)) is np.ndarray
            np.testing.assert_array_equal(getattr(got, name), value, err_msg=name)
    with pytest.raises(lg.InvalidArgumentError, match="^x is on a GPU, and the numpy backend computes host arrays: "
                                                      "compute with backend cupy, or copy the tensors to the host$"):
        lg.keras_lstm_grad(**{**tensors, "x": _OnGpu(tensors["x"])}, backend="numpy")


@pytest.mark.parametrize("loop, pinned", [("steps", False), ("persistent", False), ("auto", True)])
def test_a_lazy_input_reaches_the_device_a_chunk_of_steps_at_a_time(loop, pinned):
    """An HDF5 input's time-major tensors (read by slicing) cross to the device a chunk of steps at a time, and a
    lazy x_grad output is filled a chunk at a time from the device: no tensor of all T steps is ever on the
    device, and the gradients are the numpy backend's."""
    from lstmgrad_cli.backends._cupy_copies import FED, fed_rows
    from lstmgrad_cli.backends._numpy import NumpyBackend
    from lstmgrad_cli.backends._xp import chunk_bounds
    from lstmgrad_cli.backends.conformance import LazyRows
    from lstmgrad_cli.spec import TIME_MAJOR, SeqTensors

    rng = np.random.default_rng(6)
    T, B, I, C = 12, 3, 4, 5  # noqa: E741
    shapes = dict(x=(T, B, I), cs_prev=(B, C), h_prev=(B, C), w=(I + C, 4 * C), wci=(C,), wcf=(C,), wco=(C,),
                  b=(4 * C,), **{name: (T, B, C) for name in ("i", "cs", "f", "o", "ci", "co", "h", "cs_grad",
                                                                 "h_grad")})
    arrays = {name: rng.uniform(0.05, 0.95, shape).astype(np.float32) for name, shape in shapes.items()}
    kw = dict(seq_len_max=T, use_peephole=True, layout="ifco", compute_dtype=np.dtype("float32"), chunk_steps=4)
    want = NumpyBackend().block_lstm_grad(SeqTensors(**arrays), **kw)
    sliced = []

    class Counted(LazyRows):  # (an HDF5 dataset's slicing goes through h5py; read_into through pread)
        def __getitem__(self, index):
            sliced.append(index)
            return super().__getitem__(index)

    lazy = SeqTensors(**{k: Counted(v) if k in TIME_MAJOR else v for k, v in arrays.items()})
    copied, host_operands = [], []
    x_grad = np.zeros((T, B, I), np.float32)
    got = cuda_host.cupy_backend(loop=loop, pinned=pinned, copied=copied, host_operands=host_operands).block_lstm_grad(
        lazy, **kw, x_grad_out=x_grad)
    assert got.x_grad is x_grad and host_operands == []
    for field, a, b in zip(want._fields, want, got, strict=True):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-6, err_msg=field)
    if pinned:  # the other tensors whole through the staging buffers, as bytes; the time-major ones fed a chunk of
        # steps at a time (cs with the step before the chunk, h with the steps before: _cupy_copies.fed_rows), each
        # read into a pinned buffer and copied from there as it is
        fed = sum((hi - lo) * arrays[name][0].nbytes for a, b in chunk_bounds(T, 4)
                  for name in FED for lo, hi in [fed_rows(name, a, b)])
        others = sum(a.nbytes for name, a in arrays.items() if name not in TIME_MAJOR)
        staged = [shape[0] for way, dtype, shape in copied if way == "in" and dtype == np.uint8]
        straight = [np.prod(shape) * 4 for way, dtype, shape in copied if way == "in" and dtype == np.float32]
        assert sum(staged) == others and sum(straight) == fed
        assert sliced == []  # fed: every row read into the feed's buffers (read_into)
    else:
        steps = [shape[0] for way, _, shape in copied if way == "in" and len(shape) == 3]
        assert steps and max(steps) == 4 + 1 < T  # a chunk's steps at most (cs with the step before the chunk)
