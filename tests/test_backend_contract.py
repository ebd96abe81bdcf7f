"""The backend contract (backends/contract.py) in code, and every backend held to it (backends/conformance.py):
the built-ins and their variants, the cupy backend through its kernels built for the host, any installed plugin,
and backends that break it in each way the contract names."""

from __future__ import annotations

import json
import warnings

import cuda_host
import numpy as np
import pytest
from test_backends import cpu_backends, plugins  # noqa: F401 - (the plugins fixture: real entry points)

from lstmgrad_cli import backends as reg
from lstmgrad_cli.backends import conformance
from lstmgrad_cli.backends._numpy import NumpyBackend
from lstmgrad_cli.backends.contract import Backend
from lstmgrad_cli.cli import main


@pytest.mark.parametrize("label, backend", cpu_backends(), ids=lambda v: v if isinstance(v, str) else "")
def test_every_backend_meets_the_contract(label, backend):
    assert isinstance(backend, Backend)
    assert conformance.check(backend) == []


def test_the_cupy_backend_meets_it_through_its_own_kernels():
    if cuda_host.compiler() is None:
        pytest.skip("no C compiler to build the cupy backend's kernels for the host")
    calls = []
    assert conformance.check(cuda_host.cupy_backend(calls)) == []
    assert {name.rsplit("_", 1)[1] for name in calls} == {"f16", "f32", "f64"}


class _PlainOnly(NumpyBackend):
    """A plugin written to the old one-sentence contract: x_grad_out and observe are not taken."""

    name = "plain-only"

    def block_lstm_grad(self, tensors, *, seq_len_max, use_peephole, layout, compute_dtype, chunk_steps=None,
                        return_dgates=False):
        return super().block_lstm_grad(tensors, seq_len_max=seq_len_max, use_peephole=use_peephole,
                                       layout=layout, compute_dtype=compute_dtype, chunk_steps=chunk_steps,
                                       return_dgates=return_dgates)


class _Float64Always(NumpyBackend):
    """Computes everything in float64 and returns it so: wrong dtypes, and no float16 rounding."""

    name = "float64-always"

    def block_lstm_grad(self, tensors, **kwargs):
        tensors = type(tensors)(*(None if a is None else np.asarray(a[()] if not hasattr(a, "__array__") else a,
                                                                        np.float64) for a in tensors))
        kwargs["compute_dtype"] = np.dtype(np.float64)
        return super().block_lstm_grad(tensors, **kwargs)


class _ArraysOnly(NumpyBackend):
    """Takes every input for a numpy array (astype), which a lazy input (an HDF5 file's, read by slicing) is not."""

    name = "arrays-only"

    def block_lstm_grad(self, tensors, **kwargs):
        return super().block_lstm_grad(type(tensors)(*(None if a is None else a.astype(a.dtype) for a in tensors)),
                                       **kwargs)


class _DeviceArray:
    """An array in a device's memory, as cupy's: numpy may not take it (cupy raises TypeError), ``get`` copies it."""

    def __init__(self, array):
        self._array = array

    def __array__(self, *args, **kwargs):
        raise TypeError("Implicit conversion to a NumPy array is not allowed. Please use `.get()`")

    def get(self):
        return np.array(self._array, copy=True)


class _ObservesOnItsDevice(NumpyBackend):
    """Hands ``observe`` the carried gradients as its device's arrays, and copies them back with ``to_host``."""

    name = "observes-on-device"

    def block_lstm_grad(self, tensors, observe=None, **kwargs):
        if observe is not None:
            given = observe
            observe = lambda t, h, cs: given(t, _DeviceArray(h), _DeviceArray(cs))  # noqa: E731
        return super().block_lstm_grad(tensors, observe=observe, **kwargs)

    def to_host(self, a):
        return a.get()


def test_a_backend_observing_on_its_device_meets_the_contract():
    # the cupy backend's check failed on a GPU: the check took observe's device arrays for numpy's
    assert conformance.check(_ObservesOnItsDevice()) == []


def test_a_backend_that_breaks_the_contract_is_told_how():
    plain = conformance.check(_PlainOnly())
    assert any("x_grad_out" in p and "raised TypeError" in p for p in plain)
    assert any("observe" in p and "raised TypeError" in p for p in plain)
    wide = conformance.check(_Float64Always())
    assert any("x_grad is float64 [5, 3, 4], not float32 [5, 3, 4]" in p for p in wide)
    arrays_only = conformance.check(_ArraysOnly())
    assert arrays_only and all("lazy" in p and "AttributeError" in p for p in arrays_only)
    assert conformance.check(type("Nameless", (NumpyBackend,), {"name": None})())[0] == "name is not a str"


PLUGIN_BROKEN = '''
from lstmgrad_cli.backends._numpy import NumpyBackend

class Plugin(NumpyBackend):
    name = "broken-grad"
    version = "1.0"

    def block_lstm_grad(self, tensors, **kwargs):
        out = super().block_lstm_grad(tensors, **kwargs)
        return out if kwargs.get("return_dgates") else out._replace(w_grad=out.w_grad * 2)
'''


def test_backends_check_holds_every_installed_plugin_to_the_contract(runner, plugins, tmp_path, monkeypatch):  # noqa: F811
    # the plugins fixture's myplug (a NumpyBackend) conforms; a plugin computing a wrong w_grad does not
    (tmp_path / "lstmgrad_broken_plugin.py").write_text(PLUGIN_BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    real = reg.importlib.metadata.entry_points
    broken = type("EP", (), {"name": "broken-grad", "value": "lstmgrad_broken_plugin:Plugin", "dist": None})()
    monkeypatch.setattr(reg.importlib.metadata, "entry_points", lambda group: [*real(group=group), broken])
    reg.refresh()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        result = runner.invoke(main, ["backends", "--check", "--json"], catch_exceptions=False)
    builds = {b["backend"]: b for b in json.loads(result.stdout)["builds"]}
    assert result.exit_code == 1
    assert builds["myplug"]["ok"] is None or "meets the backend contract" in builds["myplug"]["detail"]
    assert builds["broken-grad"]["ok"] is False
    assert builds["broken-grad"]["detail"].startswith("does not meet the backend contract: ")
    assert "w_grad is" in builds["broken-grad"]["detail"] and "of its scale off the numpy backend's" in \
        builds["broken-grad"]["detail"]
    assert "meets the backend contract" in builds["numpy"]["detail"]
